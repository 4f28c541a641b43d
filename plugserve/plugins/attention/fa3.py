"""The "fa3" and "fa3_mla" attention backends: FlashAttention's Hopper (sm90) kernels.

    fa3      MHA prefill (MHA and MHA_CHUNKED_KV) through FlashAttention-3's `flash_attn_interface`
             when it is installed, else flash-attn-4's `flash_attn.cute` (its sm90 forward). Prefill
             only: the registry pairs it with another decode backend.
    fa3_mla  fa3 plus absorbed MLA (decode, verify, draft extend, short-prefix extend) through FA3's
             `flash_attn_with_kvcache` with `qv`. It needs `flash_attn_interface`: `flash_attn.cute`
             runs `qv` on Blackwell only ("only support Blackwell arch with qv").

Why two classes: a capability record is a class attribute, read by the registry before anything is
imported, so one backend cannot declare MLA only when some package happens to be installed. Two
records that are always true let the registry, `plugserve backends` and the shootout say which of
them this machine runs, and why not the other.

What the libraries return, and what this module does with it (FA3 at flash-attention 0251105,
flash-attn-4 4.0.0b36):
- varlen forward: out [T, H, Dv] and the log-sum-exp [H, T] float32 in natural log (FA3:
  `return_attn_probs=True`, added in Aug 2025; flash_attn.cute: `return_lse=True`); -inf and out 0
  where a query sees no key. forward_mha returns the lse transposed to [T, H] (a view, no copy).
- causality is bottom-right aligned in both, as plugserve's.
- neither has a two-state merge (FA3's `flash_attn_combine` wants stacked float32 split partials):
  merge_attn_states runs plugserve's Triton kernel.
- MLA: q = q_rope [T, H, P], qv = q_nope [T, H, R]; the keys are the pool's rope columns and the
  values its latent columns, both strided views of the pool as pages [num_pages, page_size, 1, .];
  the block table is FA3's page table; any page size.
- CUDA graphs (fa3_mla; DECODE, TARGET_VERIFY, DRAFT_EXTEND): forward_mla hands FA3 the runner's static
  block table, seq_lens and cu_extend_lens as they are, and max_seqlen_q, fixed per graph. FA3 derives
  the rest inside the call (flash_api.cpp mha_fwd): the split count on the host from shapes only (the
  page table's width x page size as seqlen_k), the per-request splits and tile counts on the device
  (prepare_varlen_num_blocks, from cu_seqlens_q and cache_seqlens) into a tensor it allocates there,
  in the graph's memory pool. So there is nothing to allocate or refresh: plan_capture and plan_replay
  are `plan`, host-only in these modes.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import ClassVar

import torch

from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, AttentionBackend, AttentionCapabilities, Availability
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.triton_support import triton_availability
from plugserve.registry import hookimpl

FA3 = "flash_attn_interface"
CUTE = "flash_attn.cute"
FA3_HINT = "build FlashAttention-3 from flash-attention's hopper/ directory (python setup.py install)"
CUTE_HINT = "pip install --pre flash-attn-4 (needs nvidia-cutlass-dsl)"
DEEPSEEK_MHA_DIMS = frozenset({(192, 128)})  # qk = nope 128 + rope 64, v 128: every DeepSeek V2 / V3 model
Tensor = torch.Tensor
VarlenResult = tuple[Tensor, Tensor]  # out [T, H, Dv], lse [H, T] float32


class LibraryMissing(Exception):
    """The library a backend needs is not usable here; the message says why and how to get it."""


@dataclass(frozen=True)
class MhaLibrary:
    """A varlen flash-attention forward. `varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, sm_scale, causal)`
    takes q [T, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv], cu_* [B+1] int32 and returns out [T, H, Dv]
    and lse [H, T] float32 (natural log)."""

    name: str
    varlen: Callable[..., VarlenResult]


def _fa3_varlen(fn: Callable[..., VarlenResult], q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor,
                max_q: int, max_kv: int, sm_scale: float, causal: bool) -> VarlenResult:
    return fn(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv, max_seqlen_q=max_q, max_seqlen_k=max_kv,
              softmax_scale=sm_scale, causal=causal, return_attn_probs=True)


def _cute_varlen(fn: Callable[..., VarlenResult], q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor,
                 max_q: int, max_kv: int, sm_scale: float, causal: bool) -> VarlenResult:
    return fn(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv, max_seqlen_q=max_q, max_seqlen_k=max_kv,
              softmax_scale=sm_scale, causal=causal, return_lse=True)


def _import(module: str, hint: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise LibraryMissing(f"{module} is not installed ({exc}); {hint}") from exc
    except Exception as exc:  # a broken build (CUDA or ABI mismatch) fails with other errors
        raise LibraryMissing(f"{module} fails to import ({type(exc).__name__}: {exc})") from exc


def import_fa3() -> ModuleType:
    """flash_attn_interface, if recent enough for what this module calls. Its varlen forward returns
    the lse only through `return_attn_probs` (Aug 2025, flash-attention 203b9b3); `qv` in
    flash_attn_with_kvcache (Feb 2025) is older."""
    module = _import(FA3, FA3_HINT)
    if "return_attn_probs" not in inspect.signature(module.flash_attn_varlen_func).parameters:
        raise LibraryMissing(f"{FA3} is too old: its flash_attn_varlen_func cannot return the log-sum-exp "
                             f"(return_attn_probs, flash-attention commit 203b9b3, Aug 2025); {FA3_HINT}")
    return module


def _load_fa3() -> MhaLibrary:
    return MhaLibrary(FA3, partial(_fa3_varlen, import_fa3().flash_attn_varlen_func))


def _load_cute() -> MhaLibrary:
    fn = _import(CUTE, CUTE_HINT).flash_attn_varlen_func
    if "return_lse" not in inspect.signature(fn).parameters:
        raise LibraryMissing(f"{CUTE} is too old: its flash_attn_varlen_func has no return_lse; {CUTE_HINT}")
    return MhaLibrary(CUTE, partial(_cute_varlen, fn))


_LOADERS: dict[str, Callable[[], MhaLibrary]] = {FA3: _load_fa3, CUTE: _load_cute}


def load_mha_library(names: Sequence[str]) -> MhaLibrary:
    """The first of `names` (FA3, CUTE) that loads; LibraryMissing with every reason otherwise."""
    reasons = []
    for name in names:
        try:
            return _LOADERS[name]()
        except LibraryMissing as exc:
            reasons.append(str(exc))
    raise LibraryMissing("; ".join(reasons))


@dataclass(frozen=True)
class VarlenCall:
    """The key side of one varlen call: per-request key counts (host), their offsets cu_kv [B+1] int32
    (device), the longest, whether causal, and what k/v hold (for error messages)."""

    kv_lens: list[int]
    cu_kv: torch.Tensor
    max_kv: int
    causal: bool
    what: str


def cumsum_with_zero(lens: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B+1] int32 exclusive prefix sum, on the lengths' device (no host sync)."""
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    return cu


