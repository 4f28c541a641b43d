"""The "flashinfer_mla" attention backend (extra `flashinfer`): every MLA method through FlashInfer's
planned wrappers, written against flashinfer-python 0.7.2.post1.

    forward_mla        `BatchMLAPagedAttentionWrapper`: absorbed MLA over the paged latent pool for
                       DECODE, TARGET_VERIFY, DRAFT_EXTEND and EXTEND with a cached prefix
    forward_mha        `BatchPrefillWithRaggedKVCacheWrapper`: ragged MHA (qk 192 / v 128) with the
                       log-sum-exp, causal over the new tokens, non-causal over each prefix chunk
    merge_attn_states  `flashinfer.merge_state`

Kernels: FlashInfer's "fa3" on sm90 (CUDA >= 12.3), "fa2" on every other GPU from sm80 on; fa2 takes q_nope and
q_rope apart, where the Blackwell-native MLA kernels want one packed query (a concatenation per layer).

What the wrappers are given:
- MLA: CSR metadata, all int32 (`MLAPlanMetadata.csr`): qo_indptr over extend_lens, kv_indptr over
  ceil(seq_len / page_size) pages, kv_indices the page ids (block-table rows, request-major), kv_len_arr =
  seq_lens. The kernel masks bottom-right, so TARGET_VERIFY / EXTEND plan causal=True (decode False: the same
  mask for one token). Layouts "split": q = (q_nope, q_rope), kv = (ckv, kpe) as two strided views of the pool's
  [slots, 576] buffer (unit last stride, no copy). Any page size; q and cache in one dtype.
- Ragged MHA: qo_indptr / kv_indptr int32, run with `return_lse=True, lse_base="ln"` (the natural log plugserve
  uses; -inf rows get out = 0).
- merge_state takes and returns base-2 log-sum-exps: `merge_natural_lse` converts both ways.

Planning: plan() builds the metadata on the host from the batch's CPU lengths (kv_indices by one gather on the
device), with no device sync, and plans each wrapper once for all layers; forward_* only launch kernels. One float
workspace (WORKSPACE_BYTES) is shared by every wrapper (their runs are ordered on one stream). A ragged wrapper's
plan copies its pinned buffer to the GPU asynchronously; an event makes its next plan wait for that copy.

CUDA graphs (DECODE, TARGET_VERIFY, DRAFT_EXTEND): one MLA wrapper per captured mode and batch size in FlashInfer's
graph mode (its indptr / kv_len buffers must have the batch's exact size), all sharing the workspace and one
kv_indices buffer [max_bs * max_pages]. What the captured launch bakes in (the int workspace, the grid and the
offsets into both workspaces) stays put across re-plans; plan_replay re-plans through FlashInfer's compiled planner
directly (`_replan_graph`): the schedule from the pinned host lengths into the int workspace, the page ids into the
fixed kv_indices by a device gather, and checks that the launch parameters (plan_info) are unchanged. The wrapper's
own plan() would also snapshot its buffers for a rollback on every step.

JIT: FlashInfer compiles each kernel variant at its first plan with nvcc from CUDA_HOME (or PATH), for the GPUs
present or FLASHINFER_CUDA_ARCH_LIST, and caches it under ~/.cache/flashinfer; flashinfer-jit-cache ships prebuilt
kernels. docs/kernels.md gives what this costs and how the backend measures.
"""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, AttentionBackend, AttentionCapabilities, Availability
from plugserve.core.kv_cache import MLAKVPool
from plugserve.core.specs import AttentionSpec
from plugserve.registry import hookimpl

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
FA3_MIN_CUDA = (12, 3)  # FlashInfer's sm90a kernels need CUDA 12.3 (`is_sm90a_supported`)
INSTALL_HINT = "pip install flashinfer-python"


# ----------------------------------------------------------------------------------------------------
# Host-side metadata and layouts (pure torch, tested on the CPU)


def fa_kernel(capability: tuple[int, int], cuda_version: str | None) -> str:
    """FlashInfer's backend name for both wrappers: "fa3" on sm90 with CUDA >= 12.3, else "fa2"."""
    cuda = tuple(int(part) for part in cuda_version.split(".")[:2]) if cuda_version else (0, 0)
    return "fa3" if capability[0] == 9 and cuda >= FA3_MIN_CUDA else "fa2"


