"""The "cutlass_mla" attention backend: CUTLASS's Blackwell (sm100) MLA decode kernel, through
FlashInfer's binding (`BatchMLAPagedAttentionWrapper(backend="cutlass")`, flashinfer-python 0.7.2.post1).

What the kernel takes (FlashInfer's `include/flashinfer/attention/cutlass_mla.cuh` and
`mla/_batch_mla/_backends/cutlass_backend.py`):
- exactly 128 query heads, latent 512 + rope 64, fp16 / bf16 with the KV cache in the same dtype;
  one query token per row (a "request" to it), no log-sum-exp; sm100-class GPUs (major 10 or 11);
- q [rows, 128, 576] contiguous, latent then rope; the KV cache [pages, page_size, 576] contiguous (the
  pool's `paged` view as it is); page size a power of two up to 128; kv_lens [rows] int32 and a page
  table [rows, width] int32;
- a fixed softmax scale 1/sqrt(128 + 64): the binding takes none;
- a workspace for split-KV partials, sized by CUTLASS's split heuristic and not checked against it.

What this backend does about it:
- one row per query token: its request's page-table row and kv_len = position + 1, so DECODE,
  TARGET_VERIFY and DRAFT_EXTEND all run with bottom-right causality (each token reads its own prefix);
- fewer than 128 heads (tensor-parallel shards, DeepSeek-V2-Lite's 16) are padded with zero query
  heads and cut from the output;
- the model's softmax scale (YaRN's mscale^2 / sqrt(192) for V3) is folded into q: q * (scale /
  fixed scale), rounded once in the activation dtype;
- page size 128 (the one-page-per-128-key-tile setting SGLang runs it with), forced on the KV pool;
- the page table cut to the pages the longest row needs: CUTLASS splits the KV by the table's width;
- the workspace sized for the worst split of the planned row count, grown (never shrunk) in plan().

CUDA graphs (DECODE, TARGET_VERIFY, DRAFT_EXTEND): what the kernel reads lives in fixed buffers sized at
init_cuda_graph for the most rows (`max_num_tokens`): the padded query, the page table at the block
table's full width (the split is then fixed for the longest possible sequence; splits past a shorter
row's end run no tile, and the reduction recounts them from the row's kv_len) and kv_lens, and one
workspace for the worst split of any row count up to that. One wrapper per captured mode and batch size,
planned once at capture (FlashInfer's plan reads the lengths back to the host: fine outside the capture)
over leading rows of those buffers; forward_mla hands it the buffers explicitly (`run(kv_len=,
page_table=)`), so the graph reads them whatever FlashInfer kept. plan_replay plans nothing: it rewrites
the rows in place on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode, Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, AttentionBackend, AttentionCapabilities, Availability
from plugserve.core.kv_cache import pages_needed
from plugserve.core.specs import AttentionSpec
from plugserve.registry import hookimpl

KERNEL_HEADS = 128
PAGE_SIZE = 128
LATENT, ROPE = 512, 64
KERNEL_SM_SCALE = 1.0 / math.sqrt(128 + ROPE)  # CUTLASS's built-in scale: nope 128 + rope 64
# Split-KV partials per (split, row, head): the float32 latent accumulator and its float32 lse.
PARTIAL_BYTES = 4 * LATENT + 4
CTAS_PER_SPLIT = 2  # the kernel runs each split on a 2-SM cluster
FLASHINFER_HINT = "pip install flashinfer-python==0.7.2.post1"


def query_scale(sm_scale: float) -> float:
    """What q is multiplied by so that the kernel's fixed scale yields `sm_scale`."""
    return sm_scale / KERNEL_SM_SCALE


def pack_query(q_nope: torch.Tensor, q_rope: torch.Tensor, out: torch.Tensor, scale: float) -> torch.Tensor:
    """q_nope [T, H, R], q_rope [T, H, P] (any strides) -> out[:, :H] = (q_nope ++ q_rope) * scale in
    out's dtype, out [T, 128, R + P]; heads H.. of out keep what they hold (zeros, as plan() makes them)."""
    heads, rank = q_nope.shape[1], q_nope.shape[2]
    for src, dst in ((q_nope, out[:, :heads, :rank]), (q_rope, out[:, :heads, rank:])):
        if scale == 1.0:
            dst.copy_(src)
        else:
            torch.mul(src, scale, out=dst)
    return out


