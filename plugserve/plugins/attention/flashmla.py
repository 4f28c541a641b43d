"""The FlashMLA attention backend: absorbed MLA over the paged latent cache with DeepSeek's FlashMLA kernels
(`flash_mla.get_mla_metadata` + `flash_mla.flash_mla_with_kvcache`, dense bf16, sm90a).

FlashMLA reads the pool as it is: `[num_slots, 576]` viewed as `[num_pages, 64, 1, 576]` (latent ++ rope key
per token, one KV head), with our block table [B, max_pages] int32 and seq_lens [B] int32, so the KV pool must
use pages of 64 tokens (declared; the model runner forces it when this is the decode backend). The query is
q_nope ++ q_rope, [B, s_q, H, 576] with the same s_q for every request, masked bottom-right causally: row i of
request b sees keys [0, seq_len_b - s_q + i]. A uniform batch (DECODE, TARGET_VERIFY) is a plain view of the
packed tokens. A batch whose requests add different numbers of tokens (DRAFT_EXTEND, EXTEND) is left-padded
to the longest, s_q = max(q_len): request b's tokens fill the last q_len_b of its s_q rows, so its token j
lands in row s_q - q_len_b + j and sees keys [0, seq_len_b - q_len_b + j], exactly its own causal window; the
zero padding rows read only keys of their own request (some see none) and are dropped. Output [B, s_q, H, 512].

The tile-scheduler metadata is made once per forward: the first `forward_mla` after `plan` takes a fresh one
from `get_mla_metadata`, FlashMLA (as of 9241ae3) fills it on the device in that `flash_mla_with_kvcache` call
(a kernel reading cache_seqlens, its two int32 tensors allocated there), and every later layer reuses it.

CUDA graphs (DECODE, TARGET_VERIFY, DRAFT_EXTEND, whose requests all add the same number of tokens: s_q is
fixed and there are no padding rows): the block table and seq_lens are the runner's static buffers as they
are, and the metadata needs no fixed buffer of ours, since FlashMLA has no way to compute it but inside
that first call: the captured forward takes a fresh object even when warm-up runs after `plan_capture`
filled one, so the graph holds the scheduling kernel and its output tensors (in the graph's memory pool, at
fixed addresses); every replay refills them from the static seq_lens before the first layer reads them.
`plan_replay` is `plan`: host-side layout only.

The package `flash_mla` has no working wheel on PyPI: build deepseek-ai/FlashMLA from source (`pip install
-v .` in a checkout), or only its dense decode kernels with tools/device/build_flashmla.sh. It is imported in
`availability` and `__init__`, never at module import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, AttentionBackend, AttentionCapabilities, Availability
from plugserve.core.specs import AttentionSpec
from plugserve.registry import hookimpl

PAGE_SIZE = 64  # FlashMLA's dense kernel reads pages of 64 tokens only
PACKAGE = "flash_mla"
INSTALL_HINT = ("build deepseek-ai/FlashMLA from source (`pip install -v .` in a checkout; the PyPI name flash-mla "
                "is an empty placeholder), or only its dense decode: tools/device/build_flashmla.sh")


def flashmla_availability() -> Availability:
    """OK when `flash_mla` imports (its CUDA module included) and has the two functions this backend calls."""
    try:
        module = importlib.import_module(PACKAGE)
    except ModuleNotFoundError as exc:
        if exc.name != PACKAGE:  # a module flash_mla itself imports is missing: an installed but broken package
            return Availability.no(f"{PACKAGE} is installed but does not import ({exc}); {INSTALL_HINT}")
        return Availability.no(f"{PACKAGE} is not installed; {INSTALL_HINT}")
    except (ImportError, OSError) as exc:  # e.g. its .so was built against another torch: undefined symbols
        return Availability.no(f"{PACKAGE} is installed but its CUDA module does not load ({exc}); rebuild it "
                               f"against this torch ({INSTALL_HINT})")
    missing = [f for f in ("get_mla_metadata", "flash_mla_with_kvcache") if not hasattr(module, f)]
    if missing:
        return Availability.no(f"{PACKAGE} at {getattr(module, '__file__', '?')} lacks {', '.join(missing)}; "
                               f"{INSTALL_HINT}")
    return OK


# ----------------------------------------------------------------------------------------------------
# Layouts: plugserve's packed tokens and paged pool <-> FlashMLA's arguments (pure torch, tested on the CPU)


def padded_query_rows(q_lens: torch.Tensor, num_tokens: int, s_q: int) -> torch.Tensor:
    """Row of each packed token in the left-padded [B * s_q] query: token j of request b (which has q_lens[b]
    tokens) -> b * s_q + s_q - q_lens[b] + j. q_lens [B] int on any device; returns [num_tokens] int64 there,
    without a host sync (num_tokens = sum(q_lens) is passed in)."""
    lens = q_lens.to(torch.int64)
    owner = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=num_tokens)
    first_token = torch.cumsum(lens, 0) - lens  # [B] the packed index of each request's first token
    offset = torch.arange(num_tokens, device=lens.device) - first_token[owner]  # j
    return owner * s_q + (s_q - lens[owner]) + offset


def flashmla_query(
    q_nope: torch.Tensor, q_rope: torch.Tensor, batch_size: int, s_q: int, rows: torch.Tensor | None
) -> torch.Tensor:
    """q_nope [T, H, R], q_rope [T, H, P] -> FlashMLA's q [B, s_q, H, R + P], contiguous, in their dtype.

    rows None: every request has s_q tokens (T = B * s_q), packed request-major, so this is their concatenation
    viewed per request. Otherwise `padded_query_rows`: the tokens go to those rows of a zero [B * s_q] query."""
    q = torch.cat([q_nope, q_rope], dim=-1)
    if rows is not None:
        q = q.new_zeros(batch_size * s_q, *q.shape[1:]).index_copy_(0, rows, q)
    return q.view(batch_size, s_q, *q.shape[1:])


def flashmla_output(out: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """FlashMLA's out [B, s_q, H, R] -> [T, H, R]: a view when rows is None, else the `rows` (padding dropped)."""
    flat = out.reshape(-1, *out.shape[2:])
    return flat if rows is None else flat.index_select(0, rows)