def plan_varlen_calls(batch: ForwardBatch) -> tuple[VarlenCall | None, list[VarlenCall]]:
    """The causal call's keys (None for a batch that runs absorbed MLA: every mode but EXTEND, and
    EXTEND planned so) and one non-causal call per prefix chunk. Causal keys: whole sequences (MHA, or
    an EXTEND batch `prepare_attention` never saw) or the new tokens only (MHA_CHUNKED_KV, whose
    prefix comes in chunks)."""
    if batch.mode is not ForwardMode.EXTEND or batch.attn_method is AttnForwardMethod.MLA:
        causal = None
    elif batch.attn_method is AttnForwardMethod.MHA_CHUNKED_KV:
        causal = VarlenCall(batch.extend_lens_cpu, batch.cu_extend_lens, max(batch.extend_lens_cpu, default=0), True,
                            "the new tokens (MHA_CHUNKED_KV: extend_lens)")
    else:
        causal = VarlenCall(batch.seq_lens_cpu, cumsum_with_zero(batch.seq_lens), max(batch.seq_lens_cpu, default=0),
                            True, "whole sequences (MHA: seq_lens)")
    chunks = [
        VarlenCall(chunk.lens_cpu, chunk.cu_lens, max(chunk.lens_cpu, default=0), False, f"prefix chunk {i}")
        for i, chunk in enumerate(batch.prefix_chunks)
    ]
    return causal, chunks


