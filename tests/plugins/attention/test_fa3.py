"""The fa3 / fa3_mla backends on the CPU: declarations, availability reasons, library choice and version
checks, and every argument the backends hand the libraries, checked by fake libraries that implement
the libraries' documented contracts in torch (key lengths read back from the offsets, lse [H, T], paged
k/v caches read through the page table) against the torch reference."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from plugserve.conformance.batches import random_batch
from plugserve.conformance.tolerances import assert_close, assert_lse_close
from plugserve.core.dispatch import prepare_attention
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode, Phase
from plugserve.core.graph_inputs import GraphInputs
from plugserve.core.hardware import Hardware
from plugserve.core.kv_cache import MLAKVPool, pages_needed
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention import fa3
from plugserve.plugins.attention.fa3 import (
    CUTE,
    FA3,
    FA3Attention,
    FA3MLAAttention,
    LibraryMissing,
    load_mha_library,
    paged_kv_views,
    plan_varlen_calls,
)
from plugserve.plugins.attention.torch_ref import TorchRefAttention, causal_mask, ragged_attention
from plugserve.registry import Registry

CPU = torch.device("cpu")
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132)
A100 = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 << 30, 108)
B200 = Hardware("cuda", "NVIDIA B200", (10, 0), 180 << 30, 148)
HEADS, R, P = 3, 32, 16
LAYER = 1


def spec_of(dtype: torch.dtype = torch.float32, page_size: int = 1, qk: int = 40, v: int = 24) -> AttentionSpec:
    return AttentionSpec(num_heads=HEADS, kv_lora_rank=R, qk_nope_head_dim=qk - P, qk_rope_head_dim=P,
                         v_head_dim=v, dtype=dtype, page_size=page_size)


# -- fake libraries: the documented contracts, in torch --------------------------------------------------


def lens_of(cu: torch.Tensor) -> list[int]:
    return (cu[1:] - cu[:-1]).tolist()


def fake_varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, softmax_scale, causal):
    """What both libraries' varlen forwards compute: out [T, H, Dv] and lse [H, T] (head-major). The
    fakes' signatures follow the real ones, so a misnamed argument raises TypeError; the lse comes
    back only when asked for (FA3: return_attn_probs, flash_attn.cute: return_lse)."""
    q_lens, kv_lens = lens_of(cu_q), lens_of(cu_kv)
    assert cu_q.dtype == cu_kv.dtype == torch.int32
    assert max_q == max(q_lens) and max_kv == max(kv_lens), "max_seqlen must be the longest run"
    out, lse = ragged_attention(q, k, v, q_lens, kv_lens, softmax_scale, causal)
    return out, lse.t().contiguous()


def fa3_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                    seqused_k=None, softmax_scale=None, causal=False, return_attn_probs=False):
    out, lse = fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return (out, lse) if return_attn_probs else out


def old_fa3_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                        causal=False):
    raise AssertionError("a too-old FA3 must not be called")


def cute_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     softmax_scale=None, causal=False, return_lse=False):
    out, lse = fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return out, (lse if return_lse else None)


KVCACHE_CALLS: list[dict] = []  # per fa3_with_kvcache call: data_ptr of page_table / cache_seqlens / cu_seqlens_q


def fa3_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, cache_seqlens=None, page_table=None,
                     cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, causal=False):
    """FA3's paged MLA: q [T, H, Dk] and qv [T, H, Dv] varlen by cu_seqlens_q; k_cache [pages, page_size,
    1, Dk], v_cache [pages, page_size, 1, Dv]; request b's keys are its first cache_seqlens[b] positions,
    position j at page page_table[b, j // page_size], row j % page_size; scores q.k + qv.v, bottom-right
    causal. Returns [T, H, Dv] in q's dtype."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and page_table.dtype == torch.int32
    assert page_table.stride(-1) == 1 and cache_seqlens.dtype == cu_seqlens_q.dtype == torch.int32
    KVCACHE_CALLS.append({"page_table": page_table.data_ptr(), "cache_seqlens": cache_seqlens.data_ptr(),
                          "cu_seqlens_q": cu_seqlens_q.data_ptr(), "max_seqlen_q": max_seqlen_q})
    num_pages, page_size = k_cache.shape[:2]
    assert k_cache.shape[2] == v_cache.shape[2] == 1 and v_cache.shape[:2] == (num_pages, page_size)
    assert max_seqlen_q == max(lens_of(cu_seqlens_q))
    out = torch.zeros(*qv.shape, dtype=torch.float32)
    offsets = cu_seqlens_q.tolist()
    for b, kv_len in enumerate(cache_seqlens.tolist()):
        positions = torch.arange(kv_len)
        pages = page_table[b, positions // page_size].long()
        rows_in_page = positions % page_size
        keys, values = k_cache[pages, rows_in_page, 0].float(), v_cache[pages, rows_in_page, 0].float()
        rows = slice(offsets[b], offsets[b + 1])
        scores = (torch.einsum("qhd,kd->hqk", q[rows].float(), keys)
                  + torch.einsum("qhd,kd->hqk", qv[rows].float(), values)) * softmax_scale
        if causal:
            scores = scores.masked_fill(~causal_mask(scores.shape[1], kv_len), float("-inf"))
        out[rows] = torch.einsum("hqk,kd->qhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


FAKE_FA3 = SimpleNamespace(flash_attn_varlen_func=fa3_varlen_func, flash_attn_with_kvcache=fa3_with_kvcache)
FAKE_CUTE = SimpleNamespace(flash_attn_varlen_func=cute_varlen_func)


def installed(*modules: SimpleNamespace | None) -> dict[str, SimpleNamespace | None]:
    return {FA3: modules[0], CUTE: modules[1]}


@pytest.fixture
def fake_libraries(monkeypatch: pytest.MonkeyPatch):
    """Returns set(fa3_module, cute_module): None for a package that is not installed."""

    def install(fa3_module: SimpleNamespace | None, cute_module: SimpleNamespace | None) -> None:
        modules = installed(fa3_module, cute_module)

        def fake_import(module: str, hint: str):
            if modules[module] is None:
                raise LibraryMissing(f"{module} is not installed (fake); {hint}")
            return modules[module]

        monkeypatch.setattr(fa3, "_import", fake_import)

    return install


# -- declarations, capabilities, availability --------------------------------------------------------


def test_declarations_and_registration() -> None:
    FA3Attention.check_declaration()
    FA3MLAAttention.check_declaration()
    registry = Registry(builtin=("plugserve.plugins.attention.fa3",), entry_points=False)
    assert not registry.broken
    assert set(registry.backends["attention"]) == {"fa3", "fa3_mla"}


def test_capabilities() -> None:
    v3 = AttentionSpec()  # DeepSeek-V3: 128 heads, qk 192 / v 128, latent 512 + rope 64, bf16
    assert FA3Attention.capabilities.phases() == {Phase.PREFILL}
    assert FA3MLAAttention.capabilities.phases() == {Phase.PREFILL, Phase.DECODE}
    assert AttnForwardMethod.MLA not in FA3Attention.capabilities.methods
    assert FA3Attention.capabilities.check(v3, Phase.PREFILL)
    assert "does not run decode" in FA3Attention.capabilities.check(v3, Phase.DECODE).reason
    assert FA3MLAAttention.capabilities.check(v3, Phase.DECODE)
    assert FA3MLAAttention.capabilities.check(AttentionSpec(page_size=1), Phase.DECODE)  # any page size
    assert FA3MLAAttention.capabilities.forced_page_size() is None
    other_rank = AttentionSpec(kv_lora_rank=256)
    assert "kv_lora_rank 256" in FA3MLAAttention.capabilities.check(other_rank, Phase.DECODE).reason
    small_heads = AttentionSpec(qk_nope_head_dim=64, v_head_dim=64)
    assert "(128, 64)" in FA3Attention.capabilities.check(small_heads, Phase.PREFILL).reason
    assert "float32" in FA3Attention.capabilities.check(AttentionSpec(dtype=torch.float32), Phase.PREFILL).reason


def test_availability_names_the_gpu_and_the_missing_packages(fake_libraries) -> None:
    cpu = Hardware.detect(CPU)
    assert "not cpu" in FA3Attention.availability(cpu).reason
    assert "needs sm90" in FA3Attention.availability(A100).reason
    assert "up to sm90" in FA3Attention.availability(B200).reason
    fake_libraries(None, None)
    reason = FA3Attention.availability(H100).reason
    assert "flash_attn_interface is not installed" in reason and "flash_attn.cute is not installed" in reason
    assert "pip install --pre flash-attn-4" in reason
    fake_libraries(None, FAKE_CUTE)
    assert FA3Attention.availability(H100)
    reason = FA3MLAAttention.availability(H100).reason  # flash_attn.cute has no sm90 MLA
    assert "flash_attn_interface is not installed" in reason and "flash_attn.cute" not in reason
    fake_libraries(SimpleNamespace(flash_attn_varlen_func=old_fa3_varlen_func), FAKE_CUTE)
    assert "too old" in FA3MLAAttention.availability(H100).reason
    assert load_mha_library((FA3, CUTE)).name == CUTE  # an old FA3 falls back to flash_attn.cute
    fake_libraries(FAKE_FA3, None)
    assert FA3Attention.availability(H100) and FA3MLAAttention.availability(H100)


def test_real_imports_say_what_is_missing() -> None:
    # Where the packages are absent (the CPU test machine), the real probe names them.
    if importlib.util.find_spec("flash_attn_interface") is not None:
        pytest.skip("flash_attn_interface is installed here")
    with pytest.raises(LibraryMissing, match="flash_attn_interface is not installed"):
        load_mha_library((FA3,))


def test_library_order(fake_libraries) -> None:
    fake_libraries(FAKE_FA3, FAKE_CUTE)
    assert load_mha_library((FA3, CUTE)).name == FA3  # FA3 first when both are installed
    assert load_mha_library((CUTE,)).name == CUTE
    fake_libraries(None, FAKE_CUTE)
    assert load_mha_library((FA3, CUTE)).name == CUTE
    with pytest.raises(LibraryMissing, match="flash_attn_interface is not installed"):
        load_mha_library((FA3,))


# -- plan: the key side of every varlen call ---------------------------------------------------------


def test_plan_varlen_calls() -> None:
    spec = spec_of()
    one_shot = random_batch(ForwardMode.EXTEND, [50, 7, 66], [10, 7, 1], spec, CPU)
    prepare_attention(one_shot, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=1 << 30)
    causal, chunks = plan_varlen_calls(one_shot)
    assert causal.causal and causal.kv_lens == [50, 7, 66] and causal.max_kv == 66 and chunks == []
    assert causal.cu_kv.dtype == torch.int32 and causal.cu_kv.tolist() == [0, 50, 57, 123]

    chunked = random_batch(ForwardMode.EXTEND, [105, 9, 40], [5, 9, 3], spec, CPU)
    prepare_attention(chunked, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=32)
    assert chunked.attn_method is AttnForwardMethod.MHA_CHUNKED_KV
    causal, chunks = plan_varlen_calls(chunked)
    assert causal.causal and causal.kv_lens == [5, 9, 3] and causal.cu_kv.tolist() == [0, 5, 14, 17]
    assert len(chunks) == len(chunked.prefix_chunks) > 1
    for call, chunk in zip(chunks, chunked.prefix_chunks, strict=True):
        assert not call.causal and call.kv_lens == chunk.lens_cpu and call.max_kv == max(chunk.lens_cpu)
        assert call.cu_kv.tolist() == [0, *torch.tensor(chunk.lens_cpu).cumsum(0).tolist()]

    for mode, seq_lens, extend_lens in ((ForwardMode.DECODE, [9, 3], [1, 1]), (ForwardMode.EXTEND, [20, 9], [4, 2])):
        batch = random_batch(mode, seq_lens, extend_lens, spec, CPU)
        prepare_attention(batch)  # decode, and a short prefix: absorbed MLA
        assert batch.attn_method is AttnForwardMethod.MLA
        assert plan_varlen_calls(batch) == (None, [])


# -- forward_mha and forward_mla through the fake libraries -------------------------------------------

MHA_CASES = {
    "causal": (AttnForwardMethod.MHA, [0, 0, 0], [1, 9, 40], 1 << 30),
    "one_shot_prefix": (AttnForwardMethod.MHA, [40, 0, 65], [10, 5, 1], 1 << 30),
    "chunked_prefix": (AttnForwardMethod.MHA_CHUNKED_KV, [100, 0, 37], [5, 9, 3], 32),
}


@pytest.mark.parametrize("library", [FA3, CUTE])
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_forward_mha(fake_libraries, case: str, library: str) -> None:
    fake_libraries(FAKE_FA3 if library == FA3 else None, FAKE_CUTE)
    method, prefix_lens, extend_lens, capacity = MHA_CASES[case]
    spec = spec_of()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    batch = random_batch(ForwardMode.EXTEND, seq_lens, extend_lens, spec, CPU, num_layers=1)
    prepare_attention(batch, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=capacity)
    assert batch.attn_method is method
    backend, reference = FA3Attention(spec, CPU), TorchRefAttention(spec, CPU)
    assert backend.library.name == library
    backend.plan(batch)
    reference.plan(batch)
    keys = [torch.randn(s, HEADS, spec.qk_head_dim) for s in seq_lens]
    values = [torch.randn(s, HEADS, spec.v_head_dim) for s in seq_lens]
    q = torch.randn(batch.num_tokens, HEADS, spec.qk_head_dim)

    def check(kv_slices: list[slice], chunk: int | None) -> None:
        k = torch.cat([kb[s] for kb, s in zip(keys, kv_slices, strict=True)])
        v = torch.cat([vb[s] for vb, s in zip(values, kv_slices, strict=True)])
        out, lse = backend.forward_mha(q, k, v, prefix_chunk=chunk)
        ref_out, ref_lse = reference.forward_mha(q, k, v, prefix_chunk=chunk)
        assert lse.shape == (batch.num_tokens, HEADS)
        assert_close(out, ref_out, spec.dtype, f"{case} chunk {chunk} out")
        assert_lse_close(lse, ref_lse, spec.dtype, f"{case} chunk {chunk} lse")
        with pytest.raises(ValueError, match="k must be"):
            backend.forward_mha(q, k[1:], v[1:], prefix_chunk=chunk)

    if method is AttnForwardMethod.MHA:
        check([slice(None)] * len(seq_lens), None)
    else:
        check([slice(p, None) for p in prefix_lens], None)
        for i, chunk in enumerate(batch.prefix_chunks):
            check([slice(s, s + n) for s, n in zip(chunk.starts_cpu, chunk.lens_cpu, strict=True)], i)
    with pytest.raises(ValueError, match="out of range"):
        backend.forward_mha(q, q, q, prefix_chunk=len(batch.prefix_chunks))


def test_paged_kv_views_are_the_pool_columns() -> None:
    spec = spec_of(page_size=4)
    batch = random_batch(ForwardMode.DECODE, [9, 5], [1, 1], spec, CPU)
    pool = batch.kv_pool
    k_rope, latent = paged_kv_views(pool.paged(LAYER), R)
    assert k_rope.shape == (pool.num_pages, 4, 1, P) and latent.shape == (pool.num_pages, 4, 1, R)
    buffer = pool.buffer(LAYER)
    assert k_rope.data_ptr() == buffer[:, R:].data_ptr() and latent.data_ptr() == buffer.data_ptr()  # no copy
    for slot in (0, 5, pool.num_slots - 1):
        page, row = divmod(slot, 4)
        assert torch.equal(k_rope[page, row, 0], buffer[slot, R:])
        assert torch.equal(latent[page, row, 0], buffer[slot, :R])


MLA_CASES = {
    "decode": (ForwardMode.DECODE, [1, 70, 130, 33], [1, 1, 1, 1]),
    "target_verify": (ForwardMode.TARGET_VERIFY, [5, 80], [4, 4]),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [12, 66], [3, 1]),
    "extend_prefix": (ForwardMode.EXTEND, [20, 90], [7, 13]),
}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_forward_mla(fake_libraries, case: str, page_size: int) -> None:
    fake_libraries(FAKE_FA3, None)
    mode, seq_lens, extend_lens = MLA_CASES[case]
    spec = spec_of(torch.float16, page_size=page_size)
    batch = random_batch(mode, seq_lens, extend_lens, spec, CPU)
    prepare_attention(batch)
    backend, reference = FA3MLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    backend.plan(batch)
    reference.plan(batch)
    t = batch.num_tokens
    backend.set_kv(LAYER, batch.out_cache_loc, torch.randn(t, R), torch.randn(t, P))
    # As the model hands them over: q_nope a head-major product viewed token-major, q_rope a slice of q.
    q_nope = torch.randn(HEADS, t, R, dtype=spec.dtype).transpose(0, 1)
    q_rope = torch.randn(t, HEADS, 40, dtype=spec.dtype)[:, :, 40 - P :]
    out = backend.forward_mla(q_nope, q_rope, LAYER)
    assert out.dtype == spec.dtype
    assert_close(out, reference.forward_mla(q_nope, q_rope, LAYER), spec.dtype, f"forward_mla {case} page {page_size}")
    with pytest.raises(ValueError, match="activation dtype"):
        backend.forward_mla(q_nope.float(), q_rope.float(), LAYER)


@pytest.mark.parametrize(("mode", "per_request"), [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 4),
                                                   (ForwardMode.DRAFT_EXTEND, 2)])
def test_forward_mla_under_cuda_graphs(fake_libraries, mode: ForwardMode, per_request: int) -> None:
    """fa3_mla hands FA3 the runner's static block table, seq_lens and cu_extend_lens as they are, and a
    max_seqlen_q fixed per graph; replays of other lengths and pages (padding rows included) read the same
    addresses and match the reference on the real rows."""
    fake_libraries(FAKE_FA3, None)
    page_size, max_bs, max_pages = 16, 4, 6
    spec = spec_of(torch.float16, page_size=page_size)
    assert mode in FA3MLAAttention.capabilities.graph_modes
    assert not FA3Attention.capabilities.graph_modes  # prefill only
    pool = MLAKVPool(2, max_bs * max_pages + 1, page_size, R, P, spec.dtype, CPU)
    for layer in range(2):
        pool.buffer(layer).copy_(torch.randn(pool.num_slots, R + P))
    inputs = GraphInputs(max_bs, per_request, max_pages, pool, padding_page=pool.num_pages - 1)
    backend, reference = FA3MLAAttention(spec, CPU), TorchRefAttention(spec, CPU)
    backend.init_cuda_graph(max_bs, max_bs * per_request, max_pages)
    static_buffers = {"page_table": inputs.block_table.data_ptr(), "cache_seqlens": inputs.seq_lens.data_ptr(),
                      "cu_seqlens_q": inputs.cu_extend_lens.data_ptr(), "max_seqlen_q": per_request}

    def forward(static: ForwardBatch, real: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        t, n = static.num_tokens, real.num_tokens
        backend.set_kv(LAYER, static.out_cache_loc, torch.randn(t, R), torch.randn(t, P))
        q_nope, q_rope = torch.randn(t, HEADS, R, dtype=spec.dtype), torch.randn(t, HEADS, P, dtype=spec.dtype)
        out = backend.forward_mla(q_nope, q_rope, LAYER)
        assert KVCACHE_CALLS[-1] == static_buffers
        reference.plan(real)
        return out[:n], reference.forward_mla(q_nope[:n], q_rope[:n], LAYER)

    for size in (max_bs, 2):
        static = inputs.batch(mode, size)
        backend.plan_capture(static)
        forward(static, static)
    for seq_lens, size in (([70, 4, 33], max_bs), ([90], 2)):
        order = torch.randperm(pool.num_pages - 1).tolist()
        pages = [[order.pop() for _ in range(pages_needed(s, page_size))] for s in seq_lens]
        table = torch.tensor([p + [p[0]] * (max(map(len, pages)) - len(p)) for p in pages], dtype=torch.int32)
        real = ForwardBatch.build(mode, seq_lens, [per_request] * len(seq_lens), table, pool)
        backend.plan_replay(inputs.load(torch.zeros(real.num_tokens, dtype=torch.int64), real, size))
        out, expected = forward(backend.batch, real)
        assert_close(out, expected, spec.dtype, f"replay {seq_lens}")
