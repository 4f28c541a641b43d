"""Attention backends against the oracle: set_kv, absorbed MLA, ragged / chunked MHA, merge."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plugserve.conformance import oracle
from plugserve.conformance.batches import random_batch
from plugserve.conformance.cases import GraphCase, MHACase, MLACase
from plugserve.conformance.plugin import Target, require_available
from plugserve.conformance.tolerances import assert_close, assert_lse_close
from plugserve.core.dispatch import prepare_attention
from plugserve.core.forward_batch import AttnForwardMethod, DraftTree, ForwardBatch, ForwardMode, Phase
from plugserve.core.graph_inputs import GraphInputs, padded_size
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import AttentionBackend
from plugserve.core.kv_cache import MLAKVPool, pages_needed
from plugserve.core.specs import AttentionSpec

LAYER = 1  # not 0, so that a backend ignoring layer_id is caught


def _backend(target: Target, spec: AttentionSpec, phase: Phase, hardware: Hardware, device: torch.device
             ) -> AttentionBackend:
    require_available(target, hardware)
    fits = target.cls.capabilities.check(spec, phase)
    if not fits:
        pytest.skip(f"{target.entry.name}: {fits.reason}")
    return target.cls(spec, device)  # type: ignore[call-arg]


def _mla_setup(target: Target, case: MLACase, page_size: int, hardware: Hardware, device: torch.device):
    caps = target.cls.capabilities
    if case.mode not in caps.mla_modes:  # type: ignore[attr-defined]
        pytest.skip(f"{target.entry.name} does not run absorbed MLA in {case.mode.name}")
    fp8 = case.fp8_kv_scale is not None
    spec = AttentionSpec(num_heads=case.num_heads, dtype=target.dtype, page_size=page_size,
                         kv_cache_dtype=torch.float8_e4m3fn if fp8 else None)
    backend = _backend(target, spec, Phase.DECODE, hardware, device)
    batch = random_batch(case.mode, case.seq_lens, case.extend_lens, spec, device,
                         kv_scale=case.fp8_kv_scale if fp8 else 1.0)
    batch.attn_method = AttnForwardMethod.MLA
    return spec, backend, batch


def test_set_kv(attention_target: Target, mla_case: MLACase, page_size: int, plugserve_hardware, plugserve_device):
    spec, backend, batch = _mla_setup(attention_target, mla_case, page_size, plugserve_hardware, plugserve_device)
    expected = batch.kv_pool.buffer(LAYER).clone()
    latent = torch.randn(batch.num_tokens, spec.kv_lora_rank, device=plugserve_device, dtype=spec.dtype)
    k_rope = torch.randn(batch.num_tokens, spec.qk_rope_head_dim, device=plugserve_device, dtype=spec.dtype)
    pool = batch.kv_pool
    stored = oracle.stored_kv(torch.cat([latent, k_rope], dim=-1), pool.dtype, pool.scale)
    expected[batch.out_cache_loc] = (stored / (pool.scale if pool.dtype == oracle.FP8 else 1.0)).to(expected.dtype)
    other_layer = batch.kv_pool.buffer(0).clone()
    backend.plan(batch)
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[expected.element_size()]  # fp8 has no torch.equal
    assert torch.equal(pool.buffer(LAYER).view(bits), expected.view(bits)), "set_kv wrote the wrong values or slots"
    assert torch.equal(pool.buffer(0).view(bits), other_layer.view(bits)), "set_kv wrote into another layer"


def test_forward_mla(attention_target: Target, mla_case: MLACase, page_size: int, plugserve_hardware,
                     plugserve_device):
    spec, backend, batch = _mla_setup(attention_target, mla_case, page_size, plugserve_hardware, plugserve_device)
    _check_forward_mla(spec, backend, batch, str(mla_case))


# Per request, the parent of each node of a draft tree (node 0: the last accepted token): a bushy tree, and a
# chain with side branches, so that no node's visible set is a causal one.
TREE_PARENTS = ((-1, 0, 0, 1, 1, 3), (-1, 0, 1, 0, 2, 2))


def test_forward_mla_tree_verify(attention_target: Target, page_size: int, attention_heads: int, plugserve_hardware,
                                 plugserve_device):
    """TARGET_VERIFY of draft trees: a node sees its request's prefix, its ancestors and itself only."""
    caps = attention_target.cls.capabilities
    if not caps.tree_verify:  # type: ignore[attr-defined]
        pytest.skip(f"{attention_target.entry.name} does not declare tree_verify (draft trees)")
    case = MLACase(ForwardMode.TARGET_VERIFY, (17, 40), (len(TREE_PARENTS[0]),) * 2, attention_heads)
    spec, backend, batch = _mla_setup(attention_target, case, page_size, plugserve_hardware, plugserve_device)
    batch = batch.with_tree(DraftTree.of(torch.tensor(TREE_PARENTS, device=plugserve_device)))
    _check_forward_mla(spec, backend, batch, f"tree {TREE_PARENTS} {case}")


