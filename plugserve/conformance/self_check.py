"""The start-up self-check: each chosen backend solves one tiny problem of its kind and phase, on the
serving device and with the model's own dims, and must match the kit's oracle within the kit's
tolerances. A backend that raises or is off fails, and the registry falls back to the next choice.

It catches what availability() cannot: a JIT build that fails, a library that crashes on this GPU,
an installed version with a different argument order. Tiny means a few milliseconds once compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence

import torch

from plugserve.conformance import oracle
from plugserve.conformance.batches import random_batch
from plugserve.conformance.tolerances import assert_close, assert_lse_close
from plugserve.core.dispatch import prepare_attention
from plugserve.core.forward_batch import AttnForwardMethod, ForwardMode, Phase
from plugserve.core.interfaces import AttentionBackend, Backend, Fp8GemmBackend, MoEBackend, MoEWeights
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import AttentionSpec, GemmSpec, MoESpec

# Small enough to cost nothing, large enough to cross a page and a 128-wide FP8 block.
CHECK_SEQ_LENS = (70, 5)
# Decode is also checked at this many requests (CHECK_SEQ_LENS repeated): a backend may launch another kernel for
# wider batches (the Triton attention's Gluon block for fewer than 64 heads from 128 token-head rows).
CHECK_WIDE_DECODE = 16
CHECK_TOKENS = 3
CHECK_GEMM_N, CHECK_GEMM_K = 256, 512
CHECK_MOE_HIDDEN, CHECK_MOE_INTERMEDIATE = 512, 256
ROUTED_SCALING_FACTOR = 2.5


def self_check(backend: Backend, phase: Phase) -> None:
    """Raise (AssertionError when off, anything the backend raises otherwise) unless `backend` matches
    the oracle on a tiny problem of its spec in `phase`. The torch references are not checked here: they
    need no build or library that could fail on this machine, and the kit checks them against the oracle."""
    if backend.name == "torch_ref":
        return
    torch.manual_seed(0)
    with _probe_lookups_unlogged():
        if isinstance(backend, AttentionBackend):
            _check_attention(backend, phase)
        elif isinstance(backend, Fp8GemmBackend):
            _check_gemm(backend)
        elif isinstance(backend, MoEBackend):
            _check_moe(backend)
        else:
            raise TypeError(f"no self-check for {type(backend).__qualname__}")


@contextlib.contextmanager
def _probe_lookups_unlogged() -> Iterator[None]:
    """The plugins' INFO lines held back while the probes run: their small shapes have no tuned configs, and a
    line such as "no tuned config E=64,N=256" would read as the model's. Warnings still show."""
    plugins = logging.getLogger("plugserve.plugins")
    level = plugins.level
    plugins.setLevel(max(plugins.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        plugins.setLevel(level)


def _check_attention(backend: AttentionBackend, phase: Phase) -> None:
    spec: AttentionSpec = backend.spec
    spec = dataclasses.replace(spec, page_size=spec.page_size or 1)
    device, dtype, scale = backend.device, spec.dtype, oracle.softmax_scale(spec)
    methods = backend.capabilities.methods
    if phase is Phase.DECODE:
        for requests in (len(CHECK_SEQ_LENS), CHECK_WIDE_DECODE):
            seq_lens = [CHECK_SEQ_LENS[i % len(CHECK_SEQ_LENS)] for i in range(requests)]
            _check_mla(backend, spec, ForwardMode.DECODE, seq_lens, [1] * requests)
        return
    if AttnForwardMethod.MHA not in methods:
        _check_mla(backend, spec, ForwardMode.EXTEND, CHECK_SEQ_LENS, [CHECK_TOKENS] * len(CHECK_SEQ_LENS))
        return
    batch = random_batch(ForwardMode.EXTEND, CHECK_SEQ_LENS, CHECK_SEQ_LENS, spec, device, num_layers=1)
    prepare_attention(batch, chunked_prefix_cache_threshold=1)
    tokens = batch.num_tokens
    q = torch.randn(tokens, spec.num_heads, spec.qk_head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, spec.num_heads, spec.qk_head_dim, device=device, dtype=dtype)
    v = torch.randn(tokens, spec.num_heads, spec.v_head_dim, device=device, dtype=dtype)
    backend.plan(batch)
    out, lse = backend.forward_mha(q, k, v)
    expected, expected_lse = oracle.mha(batch, q, k, v, scale)
    assert_close(out, expected, dtype, f"{backend.name} self-check: forward_mha")
    assert_lse_close(lse, expected_lse, dtype, f"{backend.name} self-check: forward_mha lse")


def _check_mla(backend: AttentionBackend, spec: AttentionSpec, mode: ForwardMode, seq_lens: Sequence[int],
               extend_lens: Sequence[int]) -> None:
    """forward_mla over a random batch of these lengths, against the oracle as the backend declares its rounding."""
    device, dtype = backend.device, spec.dtype
    batch = random_batch(mode, seq_lens, extend_lens, spec, device, num_layers=1)
    t, h = batch.num_tokens, spec.num_heads
    latent = torch.randn(t, spec.kv_lora_rank, device=device, dtype=dtype)
    k_rope = torch.randn(t, spec.qk_rope_head_dim, device=device, dtype=dtype)
    q_nope = torch.randn(t, h, spec.kv_lora_rank, device=device, dtype=dtype)
    q_rope = torch.randn(t, h, spec.qk_rope_head_dim, device=device, dtype=dtype)
    expected, _, slack = oracle.mla_as_declared(batch, 0, q_nope, q_rope, latent, k_rope, oracle.softmax_scale(spec),
                                                backend.rounds_decode_to_e4m3)
    backend.plan(batch)
    backend.set_kv(0, batch.out_cache_loc, latent, k_rope)
    assert_close(backend.forward_mla(q_nope, q_rope, 0), expected, dtype,
                 f"{backend.name} self-check: forward_mla ({mode.name}, {len(seq_lens)} requests)", slack=slack)


def _check_gemm(backend: Fp8GemmBackend) -> None:
    spec: GemmSpec = backend.spec
    device = backend.device
    w = torch.randn(CHECK_GEMM_N, CHECK_GEMM_K, device=device) / CHECK_GEMM_K**0.5
    w_q, w_scale_inv = quantize_block_fp8(w, spec.block_shape)
    x = torch.randn(CHECK_TOKENS, CHECK_GEMM_K, device=device, dtype=spec.dtype)
    out = backend.apply(x, backend.prepare(w_q, w_scale_inv))
    assert_close(out, oracle.fp8_gemm(x, w_q, w_scale_inv, spec.block_shape), spec.dtype,
                 f"{backend.name} self-check: block-FP8 GEMM")


def _check_moe(backend: MoEBackend) -> None:
    # The model's router (expert count, top-k, grouping) with small experts; the routed ones only (the
    # kit's test_forward_with_fused_shared_experts checks fused shared experts). Under expert parallelism the
    # backend holds this rank's experts, as the model gives them, and adds only their terms.
    spec: MoESpec = dataclasses.replace(backend.spec, hidden_size=CHECK_MOE_HIDDEN,
                                        intermediate_size=CHECK_MOE_INTERMEDIATE, num_shared_experts=0)
    device, e, h, i = backend.device, spec.num_experts, spec.hidden_size, spec.intermediate_size
    small = type(backend)(spec, device)  # type: ignore[call-arg]
    w13 = torch.randn(e, 2 * i, h, device=device) / h**0.5
    w2 = torch.randn(e, h, i, device=device) / i**0.5
    if spec.is_fp8:
        w13_q, w13_s = (torch.stack(t) for t in zip(*(quantize_block_fp8(w, spec.block_shape) for w in w13),
                                                     strict=True))
        w2_q, w2_s = (torch.stack(t) for t in zip(*(quantize_block_fp8(w, spec.block_shape) for w in w2),
                                                   strict=True))
        weights: tuple = (w13_q, w2_q, w13_s, w2_s)
    else:
        weights = (w13.to(spec.dtype), w2.to(spec.dtype), None, None)
    logits = torch.randn(CHECK_TOKENS, e, device=device)
    bias = torch.randn(e, device=device) * 0.1 if spec.router.topk_method == "noaux_tc" else None
    routing = oracle.route(logits, spec.router, bias)
    topk_ids, topk_weights = routing.ids.to(torch.int32), routing.weights.float()
    x = torch.randn(CHECK_TOKENS, h, device=device, dtype=spec.dtype)
    local = slice(spec.first_expert, spec.first_expert + spec.num_local_experts)
    packed = small.prepare(MoEWeights(*(None if w is None else w[local] for w in weights)))
    out = small.forward(x, packed, topk_ids, topk_weights, ROUTED_SCALING_FACTOR)
    w13, w2, s13, s2 = weights
    mine = (topk_ids >= local.start) & (topk_ids < local.stop)
    expected = oracle.moe(x, w13, w2, topk_ids, topk_weights.masked_fill(~mine, 0), ROUTED_SCALING_FACTOR, s13, s2,
                          spec.block_shape)
    assert_close(out, expected, spec.dtype, f"{backend.name} self-check: routed experts")