def paged_kv_views(paged: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's pages [num_pages, page_size, R + P] -> (rope keys [num_pages, page_size, 1, P], latent
    [num_pages, page_size, 1, R]): FA3's paged k_cache / v_cache with one KV head, as views (no copy)."""
    return paged[:, :, kv_lora_rank:].unsqueeze(2), paged[:, :, :kv_lora_rank].unsqueeze(2)


@dataclass(frozen=True)
class FA3Plan:
    """max_q: the most new tokens of a request (max_seqlen_q); the causal call's keys (None where the batch runs
    absorbed MLA) and one call per prefix chunk (`plan_varlen_calls`)."""

    max_q: int
    causal_call: VarlenCall | None
    chunk_calls: list[VarlenCall]


class FA3Attention(AttentionBackend):
    """Ragged MHA prefill with the log-sum-exp (MHA, MHA_CHUNKED_KV) in FlashAttention's sm90 kernels;
    bf16 / fp16, qk 192 / v 128. `libraries`: the packages tried, in order."""

    name: ClassVar[str] = "fa3"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(9, 0),
        max_capability=(9, 0),  # FA3's qk != v kernels are Hopper-only; flash_attn.cute's sm90 path is the one used
        methods=frozenset({AttnForwardMethod.MHA, AttnForwardMethod.MHA_CHUNKED_KV}),
        batch_invariant_note="MHA prefill only: deterministic inference runs every prefill as absorbed MLA",
        mha_head_dims=DEEPSEEK_MHA_DIMS,
    )
    priority: ClassVar[dict[str, int]] = {"sm90": 60}  # above Triton's 50 until a shootout table ranks them
    libraries: ClassVar[tuple[str, ...]] = (FA3, CUTE)
    plan_state: FA3Plan

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        from plugserve.plugins.attention import merge  # lazily, as triton.py explains

        self._merge = merge.merge_attn_states
        self.library = load_mha_library(self.libraries)

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = super().availability(hardware)
        if not available:
            return available
        triton = triton_availability(hardware)  # merge_attn_states runs plugserve's Triton kernel
        if not triton:
            return triton
        try:
            load_mha_library(cls.libraries)
        except LibraryMissing as exc:
            return Availability.no(str(exc))
        return OK

    def plan(self, batch: ForwardBatch) -> None:
        """Query offsets (cu_extend_lens) and the key side of the causal call and of each prefix chunk."""
        super().plan(batch)
        self.plan_state = FA3Plan(max(batch.extend_lens_cpu, default=0), *plan_varlen_calls(batch))

    def _call(self, prefix_chunk: int | None) -> VarlenCall:
        plan = self.plan_state
        if prefix_chunk is not None:
            if not 0 <= prefix_chunk < len(plan.chunk_calls):
                raise ValueError(f"prefix_chunk {prefix_chunk} out of range: the batch has "
                                 f"{len(plan.chunk_calls)} prefix chunks")
            return plan.chunk_calls[prefix_chunk]
        if plan.causal_call is None:
            raise ValueError("forward_mha called on a batch that runs absorbed MLA (not EXTEND, or attn_method MLA)")
        return plan.causal_call

    def forward_mha(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged MHA: q [T, H, Dqk]; k [Tk, H, Dqk], v [Tk, H, Dv] of q's dtype -> out [T, H, Dv] in q's
        dtype, lse [T, H] float32 (a transposed view). Tk is sum(seq_lens) (MHA), sum(extend_lens)
        (MHA_CHUNKED_KV, causal part) or the chunk's total (prefix_chunk i, non-causal)."""
        call = self._call(prefix_chunk)
        heads, num_tokens = self.spec.num_heads, self.batch.num_tokens
        if q.shape[:2] != (num_tokens, heads):
            raise ValueError(f"forward_mha: q must be [T={num_tokens}, H={heads}, Dqk], got {tuple(q.shape)}")
        total = sum(call.kv_lens)
        if k.shape[:2] != (total, heads) or v.shape[:2] != (total, heads) or k.shape[2] != q.shape[2]:
            raise ValueError(f"forward_mha over {call.what}: k must be [{total}, {heads}, {q.shape[2]}] and v "
                             f"[{total}, {heads}, Dv] (key lengths {call.kv_lens}), got k {tuple(k.shape)} and "
                             f"v {tuple(v.shape)}")
        out, lse = self.library.varlen(q, k, v, self.batch.cu_extend_lens, call.cu_kv, self.plan_state.max_q,
                                       call.max_kv, self.spec.softmax_scale, call.causal)
        return out, lse.t()

    def merge_attn_states(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out_* [T, H, D], lse_* [T, H] float32 (any strides) -> merged (out [T, H, D] in out_a's dtype,
        lse [T, H] float32)."""
        if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:2]:
            raise ValueError(f"cannot merge out {tuple(out_a.shape)} / lse {tuple(lse_a.shape)} with out "
                             f"{tuple(out_b.shape)} / lse {tuple(lse_b.shape)}")
        return self._merge(out_a, lse_a, out_b, lse_b)


class FA3MLAAttention(FA3Attention):
    """fa3 plus absorbed MLA over the paged latent cache, every forward mode, through FA3's
    flash_attn_with_kvcache (q_rope as q, q_nope as qv); latent 512, rope 64, any page size."""

    name: ClassVar[str] = "fa3_mla"
    verified: ClassVar[str] = "stand-ins"  # a fake flash_attn_interface in its tests (FA3 not on the GPUs lent)
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(9, 0),
        max_capability=(9, 0),  # FA3 runs qv on sm90 only
        kv_lora_ranks=frozenset({512}),  # FA3's qv kernels: rope <= 64, latent 512 (its hdim 64 x 512 instantiation)
        qk_rope_head_dims=frozenset({64}),
        mha_head_dims=DEEPSEEK_MHA_DIMS,
        graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}),
        kv_cache_note="not wired for fp8: FA3 reads the paged latent in q's dtype; its fp8 mode takes q, k and v all "
                      "in e4m3 with descales",
        batch_invariant_note="FA3 picks its KV splits by the batch's size and lengths",
    )
    priority: ClassVar[dict[str, int]] = {"sm90": 61}  # fa3's prefill, and MLA for short prefixes too
    libraries: ClassVar[tuple[str, ...]] = (FA3,)

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self._with_kvcache = import_fa3().flash_attn_with_kvcache

    def init_cuda_graph(self, max_batch_size: int, max_num_tokens: int, max_pages: int) -> None:
        """Nothing to allocate: FA3 reads the runner's static buffers and derives the rest inside the call
        (module docstring)."""

    def plan_capture(self, batch: ForwardBatch) -> None:
        """`plan`: in the graph modes it only reads host lengths (max_seqlen_q; no varlen MHA calls)."""
        self.plan(batch)

    def plan_replay(self, batch: ForwardBatch) -> None:
        """`plan`, as plan_capture: nothing derived on the device to refresh."""
        self.plan(batch)

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q_nope [T, H, R], q_rope [T, H, P] of the pool's dtype (last dims contiguous) -> [T, H, R].
        Queries: cu_extend_lens (varlen, every mode alike); keys: seq_lens of each request's pages, the
        block table (int32) as FA3's page table; causal, so new token i sees its prefix and itself."""
        batch = self.batch
        pool = batch.kv_pool
        self.check_mla_inputs(q_nope, q_rope)
        k_rope, latent = paged_kv_views(pool.paged(layer_id), pool.kv_lora_rank)
        return self._with_kvcache(
            q_rope, k_rope, latent, qv=q_nope, page_table=batch.block_table, cache_seqlens=batch.seq_lens,
            cu_seqlens_q=batch.cu_extend_lens, max_seqlen_q=self.plan_state.max_q,
            softmax_scale=self.spec.softmax_scale, causal=True,
        )


@hookimpl
def plugserve_backends() -> list[type[AttentionBackend]]:
    return [FA3Attention, FA3MLAAttention]