def token_rows(
    block_table: torch.Tensor, extend_lens: torch.Tensor, positions: torch.Tensor, num_tokens: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel row per new token: block_table [B, max_pages] int32, extend_lens [B] int32, positions
    [T] int64 -> (page table [T, width] int32 contiguous: the token's request's first `width` pages,
    kv_lens [T] int32 = position + 1)."""
    requests = torch.repeat_interleave(
        torch.arange(block_table.shape[0], device=block_table.device), extend_lens, output_size=num_tokens
    )
    return block_table[:, :width][requests], (positions + 1).to(torch.int32)


def workspace_bytes(rows: int, sm_count: int) -> int:
    """Bytes of split-KV partials the kernel may write for `rows` rows at any sequence length.

    CUTLASS (sm100_mla.hpp, set_split_kv) picks split <= max(1, sm_count // (2 * rows)) (one 2-SM cluster
    per split, one wave) and sizes partials as PARTIAL_BYTES * 128 heads * split * rows (even at split 1,
    which writes none); the bound takes the largest split."""
    splits = max(1, sm_count // (CTAS_PER_SPLIT * max(1, rows)))
    return PARTIAL_BYTES * KERNEL_HEADS * splits * max(1, rows)


@dataclass(frozen=True)
class CutlassPlan:
    """What one forward reads: the wrapper FlashInfer planned for it, and its rows (one a new token). Under CUDA graphs
    each captured graph keeps one, over leading rows of the fixed buffers (module docstring)."""

    wrapper: Any
    query: torch.Tensor  # [rows, 128, 576], padding heads zero
    page_table: torch.Tensor  # [rows, max_pages] int32
    kv_lens: torch.Tensor  # [rows] int32


@dataclass(frozen=True)
class CutlassMLACapabilities(AttentionCapabilities):
    """Adds the kernel's head limit: `max_heads` query heads at most (fewer are padded)."""

    max_heads: int = KERNEL_HEADS

    def check(self, spec: AttentionSpec, phase: Phase) -> Availability:
        fits = super().check(spec, phase)
        if fits and spec.num_heads > self.max_heads:
            return Availability.no(f"{spec.num_heads} heads is not supported (at most {self.max_heads}: CUTLASS "
                                   "MLA runs 128-head tiles)")
        return fits


class CutlassMLAAttention(AttentionBackend):
    """Absorbed MLA decode on sm100 in CUTLASS's kernel: DECODE, TARGET_VERIFY, DRAFT_EXTEND; bf16 / fp16,
    latent 512, rope 64, page size 128, up to 128 heads."""

    name: ClassVar[str] = "cutlass_mla"
    verified: ClassVar[str] = "stand-ins"  # a fake FlashInfer in its tests: no sm100 GPU was at hand
    capabilities: ClassVar[CutlassMLACapabilities] = CutlassMLACapabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}),
        min_capability=(10, 0),
        max_capability=(11, 0),  # FlashInfer builds it for compute capability majors 10 and 11
        methods=frozenset({AttnForwardMethod.MLA}),
        mla_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}),
        kv_lora_ranks=frozenset({LATENT}),
        qk_rope_head_dims=frozenset({ROPE}),
        page_sizes=frozenset({PAGE_SIZE}),
        graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}),
        batch_invariant_note="CUTLASS picks the KV split from the SM count over the batch's rows",
        kv_cache_note="not wired for fp8: the CUTLASS MLA kernel takes q and the cache in one dtype, so an e4m3 "
                      "cache would need e4m3 queries, a different accuracy contract",
    )
    priority: ClassVar[dict[str, int]] = {"sm100": 60, "sm103": 60}  # above Triton's 50 until measured

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        from flashinfer import mla

        self._mla = mla
        self._sm_count = Hardware.detect(device).multiprocessors
        self._q_scale = query_scale(spec.softmax_scale)
        self._workspace = torch.empty(0, dtype=torch.uint8, device=device)
        self._wrapper: Any = None  # eager plans' wrapper, over self._workspace
        self.plan_state: CutlassPlan | None = None  # what this forward runs
        # CUDA graphs: init_cuda_graph's query [N, 128, 576], page table [N, max_pages] int32 and kv_lens [N]
        # int32, and workspace; what each captured (mode, batch size) reads
        self._graph_buffers: tuple[torch.Tensor, ...] = ()
        self._graph_workspace = self._workspace
        self._graphs: dict[tuple[ForwardMode, int], CutlassPlan] = {}

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = super().availability(hardware)
        if not available:
            return available
        try:
            import flashinfer
            from flashinfer import mla
        except ImportError as exc:
            return Availability.no(f"flashinfer is not installed ({exc}); {FLASHINFER_HINT}")
        except Exception as exc:  # a broken install (CUDA or ABI mismatch) fails with other errors
            return Availability.no(f"flashinfer fails to import ({type(exc).__name__}: {exc})")
        if not hasattr(mla, "MLAPlanMetadata"):  # the planned-wrapper API this backend calls
            return Availability.no(f"flashinfer {getattr(flashinfer, '__version__', '?')} is too old: it has no "
                                   f"flashinfer.mla.MLAPlanMetadata; {FLASHINFER_HINT}")
        return OK

    def plan(self, batch: ForwardBatch) -> None:
        """Rows, page table and kv_lens per new token, the padded query buffer, the workspace, and
        FlashInfer's plan (host checks happen there, not per layer)."""
        rows = self._bind(batch)
        if rows == 0:
            return
        width = pages_needed(max(batch.seq_lens_cpu), PAGE_SIZE)
        page_table, kv_lens = token_rows(batch.block_table, batch.extend_lens, batch.positions, rows, width)
        # Heads are independent, so padding heads only need finite values: zeros, written once per plan.
        query = torch.zeros(rows, KERNEL_HEADS, LATENT + ROPE, dtype=batch.kv_pool.dtype, device=self.device)
        needed = workspace_bytes(rows, self._sm_count)
        if self._wrapper is None or self._workspace.numel() < needed:
            self._workspace = torch.empty(needed, dtype=torch.uint8, device=self.device)
            self._wrapper = self._mla.BatchMLAPagedAttentionWrapper(self._workspace, backend="cutlass")
        self.plan_state = CutlassPlan(self._wrapper, query, page_table, kv_lens)
        self._plan_wrapper(batch, self.plan_state)

    def init_cuda_graph(self, max_batch_size: int, max_num_tokens: int, max_pages: int) -> None:
        """Fixed buffers for graphs of up to `max_num_tokens` rows (module docstring). The workspace covers
        every row count up to that: CUTLASS's split, hence its partials, does not grow monotonically with it."""
        rows, dtype = max_num_tokens, self.spec.kv_dtype
        self._graph_buffers = (
            torch.zeros(rows, KERNEL_HEADS, LATENT + ROPE, dtype=dtype, device=self.device),  # padding heads stay 0
            torch.zeros(rows, max_pages, dtype=torch.int32, device=self.device),
            torch.ones(rows, dtype=torch.int32, device=self.device),
        )
        size = max(workspace_bytes(n, self._sm_count) for n in range(1, rows + 1))
        self._graph_workspace = torch.empty(size, dtype=torch.uint8, device=self.device)

    def plan_capture(self, batch: ForwardBatch) -> None:
        """A wrapper over the graph workspace for this graph, planned once here on the leading rows of the
        fixed buffers, which plan_replay fills (FlashInfer's plan syncs with the device: never in a replay)."""
        if not self._graph_buffers:
            raise RuntimeError("plan_capture before init_cuda_graph")
        rows = batch.num_tokens
        wrapper = self._mla.BatchMLAPagedAttentionWrapper(self._graph_workspace, backend="cutlass")
        graph = CutlassPlan(wrapper, *(b[:rows] for b in self._graph_buffers))
        self._graphs[(batch.mode, batch.batch_size)] = graph
        self.plan_replay(batch)
        self._plan_wrapper(batch, graph)

    def plan_replay(self, batch: ForwardBatch) -> None:
        """This batch's rows into the graph's page table and kv_lens, in place on the device."""
        rows = self._bind(batch)
        graph = self._graphs.get((batch.mode, batch.batch_size))
        if graph is None:
            raise RuntimeError(f"plan_replay of a {batch.mode.name} batch of {batch.batch_size} requests, for "
                               "which plan_capture made no graph wrapper")
        table, kv_lens = token_rows(batch.block_table, batch.extend_lens, batch.positions, rows,
                                    graph.page_table.shape[1])
        graph.page_table.copy_(table)
        graph.kv_lens.copy_(kv_lens)
        self.plan_state = graph

    def _bind(self, batch: ForwardBatch) -> int:
        """Take the batch (its pool must have pages of PAGE_SIZE); returns its row count."""
        super().plan(batch)
        if batch.kv_pool.page_size != PAGE_SIZE:
            raise ValueError(f"cutlass_mla needs KV pages of {PAGE_SIZE} tokens, the pool has "
                             f"{batch.kv_pool.page_size}")
        return batch.num_tokens

    def _plan_wrapper(self, batch: ForwardBatch, plan: CutlassPlan) -> None:
        """FlashInfer's plan of the wrapper this forward runs, over its rows, page table and kv_lens."""
        dtype = batch.kv_pool.dtype
        cu_rows = torch.arange(batch.num_tokens + 1, dtype=torch.int32, device=self.device)  # one query per row
        plan.wrapper.plan(
            metadata=self._mla.MLAPlanMetadata.dense(cu_rows, plan.page_table, plan.kv_lens),
            num_heads=KERNEL_HEADS, head_dim_ckv=LATENT, head_dim_kpe=ROPE, page_size=PAGE_SIZE, causal=True,
            sm_scale=KERNEL_SM_SCALE, q_data_type=dtype, kv_data_type=dtype,
        )

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q_nope [T, H, 512], q_rope [T, H, 64] of the pool's dtype -> [T, H, 512] (a view of the
        kernel's [T, 128, 512] output when H < 128)."""
        pool = self.batch.kv_pool
        self.check_mla_inputs(q_nope, q_rope)
        if q_nope.shape[0] == 0:
            return q_nope.new_empty(q_nope.shape)
        plan = self.plan_state
        assert plan is not None, "forward_mla before plan"
        query = pack_query(q_nope, q_rope, plan.query, self._q_scale)
        out = plan.wrapper.run(query=query, kv_cache=pool.paged(layer_id), kv_len=plan.kv_lens,
                               page_table=plan.page_table)
        return out[:, : self.spec.num_heads]


@hookimpl
def plugserve_backends() -> list[type[AttentionBackend]]:
    return [CutlassMLAAttention]