def _check_forward_mla(spec: AttentionSpec, backend: AttentionBackend, batch: ForwardBatch, what: str) -> None:
    t, h, device, dtype = batch.num_tokens, spec.num_heads, batch.block_table.device, spec.dtype
    latent = torch.randn(t, spec.kv_lora_rank, device=device, dtype=dtype)
    k_rope = torch.randn(t, spec.qk_rope_head_dim, device=device, dtype=dtype)
    q_nope = torch.randn(t, h, spec.kv_lora_rank, device=device, dtype=dtype)
    q_rope = torch.randn(t, h, spec.qk_rope_head_dim, device=device, dtype=dtype)
    # Before the backend writes: the oracle reads the cached prefix and takes the new tokens from the inputs.
    expected, _, slack = oracle.mla_as_declared(batch, LAYER, q_nope, q_rope, latent, k_rope,
                                                oracle.softmax_scale(spec), backend.rounds_decode_to_e4m3)
    backend.plan(batch)
    backend.set_kv(LAYER, batch.out_cache_loc, latent, k_rope)
    out = backend.forward_mla(q_nope, q_rope, LAYER)
    assert out.dtype == dtype
    assert_close(out, expected, dtype, f"forward_mla {what}", slack=slack)
    if batch.mode is ForwardMode.DECODE:
        # The model's call at decode: the output through W_UV, which a backend may fold into its last kernel.
        w_vc = (torch.randn(h, spec.kv_lora_rank, spec.v_head_dim, device=device) / spec.kv_lora_rank**0.5).to(dtype)
        projected = backend.forward_mla_projected(q_nope, q_rope, LAYER, w_vc)
        assert projected.dtype == dtype and projected.shape == (t, h, spec.v_head_dim)
        expected = torch.einsum("thr,hrv->thv", expected.to(dtype).double(), w_vc.double())
        if slack is not None:
            slack = torch.einsum("thr,hrv->thv", slack, w_vc.double().abs())
        assert_close(projected, expected, dtype, f"forward_mla_projected {what}", slack=slack)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_forward_mla_is_batch_invariant(attention_target: Target, mode: ForwardMode, page_size: int,
                                        attention_heads: int, plugserve_hardware, plugserve_device):
    """A backend declaring `batch_invariant`, built for it: a request's rows are the same bits alone as inside a
    batch of other lengths, and (EXTEND) its last token's row the same after a cached prefix as in a whole prefill."""
    if not attention_target.cls.capabilities.batch_invariant:
        pytest.skip(f"{attention_target.entry.name} does not declare batch_invariant")
    seq_lens, extend_lens = (70, 9, 133), ((6, 9, 1) if mode is ForwardMode.EXTEND else (1, 1, 1))
    spec = AttentionSpec(num_heads=attention_heads, dtype=attention_target.dtype, page_size=page_size,
                         batch_invariant=True)
    backend = _backend(attention_target, spec, Phase.DECODE, plugserve_hardware, plugserve_device)
    batch = random_batch(mode, seq_lens, extend_lens, spec, plugserve_device)
    t, h, dtype, device = batch.num_tokens, spec.num_heads, spec.dtype, plugserve_device
    q_nope = torch.randn(t, h, spec.kv_lora_rank, device=device, dtype=dtype)
    q_rope = torch.randn(t, h, spec.qk_rope_head_dim, device=device, dtype=dtype)
    backend.plan(batch)
    backend.set_kv(LAYER, batch.out_cache_loc, torch.randn(t, spec.kv_lora_rank, device=device, dtype=dtype),
                   torch.randn(t, spec.qk_rope_head_dim, device=device, dtype=dtype))
    together = backend.forward_mla(q_nope, q_rope, LAYER)
    first = 0
    for row, (seq_len, new) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        for alone_new in sorted({new, 1}):  # the request's own tokens, then its last one after the rest as a prefix
            alone = ForwardBatch.build(mode, [seq_len], [alone_new], batch.block_table[row : row + 1], batch.kv_pool)
            alone.attn_method = AttnForwardMethod.MLA
            backend.plan(alone)
            rows = slice(first + new - alone_new, first + new)
            out = backend.forward_mla(q_nope[rows], q_rope[rows], LAYER)
            assert torch.equal(out, together[rows]), f"request {row} ({alone_new} of {new} new tokens) alone"
        first += new