def exclusive_cumsum(lens: Sequence[int]) -> torch.Tensor:
    """[B] lengths -> [B+1] int32 on the CPU: 0, l0, l0 + l1, ..."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(lens), dtype=torch.int64).cumsum(0)
    return out


def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor about to be copied to `device`: pinned when that is a GPU, so that the copy is
    asynchronous (from pageable memory the driver may wait for the stream)."""
    return t.pin_memory() if device.type == "cuda" else t


@dataclass(frozen=True)
class PagedKVIndices:
    """FlashInfer's CSR page lists: kv_indptr [B+1] int32 (CPU), kv_indices [sum(pages)] int32 page ids
    (on the block table's device), kv_lens [B] int32 (CPU). The CPU tensors are pinned when the block
    table is on a GPU."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor


def paged_kv_indices(
    block_table: torch.Tensor, seq_lens: Sequence[int], page_size: int, out: torch.Tensor | None = None
) -> PagedKVIndices:
    """block_table [B, max_pages] int32 and per-request key counts -> the first ceil(seq_len / page_size)
    page ids of every row, request-major, with their offsets and the key counts.

    The host computes only per-request page counts and offsets (O(B)), uploaded without waiting for the GPU;
    the gather positions follow on the block table's device. `out` (int32, at least sum(pages) long, on that
    device): the page ids are written into its leading entries and kv_indices is that view (a CUDA graph's
    fixed buffer)."""
    batch, width = block_table.shape
    if len(seq_lens) != batch:
        raise ValueError(f"{len(seq_lens)} sequence lengths for a block table of {batch} rows")
    pages = torch.tensor([-(-s // page_size) for s in seq_lens], dtype=torch.int64)
    if batch and int(pages.max()) > width:
        raise ValueError(f"sequence lengths {list(seq_lens)} need up to {int(pages.max())} pages of "
                         f"{page_size}, the block table has {width} columns")
    kv_indptr = exclusive_cumsum(pages.tolist())
    total = int(kv_indptr[-1])
    if out is not None and out.numel() < total:
        raise ValueError(f"{total} page ids do not fit a kv_indices buffer of {out.numel()}")
    device = block_table.device
    kv_indptr = staged(kv_indptr, device)
    offsets = kv_indptr.to(device, non_blocking=True).long()
    # output_size: the repeat count needs no read-back from the device
    rows = torch.repeat_interleave(torch.arange(batch, device=device), offsets.diff(), output_size=total)
    flat = rows * width + torch.arange(total, device=device) - offsets[rows]  # row * width + column
    source = block_table.reshape(-1)
    kv_indices = source[flat] if out is None else torch.index_select(source, 0, flat, out=out[:total])
    return PagedKVIndices(kv_indptr, kv_indices, staged(torch.tensor(list(seq_lens), dtype=torch.int32), device))


def paged_latent_views(pool: MLAKVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer_id` of the pool as (ckv [pages, page_size, R], kpe [pages, page_size, P]): strided
    views of its [slots, R + P] buffer, last stride 1, no copy."""
    paged = pool.paged(layer_id)
    return paged[..., : pool.kv_lora_rank], paged[..., pool.kv_lora_rank :]


def natural_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log log-sum-exps -> FlashInfer's base 2 (a new float32 tensor; -inf stays -inf)."""
    return (lse.float() * LOG2E).contiguous()