def flashmla_kv_cache(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pool buffer [num_slots, R + P] as FlashMLA's k_cache [num_pages, page_size, 1, R + P]: a view, so
    slot page * page_size + offset is k_cache[page, offset, 0]."""
    return buffer.view(-1, page_size, 1, buffer.shape[-1])


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream is capturing a CUDA graph (never off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------------------------------
# The backend


@dataclass
class FlashMLAPlan:
    """One forward's query layout, shared by all layers: s_q (the most new tokens of a request), rows (the padded
    query's gather positions, None when every request adds s_q tokens), block_table [B, max_pages] and seq_lens [B]
    int32. The scheduler's (metadata, num_splits) are filled by the forward's first forward_mla
    (`_scheduler_metadata`), metadata_in_graph saying whether that call was being captured in a CUDA graph."""

    s_q: int
    rows: torch.Tensor | None
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    metadata: Any = None
    num_splits: Any = None
    metadata_in_graph: bool = False


class FlashMLAAttention(AttentionBackend):
    """Absorbed-MLA decode with FlashMLA: bf16 (activations and cache), kv_lora_rank 512, rope 64 (DeepSeek
    V2/V3), any head count, pages of 64 tokens, Hopper (sm90a) only. DECODE, TARGET_VERIFY, DRAFT_EXTEND and
    absorbed-MLA EXTEND batches, mixed query lengths left-padded. No MHA: it pairs with a prefill backend."""

    name: ClassVar[str] = "flashmla"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        dtypes=frozenset({torch.bfloat16}),  # tools/device/build_flashmla.sh builds no fp16 kernels
        devices=frozenset({"cuda"}),
        min_capability=(9, 0),
        max_capability=(9, 0),  # the dense kernel is sm90a code: "only supported on SM90a"
        methods=frozenset({AttnForwardMethod.MLA}),
        mla_modes=frozenset(
            {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.EXTEND}
        ),
        kv_lora_ranks=frozenset({512}),
        qk_rope_head_dims=frozenset({64}),
        page_sizes=frozenset({PAGE_SIZE}),
        graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}),
        batch_invariant_note="FlashMLA's scheduler splits the KV by the batch's size and lengths",
        kv_cache_note="FlashMLA's dense decode reads bf16 only; its FP8 cache is its sparse decode's own layout "
                      "(e4m3 latent with per-tile scales, bf16 rope), not this pool's",
        # plan_replay is host layout only, the same for every replay of a captured size, and the scheduler metadata
        # is refilled inside the graph: recorded once in the capture, a replay calls nothing on the host, and a
        # speculative round can be one graph.
        graph_plan_on_device=True,
    )
    # Above Triton (50): the fastest MLA decode in the device README's H200 numbers. A shootout table overrides.
    priority: ClassVar[dict[str, int]] = {"sm90": 70}

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self._flash_mla: ModuleType = importlib.import_module(PACKAGE)
        self.plan_state: FlashMLAPlan | None = None

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        """The GPU check, and whether flash_mla loads; both reasons when both fail (say on a CPU machine)."""
        reasons = [a.reason for a in (super().availability(hardware), flashmla_availability()) if not a]
        return Availability.no("; ".join(reasons)) if reasons else OK

    def plan(self, batch: ForwardBatch) -> None:
        """Query layout (s_q, padding rows or None), shared by all layers; the scheduler metadata is left to
        the first forward_mla (`_scheduler_metadata`)."""
        super().plan(batch)
        page_size = batch.kv_pool.page_size
        if page_size != PAGE_SIZE:
            raise ValueError(f"flashmla reads pages of {PAGE_SIZE} tokens, the KV pool has pages of {page_size}")
        q_lens = batch.extend_lens_cpu
        s_q = max(q_lens, default=0)
        uniform = all(n == s_q for n in q_lens)
        self.plan_state = FlashMLAPlan(
            s_q, None if uniform else padded_query_rows(batch.extend_lens, batch.num_tokens, s_q),
            batch.block_table.to(torch.int32).contiguous(),  # a no-op for ForwardBatch's own
            batch.seq_lens.to(torch.int32).contiguous(),
        )

    def init_cuda_graph(self, max_batch_size: int, max_num_tokens: int, max_pages: int) -> None:
        """Nothing to allocate: FlashMLA reads the runner's static block table and seq_lens as they are, and
        the scheduler metadata is made inside the graph (module docstring)."""

    def plan_capture(self, batch: ForwardBatch) -> None:
        """`plan`, for a batch whose requests all add the same number of tokens (no padding rows, whose
        gather positions would be a tensor made here and never refreshed)."""
        if len(set(batch.extend_lens_cpu)) > 1:
            raise ValueError(f"flashmla captures batches of one query length, got {batch.extend_lens_cpu}")
        self.plan(batch)

    def plan_replay(self, batch: ForwardBatch) -> None:
        """`plan`: host-side layout only; the graph refills its scheduler metadata from the static seq_lens.
        (Dropping this object's reference to that metadata frees nothing the graph needs: its tensors stay
        in the graph's memory pool, and every replay writes them before reading them.)"""
        self.plan(batch)

    def _scheduler_metadata(self, plan: FlashMLAPlan) -> tuple[Any, Any]:
        """This forward's (metadata, num_splits), made by its first call. A call being captured in a CUDA graph
        takes a fresh one when the current one was made outside the capture (by warm-up runs): filled
        outside, it would not be refilled by the graph's replays."""
        capturing = stream_capturing(self.device)
        if plan.metadata is None or plan.metadata_in_graph != capturing:
            # 9241ae3 ignores the arguments and returns an empty (metadata, None) for the first call to fill;
            # older releases compute the metadata here from them: (seq_lens, s_q * heads per KV head, KV heads),
            # with a kernel, which a capture then holds just the same.
            plan.metadata, plan.num_splits = self._flash_mla.get_mla_metadata(
                plan.seq_lens, plan.s_q * self.spec.num_heads, 1
            )
            plan.metadata_in_graph = capturing
        return plan.metadata, plan.num_splits

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q_nope [T, H, 512], q_rope [T, H, 64] bf16 -> [T, H, 512] bf16 over each request's cached tokens."""
        batch, plan = self.batch, self.plan_state
        assert plan is not None, "forward_mla before plan"
        pool = batch.kv_pool
        self.check_mla_inputs(q_nope, q_rope)
        if plan.s_q == 0:  # no new tokens: FlashMLA cannot launch on an empty query
            return q_nope.new_empty(q_nope.shape)
        q = flashmla_query(q_nope, q_rope, batch.batch_size, plan.s_q, plan.rows)
        metadata, num_splits = self._scheduler_metadata(plan)
        out, _ = self._flash_mla.flash_mla_with_kvcache(
            q, flashmla_kv_cache(pool.buffer(layer_id), PAGE_SIZE), plan.block_table, plan.seq_lens,
            pool.kv_lora_rank, metadata, num_splits, softmax_scale=self.spec.softmax_scale, causal=True,
        )
        return flashmla_output(out, plan.rows)


@hookimpl
def plugserve_backends() -> list[type[AttentionBackend]]:
    return [FlashMLAAttention]