def test_forward_mla_in_cuda_graph(attention_target: Target, graph_case: GraphCase, page_size: int,
                                   plugserve_hardware, plugserve_device):
    """Capture set_kv + forward_mla once, then replay on batches of other sizes (padded), lengths and
    pages: every replay must match the oracle on the real rows, with the new KV in the right slots.
    Without a GPU there is no graph: the same plan_capture / plan_replay sequence runs eagerly, which
    still checks that plan_replay refreshes everything forward_mla reads. A backend declaring
    graph_plan_on_device has plan_replay captured inside the graph (as the runner does) and not called again."""
    caps = attention_target.cls.capabilities
    if graph_case.mode not in caps.graph_modes:  # type: ignore[attr-defined]
        pytest.skip(f"{attention_target.entry.name} does not declare {graph_case.mode.name} in graph_modes")
    spec = AttentionSpec(num_heads=graph_case.num_heads, dtype=attention_target.dtype, page_size=page_size)
    backend = _backend(attention_target, spec, Phase.DECODE, plugserve_hardware, plugserve_device)
    bs, n, device, dtype = graph_case.batch_size, graph_case.per_request, plugserve_device, spec.dtype
    scale = oracle.softmax_scale(spec)
    max_pages = pages_needed(max(max(lens) for lens in graph_case.replays), page_size)
    num_pages = bs * max_pages + 1  # the last one is the padding page
    pool = MLAKVPool(LAYER + 1, num_pages, page_size, spec.kv_lora_rank, spec.qk_rope_head_dim, dtype, device)
    for layer in range(LAYER + 1):
        pool.buffer(layer).copy_(torch.randn_like(pool.buffer(layer), dtype=torch.float32))
    inputs = GraphInputs(bs, n, max_pages, pool, padding_page=num_pages - 1)
    tokens = bs * n
    q_nope = torch.randn(tokens, spec.num_heads, spec.kv_lora_rank, device=device, dtype=dtype)
    q_rope = torch.randn(tokens, spec.num_heads, spec.qk_rope_head_dim, device=device, dtype=dtype)
    latent = torch.randn(tokens, spec.kv_lora_rank, device=device, dtype=dtype)
    k_rope = torch.randn(tokens, spec.qk_rope_head_dim, device=device, dtype=dtype)

    backend.init_cuda_graph(bs, tokens, max_pages)
    sizes = sorted({bs, max(1, bs // 2)})  # two graphs on one backend, captured largest first as the runner does
    graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, Callable[[], torch.Tensor]]] = {}
    outputs: dict[int, torch.Tensor] = {}
    for size in reversed(sizes):
        static = inputs.batch(graph_case.mode, size)
        backend.plan_capture(static)
        rows = size * n

        def run(static: ForwardBatch = static, rows: int = rows) -> torch.Tensor:
            if caps.graph_plan_on_device:  # type: ignore[attr-defined]
                backend.plan_replay(static)
            backend.set_kv(LAYER, static.out_cache_loc, latent[:rows], k_rope[:rows])
            return backend.forward_mla(q_nope[:rows], q_rope[:rows], LAYER)

        graph = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                run()  # JIT and lazy allocations outside the capture
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outputs[size] = run()
        graphs[size] = graph, run

    for seq_lens in graph_case.replays:
        size = padded_size(sizes, len(seq_lens))
        order = torch.randperm(num_pages - 1).tolist()
        pages = [[order.pop() for _ in range(pages_needed(s, page_size))] for s in seq_lens]
        width = max(len(p) for p in pages)
        table = torch.tensor([p + [p[0]] * (width - len(p)) for p in pages], dtype=torch.int32, device=device)
        real = ForwardBatch.build(graph_case.mode, list(seq_lens), [n] * len(seq_lens), table, pool)
        real.attn_method = AttnForwardMethod.MLA
        for t in (q_nope, q_rope, latent, k_rope):
            t.copy_(torch.randn_like(t))
        t = real.num_tokens
        expected, _, slack = oracle.mla_as_declared(real, LAYER, q_nope[:t], q_rope[:t], latent[:t], k_rope[:t],
                                                    scale, backend.rounds_decode_to_e4m3)
        loaded = inputs.load(torch.zeros(real.num_tokens, dtype=torch.int64, device=device), real, size)
        if not caps.graph_plan_on_device:  # type: ignore[attr-defined]
            backend.plan_replay(loaded)
        graph, run = graphs[size]
        if graph is not None:
            graph.replay()
            out = outputs[size]
        else:
            out = run()
        written = pool.gather(LAYER, real.out_cache_loc)
        assert torch.equal(written, torch.cat([latent[:t], k_rope[:t]], dim=-1)), "set_kv in the graph missed slots"
        assert_close(out[:t], expected, dtype, f"graph replay {graph_case} (graph of {size}) seq_lens {seq_lens}",
                     slack=slack)


def test_forward_mha(attention_target: Target, mha_case: MHACase, plugserve_hardware, plugserve_device):
    """Every forward_mha call against the oracle; with MHA_CHUNKED_KV also the whole: the causal part and
    every prefix chunk, merged by the backend's merge_attn_states, must be attention over the sequences."""
    if mha_case.method not in attention_target.cls.capabilities.methods:  # type: ignore[attr-defined]
        pytest.skip(f"{attention_target.entry.name} does not implement {mha_case.method.name}")
    spec = AttentionSpec(num_heads=mha_case.num_heads, dtype=attention_target.dtype)
    backend = _backend(attention_target, spec, Phase.PREFILL, plugserve_hardware, plugserve_device)
    seq_lens = [p + e for p, e in zip(mha_case.prefix_lens, mha_case.extend_lens, strict=True)]
    batch = random_batch(ForwardMode.EXTEND, seq_lens, mha_case.extend_lens, spec, plugserve_device, num_layers=1)
    prepare_attention(batch, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=mha_case.chunk_capacity)
    assert batch.attn_method is mha_case.method
    backend.plan(batch)
    dtype, device, h, scale = spec.dtype, plugserve_device, spec.num_heads, oracle.softmax_scale(spec)
    # K/V of every position of every request's whole sequence, request-major; each call takes its rows.
    q = torch.randn(batch.num_tokens, h, spec.qk_head_dim, device=device, dtype=dtype)
    k = torch.randn(sum(seq_lens), h, spec.qk_head_dim, device=device, dtype=dtype)
    v = torch.randn(sum(seq_lens), h, spec.v_head_dim, device=device, dtype=dtype)
    seq_starts = [sum(seq_lens[:b]) for b in range(len(seq_lens))]

    def rows(first: list[int], lens: list[int]) -> torch.Tensor:
        """Rows of positions [first[b], first[b] + lens[b]) of every request b."""
        return torch.cat([torch.arange(s + f, s + f + n) for s, f, n in zip(seq_starts, first, lens, strict=True)])

    def call(kv_rows: torch.Tensor, chunk: int | None, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        k_part, v_part = k[kv_rows.to(device)], v[kv_rows.to(device)]
        out, lse = backend.forward_mha(q, k_part, v_part, prefix_chunk=chunk)
        expected, expected_lse = oracle.mha(batch, q, k_part, v_part, scale, prefix_chunk=chunk)
        assert_close(out, expected, dtype, f"forward_mha {mha_case} {what} output")
        assert_lse_close(lse, expected_lse, dtype, f"forward_mha {mha_case} {what} lse")
        return out, lse

    if mha_case.method is AttnForwardMethod.MHA:
        call(rows([0] * len(seq_lens), seq_lens), None, "causal")
        return
    out, lse = call(rows(batch.prefix_lens_cpu, batch.extend_lens_cpu), None, "causal over the new tokens")
    for i, chunk in enumerate(batch.prefix_chunks):
        out, lse = backend.merge_attn_states(out, lse, *call(rows(chunk.starts_cpu, chunk.lens_cpu), i,
                                                             f"prefix chunk {i}"))
    expected, expected_lse = oracle.ragged_attention(q, k, v, batch.extend_lens_cpu, seq_lens, scale, causal=True)
    assert_close(out, expected, dtype, f"forward_mha {mha_case} chunks merged: output")
    assert_lse_close(lse, expected_lse, dtype, f"forward_mha {mha_case} chunks merged: lse")


def test_merge_attn_states(attention_target: Target, attention_heads: int, plugserve_hardware, plugserve_device):
    caps = attention_target.cls.capabilities
    if AttnForwardMethod.MHA_CHUNKED_KV not in caps.methods:  # type: ignore[attr-defined]
        pytest.skip(f"{attention_target.entry.name} does not implement MHA_CHUNKED_KV")
    spec = AttentionSpec(num_heads=attention_heads, dtype=attention_target.dtype)
    backend = _backend(attention_target, spec, Phase.PREFILL, plugserve_hardware, plugserve_device)
    t, h, d, device, dtype = 37, spec.num_heads, spec.v_head_dim, plugserve_device, spec.dtype
    out_a, out_b = (torch.randn(t, h, d, device=device, dtype=dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, device=device) * 3 for _ in range(2))
    # No visible key on one side, on the other, and on both (rows 0-2): what empty prefix chunks give.
    lse_a[0], lse_b[1] = float("-inf"), float("-inf")
    lse_a[2], lse_b[2] = float("-inf"), float("-inf")
    out_a[0], out_b[1], out_a[2], out_b[2] = 0, 0, 0, 0
    out, lse = backend.merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = oracle.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert_close(out, ref_out, dtype, "merge_attn_states output")
    assert_lse_close(lse, ref_lse, dtype, "merge_attn_states lse")