def base2_to_natural_(lse: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 log-sum-exps -> natural log, in place (float32)."""
    return lse.mul_(LN2)


MergeState = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def merge_natural_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, merge_state: MergeState
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge with a base-2 `merge_state(v_a, s_a, v_b, s_b) -> (v, s)` (FlashInfer's: contiguous
    [T, H, D] / [T, H] float32 inputs) on plugserve's natural-log lse [T, H]. Returns out [T, H, D] in
    out_a's dtype and lse [T, H] float32, natural log."""
    out, lse = merge_state(out_a.contiguous(), natural_to_base2(lse_a), out_b.contiguous(), natural_to_base2(lse_b))
    return out, base2_to_natural_(lse)


def find_nvcc(environ: Mapping[str, str]) -> str | None:
    """The nvcc FlashInfer's JIT would run (its `get_cuda_path`): $CUDA_HOME or $CUDA_PATH when set,
    else nvcc on PATH, else /usr/local/cuda's. None when that file does not exist."""
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if home:
        candidates = [os.path.join(home, "bin", "nvcc")]
    else:
        candidates = [shutil.which("nvcc", path=environ.get("PATH")), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # FlashInfer's kernels take the strides of every dimension but the last, which must be 1.
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------------
# The backend


@dataclass(frozen=True)
class _RaggedCall:
    """One planned ragged wrapper and the key rows its k / v must have."""

    wrapper: Any
    kv_lens: list[int]
    what: str


@dataclass(frozen=True)
class FlashInferPlan:
    """The wrappers planned for one forward: mla (None: the batch runs MHA, or has no tokens) and the ragged MHA
    calls, the causal one first, then one per prefix chunk (empty: the batch runs absorbed MLA)."""

    mla: Any = None
    mha_calls: tuple[_RaggedCall, ...] = ()


@dataclass(frozen=True)
class _GraphBuffers:
    """FlashInfer's CUDA-graph metadata buffers, int32 on the GPU, shared by the wrappers of every captured
    batch size (each takes leading slices): qo_indptr / kv_indptr [max_bs + 1] and kv_len_arr [max_bs],
    which FlashInfer fills on each plan and its kernels never read (they read the schedule planned from
    the host copies), and kv_indices [max_bs * max_pages], the page ids the kernels read at run time."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_len_arr: torch.Tensor
    kv_indices: torch.Tensor


class FlashInferMLAAttention(AttentionBackend):
    """MLA attention through FlashInfer: absorbed MLA, ragged MHA with lse, merge. CUDA sm80+, fp16 / bf16,
    DeepSeek's dims (latent 512, rope 64, MHA qk 192 / v 128), any page size and head count."""

    name: ClassVar[str] = "flashinfer_mla"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(8, 0),  # FlashInfer's fa2 kernels: Ampere or newer
        kv_lora_ranks=frozenset({512}),
        qk_rope_head_dims=frozenset({64}),
        mha_head_dims=frozenset({(192, 128)}),
        graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}),
        batch_invariant_note="FlashInfer's planner splits the KV by the batch's size and lengths",
        kv_cache_note="not wired for fp8: its MLA wrapper is planned here with the cache in q's dtype, and an e4m3 "
                      "cache with a scale through it has not been checked against the kit on a GPU",
    )
    # fa3 on Hopper is among the fastest (device README); elsewhere fa2, below Triton until measured.
    priority: ClassVar[dict[str, int]] = {"sm90": 70, "default": 40}

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        import flashinfer  # the optional package: imported here, never at module import

        self._flashinfer: ModuleType = flashinfer
        self._kernel = fa_kernel(Hardware.detect(device).capability or (0, 0), torch.version.cuda)
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._mla = flashinfer.BatchMLAPagedAttentionWrapper(self._workspace, backend=self._kernel)
        self._ragged: list[Any] = []  # grown on demand: one per ragged call of a forward
        self.plan_state = FlashInferPlan()
        self._graph: _GraphBuffers | None = None  # set by init_cuda_graph
        # (mode, batch size) -> its graph-mode wrapper and the kv_indices buffer that wrapper reads
        self._graph_wrappers: dict[tuple[ForwardMode, int], tuple[Any, torch.Tensor]] = {}
        # id(wrapper) -> an event after the copy of its last plan out of a pinned host buffer: that buffer is
        # rewritten by the wrapper's next plan, which must wait for the copy (the host may be a forward ahead)
        self._uploads: dict[int, torch.cuda.Event] = {}
        self._views_pool: MLAKVPool | None = None
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = super().availability(hardware)
        if not available:
            return available
        if importlib.util.find_spec("flashinfer") is None:
            return Availability.no(f"flashinfer is not installed ({INSTALL_HINT})")
        try:
            import flashinfer
        except Exception as exc:  # a broken install (CUDA / torch mismatch) raises more than ImportError
            return Availability.no(f"flashinfer is installed but fails to import: {exc}")
        if not hasattr(getattr(flashinfer, "mla", None), "MLAPlanMetadata"):
            return Availability.no(f"flashinfer {getattr(flashinfer, '__version__', '?')} predates the planned MLA "
                                   f"API (flashinfer.mla.MLAPlanMetadata); built against 0.7.2.post1: "
                                   f"{INSTALL_HINT} -U")
        if importlib.util.find_spec("flashinfer_jit_cache") is None and find_nvcc(os.environ) is None:
            return Availability.no("flashinfer compiles its kernels at first use and finds no nvcc: set CUDA_HOME "
                                   "to a CUDA toolkit, or pip install flashinfer-jit-cache")
        return OK

    def plan(self, batch: ForwardBatch) -> None:
        """Plan the wrappers this batch's method uses, once for all layers: MLA for attn_method MLA (and
        None outside EXTEND), ragged MHA for MHA / MHA_CHUNKED_KV (and None in EXTEND: causal over whole
        sequences)."""
        super().plan(batch)
        self.plan_state = FlashInferPlan()
        if batch.num_tokens == 0:
            return
        method = batch.attn_method
        if method is AttnForwardMethod.MLA or (method is None and batch.mode is not ForwardMode.EXTEND):
            self.plan_state = FlashInferPlan(mla=self._plan_mla(batch, self._mla))
        elif method is not None or batch.mode is ForwardMode.EXTEND:
            self.plan_state = FlashInferPlan(mha_calls=self._plan_mha(batch))

    def init_cuda_graph(self, max_batch_size: int, max_num_tokens: int, max_pages: int) -> None:
        """The metadata buffers of FlashInfer's graph mode (`_GraphBuffers`), sized for `max_batch_size`
        requests of up to `max_pages` pages each."""

        def buffer(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=self.device)

        self._graph = _GraphBuffers(buffer(max_batch_size + 1), buffer(max_batch_size + 1), buffer(max_batch_size),
                                    buffer(max_batch_size * max_pages))

    def plan_capture(self, batch: ForwardBatch) -> None:
        """A wrapper in FlashInfer's graph mode for this mode and batch size, over leading slices of the
        graph buffers (their exact sizes are part of its contract), planned for `batch` by plan_replay."""
        graph, size = self._graph, batch.batch_size
        if graph is None:
            raise RuntimeError("plan_capture before init_cuda_graph")
        wrapper = self._flashinfer.BatchMLAPagedAttentionWrapper(
            self._workspace, use_cuda_graph=True, qo_indptr=graph.qo_indptr[: size + 1],
            kv_indptr=graph.kv_indptr[: size + 1], kv_indices=graph.kv_indices, kv_len_arr=graph.kv_len_arr[:size],
            backend=self._kernel,
        )
        self._graph_wrappers[(batch.mode, size)] = wrapper, graph.kv_indices
        AttentionBackend.plan(self, batch)
        self.plan_state = FlashInferPlan(mla=self._plan_mla(batch, wrapper, graph.kv_indices))

    def plan_replay(self, batch: ForwardBatch) -> None:
        """Re-plan the graph's wrapper for the batch in the static buffers: the page ids into the fixed
        kv_indices (a gather on the device), the schedule from the host lengths into FlashInfer's fixed
        int workspace (a stream-ordered copy). No device-to-host sync."""
        graph = self._graph_wrappers.get((batch.mode, batch.batch_size))
        if graph is None:
            raise RuntimeError(f"plan_replay of a {batch.mode.name} batch of {batch.batch_size} requests, "
                               "for which plan_capture made no graph wrapper")
        AttentionBackend.plan(self, batch)
        self.plan_state = FlashInferPlan()
        wrapper, kv_indices = graph
        if not self._replan_graph(batch, wrapper, kv_indices):
            self._plan_mla(batch, wrapper, kv_indices)
        self.plan_state = FlashInferPlan(mla=wrapper)

    def _replan_graph(self, batch: ForwardBatch, wrapper: Any, kv_indices: torch.Tensor) -> bool:
        """Re-plan a captured graph's wrapper straight through FlashInfer's compiled planner: the page ids
        into the fixed kv_indices (the device gather), the host schedule into the int workspace. What
        `wrapper.plan` adds on top costs more host time than a batch-1 decode step's GPU work: it builds a
        new backend object per plan and snapshots its buffers for a rollback, device clones of the int
        workspace and of the whole kv_indices buffer (max_bs x max_pages ids). False when this FlashInfer is
        not laid out as 0.7.2.post1 (the caller then plans through the wrapper)."""
        backend = getattr(wrapper, "_planned_backend", None)
        planner = getattr(getattr(backend, "_cached_module", None), "_module", None)  # the compiled module
        if planner is None or not hasattr(planner, "plan"):
            return False
        pool = batch.kv_pool
        pages = paged_kv_indices(batch.block_table, batch.seq_lens_cpu, pool.page_size, out=kv_indices)
        # The planner writes the schedule into the pinned buffer and it goes up from there on the stream;
        # FlashInfer's own path stages it through a fresh pinned copy per plan instead.
        self._await_upload(wrapper)
        int_workspace, pinned = backend._int_workspace_buffer, backend._pin_memory_int_workspace_buffer
        plan_info, staged_bytes = planner.plan(
            backend._float_workspace_buffer, int_workspace, pinned,
            staged(exclusive_cumsum(batch.extend_lens_cpu), pool.device), pages.kv_indptr, pages.kv_lens,
            self.spec.num_heads, pool.kv_lora_rank, max(batch.extend_lens_cpu) > 1,
        )
        size = int(staged_bytes)
        int_workspace.view(torch.uint8)[:size].copy_(pinned.view(torch.uint8)[:size], non_blocking=True)
        self._mark_upload(wrapper)
        # The captured launch bakes plan_info in (grid, workspace offsets): a re-plan may only change the
        # schedule the kernels read from the int workspace.
        if list(plan_info) != list(backend._plan_info):
            raise RuntimeError(f"{self.name}: FlashInfer re-planned a captured {batch.mode.name} graph of "
                               f"{batch.batch_size} requests with another launch layout ({list(plan_info)} vs "
                               f"{list(backend._plan_info)}); the graph cannot replay it")
        return True

    def _plan_mla(self, batch: ForwardBatch, wrapper: Any, kv_indices: torch.Tensor | None = None) -> Any:
        """Plan `wrapper` for this batch's absorbed MLA and return it; `kv_indices`: the graph buffer the page ids
        go to."""
        pool, spec = batch.kv_pool, self.spec
        if pool is not self._views_pool:
            self._views = [paged_latent_views(pool, layer) for layer in range(pool.num_layers)]
            self._views_pool = pool
        pages = paged_kv_indices(batch.block_table, batch.seq_lens_cpu, pool.page_size, out=kv_indices)
        metadata = self._flashinfer.mla.MLAPlanMetadata.csr(
            qo_indptr=staged(exclusive_cumsum(batch.extend_lens_cpu), batch.block_table.device),
            kv_indptr=pages.kv_indptr, kv_indices=pages.kv_indices, kv_len_arr=pages.kv_lens,
        )
        try:
            wrapper.plan(
                metadata=metadata, num_heads=spec.num_heads, head_dim_ckv=pool.kv_lora_rank,
                head_dim_kpe=pool.qk_rope_head_dim, page_size=pool.page_size,
                causal=max(batch.extend_lens_cpu) > 1, sm_scale=spec.softmax_scale,
                q_data_type=spec.dtype, kv_data_type=pool.dtype, query_layout="split", kv_cache_layout="split",
            )
        except ValueError as exc:  # FlashInfer's refusals (work-item capacity, ...) are ValueErrors
            raise ValueError(f"{self.name}: FlashInfer's {self._kernel} MLA kernel refuses a batch of "
                             f"{batch.batch_size} requests, {batch.num_tokens} new tokens: {exc}") from exc
        return wrapper

    def _plan_mha(self, batch: ForwardBatch) -> tuple[_RaggedCall, ...]:
        """Plan one ragged wrapper per MHA call of this batch: the causal one, then one per prefix chunk."""
        chunked = batch.attn_method is AttnForwardMethod.MHA_CHUNKED_KV
        calls = [(batch.extend_lens_cpu if chunked else batch.seq_lens_cpu, True,
                  "the new tokens (MHA_CHUNKED_KV: extend_lens)" if chunked else "whole sequences (seq_lens)")]
        calls += [(chunk.lens_cpu, False, f"prefix chunk {i}") for i, chunk in enumerate(batch.prefix_chunks)]
        qo_indptr = exclusive_cumsum(batch.extend_lens_cpu)
        planned = tuple(
            _RaggedCall(self._plan_ragged(i, qo_indptr, kv_lens, causal), kv_lens, what)
            for i, (kv_lens, causal, what) in enumerate(calls)
        )
        if batch.prefix_chunks:
            self._flashinfer.cascade.get_cascade_module()  # merge_state's JIT build here, not in a forward
        return planned

    def _plan_ragged(self, index: int, qo_indptr: torch.Tensor, kv_lens: list[int], causal: bool) -> Any:
        if index == len(self._ragged):
            self._ragged.append(self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace, "NHD", backend=self._kernel))
        spec, wrapper = self.spec, self._ragged[index]
        self._await_upload(wrapper)
        wrapper.plan(
            qo_indptr=qo_indptr, kv_indptr=exclusive_cumsum(kv_lens), num_qo_heads=spec.num_heads,
            num_kv_heads=spec.num_heads, head_dim_qk=spec.qk_head_dim, head_dim_vo=spec.v_head_dim,
            causal=causal, sm_scale=spec.softmax_scale, q_data_type=spec.dtype, kv_data_type=spec.dtype,
        )
        self._mark_upload(wrapper)
        return wrapper

    def _await_upload(self, wrapper: Any) -> None:
        """Wait until the copy of `wrapper`'s last plan out of its pinned buffer has run (see `_uploads`)."""
        upload = self._uploads.get(id(wrapper))
        if upload is not None:
            upload.synchronize()

    def _mark_upload(self, wrapper: Any) -> None:
        """After a plan of `wrapper` enqueued the copy out of its pinned buffer."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._workspace.device))
        self._uploads[id(wrapper)] = event

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q_nope [T, H, 512], q_rope [T, H, 64] in the pool's dtype (any strides with a unit last one)
        -> [T, H, 512] in that dtype, with q_nope's strides."""
        self.check_mla_inputs(q_nope, q_rope)
        wrapper = self.plan_state.mla
        if wrapper is None:
            if self.batch.num_tokens == 0:
                return q_nope.new_empty(q_nope.shape)
            raise ValueError(f"forward_mla called on a {self.batch.mode.name} batch planned for MHA "
                             f"(attn_method {self.batch.attn_method})")
        return wrapper.run(query=(_unit_stride(q_nope), _unit_stride(q_rope)),
                                     kv_cache=self._views[layer_id])

    def forward_mha(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged MHA: q [T, H, 192]; k [Tk, H, 192], v [Tk, H, 128] of q's dtype (unit last stride) ->
        out [T, H, 128] in q's dtype, lse [T, H] float32 natural log. Tk is sum(seq_lens) (MHA),
        sum(extend_lens) (MHA_CHUNKED_KV, causal part) or the chunk's total (prefix_chunk i, non-causal)."""
        batch = self.batch
        if batch.attn_method is AttnForwardMethod.MLA:
            raise ValueError("forward_mha called on a batch planned for absorbed MLA (batch.attn_method is MLA)")
        index = 0 if prefix_chunk is None else prefix_chunk + 1
        if prefix_chunk is not None and not 0 <= prefix_chunk < len(batch.prefix_chunks):
            raise ValueError(f"prefix_chunk {prefix_chunk} out of range: the batch has "
                             f"{len(batch.prefix_chunks)} prefix chunks")
        calls = self.plan_state.mha_calls
        if index >= len(calls):
            raise ValueError(f"forward_mha called on a {batch.mode.name} batch planned without MHA")
        call, spec = calls[index], self.spec
        heads, qk, vo = spec.num_heads, spec.qk_head_dim, spec.v_head_dim
        if q.shape != (batch.num_tokens, heads, qk):
            raise ValueError(f"forward_mha: q must be [T={batch.num_tokens}, H={heads}, {qk}], got {tuple(q.shape)}")
        total = sum(call.kv_lens)
        if k.shape != (total, heads, qk) or v.shape != (total, heads, vo):
            raise ValueError(f"forward_mha over {call.what}: k must be [{total}, {heads}, {qk}] and v "
                             f"[{total}, {heads}, {vo}] (key lengths {call.kv_lens}), got k {tuple(k.shape)} and "
                             f"v {tuple(v.shape)}")
        return call.wrapper.run(_unit_stride(q), _unit_stride(k), _unit_stride(v), return_lse=True, lse_base="ln")

    def merge_attn_states(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out_* [T, H, D] fp16 / bf16, lse_* [T, H] float32 natural log -> merged (out in out_a's dtype,
        lse). A side with lse -inf contributes nothing (its out must be finite: FlashInfer scales it by 0)."""
        if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:2]:
            raise ValueError(f"cannot merge out {tuple(out_a.shape)} / lse {tuple(lse_a.shape)} with out "
                             f"{tuple(out_b.shape)} / lse {tuple(lse_b.shape)}")
        return merge_natural_lse(out_a, lse_a, out_b, lse_b, self._flashinfer.merge_state)


@hookimpl
def plugserve_backends() -> list[type[AttentionBackend]]:
    return [FlashInferMLAAttention]
