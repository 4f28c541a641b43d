"""CUDA-graph replay of the forwards over the paged cache, with a fixed number of new tokens per request:
the target's DECODE (1), and with speculative decoding the target's TARGET_VERIFY (num_draft_tokens), the
NextN layer's draft DECODE steps (1) and its DRAFT_EXTEND (num_draft_tokens: `SpeculativeWorker` pads the
accepted tokens to that many), and a whole round of greedy chains in one graph
(`speculative_graphs.greedy_round_forward`, num_draft_tokens).

At start-up one graph per mode is captured per batch size of `capture_sizes(--cuda-graph-max-bs)`, largest
first, every mode's in one memory pool. A batch of b requests replays the graph of the smallest captured size
>= b: its inputs (token ids, and for the NextN layer the hidden states it reads) are copied into static
buffers (`GraphInputs`), the rows past b are padding (tokens at positions 0.. of a row whose pages are all the
pool's padding page, so they read and write only that page), the attention backend refreshes its metadata in
place (`plan_replay`: on the host before the replay, or recorded in the graph when the backend declares
`graph_plan_on_device`), and the first b requests' rows of the graph's outputs are returned: logits (the lm head
is one GEMM whether the batch is padded or not) and, where the round needs them, hidden states. Sampling and
acceptance run outside, because they depend on per-request parameters.

Under DP attention (`dp_size` > 1) each rank captures its DP group's DECODE with every group padded to the same
size: the MLP's gathers then move `dp_size` equal blocks, fixed at capture, and the logits hold every group's
rows ([dp_size * size, vocab]). Every rank picks the same graph for a step from the groups' headers
(`dp_graph_size`: the largest group's batch, padded; an idle group replays it on padding rows alone), since the
graphs hold collectives.

What is captured is a list of `GraphPlan`s: the target's DECODE by default (`decode_graph_plans`), the
speculative forwards when speculative decoding supplies its own (`speculative_graphs.graph_plans`: none under DP
attention). A decode backend that does not declare a plan's mode in `capabilities.graph_modes`, or a batch larger
than the largest graph, runs eagerly; `CudaGraphs.status` says which and why.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from plugserve.core import graph_inputs
from plugserve.core.distributed import real_rows
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.host_copy import to_device
from plugserve.core.interfaces import AttentionBackend
from plugserve.core.kv_cache import MLAKVPool
from plugserve.core.moved import moved_names
from plugserve.core.progress import Progress
from plugserve.runtime.backends import RunnerBackends
from plugserve.runtime.row_buckets import in_bucket

if TYPE_CHECKING:
    from plugserve.core.models.deepseek import DeepseekForCausalLM
    from plugserve.runtime.rank_protocol import Header

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch
    attention: AttentionBackend
    outputs: tuple[torch.Tensor, ...]  # each [batch_size * tokens_per_request, ...], rewritten by every replay
    plan_in_graph: bool  # the backend's plan_replay was recorded in the graph (`graph_plan_on_device`)


# forward(input_ids [N] int64, hidden [N, H] or None, batch, attention) -> outputs, each [N, ...] (e.g. logits
# [N, vocab] float32), without planning attention. `hidden`: the static buffer of a runner given `hidden`.
GraphForward = Callable[[torch.Tensor, torch.Tensor | None, ForwardBatch, AttentionBackend], tuple[torch.Tensor, ...]]


def init_graph_attention(runners: list[CudaGraphRunner]) -> None:
    """Before any capture: each attention backend the runners use allocates its fixed buffers once, for the
    largest batch, token count and block-table width among them (backends key their graph state by mode and
    batch size, so one instance serves every mode's graphs; a second init would drop the buffers the graphs
    captured before it read)."""
    backends = {id(b): b for r in runners for b in map(r.backend_for_size, r.sizes)}
    max_bs = max(r.max_batch_size for r in runners)
    max_tokens = max(r.max_batch_size * r.tokens_per_request for r in runners)
    max_pages = max(r.inputs.max_pages for r in runners)
    for backend in backends.values():
        backend.init_cuda_graph(max_bs, max_tokens, max_pages)


class CudaGraphRunner:
    """Captures `forward` for one mode at the given batch sizes and replays it. `hidden` = (H, dtype) for a
    forward of the NextN layer, which reads hidden states beside the token ids."""

    def __init__(self, mode: ForwardMode, sizes: list[int], tokens_per_request: int, max_pages: int,
                 pool: MLAKVPool, padding_page: int, backend_for_size: Callable[[int], AttentionBackend],
                 hidden: tuple[int, torch.dtype] | None = None, dp_size: int = 1) -> None:
        self.mode, self.sizes, self.tokens_per_request = mode, sorted(sizes), tokens_per_request
        self.dp_size = dp_size
        self.inputs = graph_inputs.GraphInputs(self.sizes[-1], tokens_per_request, max_pages, pool, padding_page,
                                               hidden)
        self.backend_for_size = backend_for_size
        self._graphs: dict[int, _Graph] = {}
        # DP attention: which of the MLP's gathered rows are real, written before each replay (`replay_dp`).
        self.dp_real_rows = (torch.ones(dp_size * self.sizes[-1] * tokens_per_request, dtype=torch.bool,
                                        device=pool.device) if dp_size > 1 else None)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode is self.mode and batch.batch_size <= self.max_batch_size
                and batch.block_table.shape[1] <= self.inputs.max_pages
                and all(e == self.tokens_per_request for e in batch.extend_lens_cpu))

    def capture(self, forward: GraphForward, pool_handle: tuple[int, int],
                progress: Callable[[int], None] | None = None) -> None:
        """Capture every size, largest first, into the memory pool `pool_handle` (smaller graphs, and the
        other modes' captured after, reuse its blocks; `init_graph_attention` ran before). Each size runs
        eagerly first, the first size twice: JIT compiles and lazy allocations happen outside the graph."""
        device = self.inputs.pool.device
        stream = torch.cuda.Stream(device)
        for i, size in enumerate(reversed(self.sizes)):
            attention = self.backend_for_size(size)
            batch = self.inputs.batch(self.mode, size)
            if self.dp_real_rows is not None:
                batch.dp_tokens = [size * self.tokens_per_request] * self.dp_size
                batch.dp_real_rows = self.dp_real_rows[: self.dp_size * size * self.tokens_per_request]
            n = size * self.tokens_per_request
            hidden = None if self.inputs.hidden is None else self.inputs.hidden[:n]
            attention.plan_capture(batch)
            plan_in_graph = attention.capabilities.graph_plan_on_device

            def run(ids: torch.Tensor = self.inputs.input_ids[:n], hidden: torch.Tensor | None = hidden,
                    batch: ForwardBatch = batch, attention: AttentionBackend = attention,
                    plan_in_graph: bool = plan_in_graph) -> tuple[torch.Tensor, ...]:
                if plan_in_graph:
                    attention.plan_replay(batch)
                return forward(ids, hidden, batch, attention)

            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2 if i == 0 else 1):
                    run()
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            # capture_begin / end rather than torch.cuda.graph, which empties the allocator's cache each time.
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool_handle)
                try:
                    outputs = run()
                finally:
                    graph.capture_end()
            self._graphs[size] = _Graph(graph, batch, attention, outputs, plan_in_graph)
            if progress is not None:
                progress(size)
        torch.cuda.synchronize(device)

    def replay(self, input_ids: torch.Tensor, batch: ForwardBatch, hidden: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, ...]:
        """input_ids [T] (and hidden [T, H] for the NextN layer, or [B, H] for a forward reading one row per
        request) of a batch `can_run` accepts -> the forward's outputs at its T token rows, or at its B requests'
        rows for an output of one row per request (views of the graph's output buffers, valid until the next
        replay)."""
        size = graph_inputs.padded_size(self.sizes, batch.batch_size)
        if size is None or not self.can_run(batch):
            raise ValueError(f"no graph for a {batch.mode.name} batch of {batch.batch_size} requests")
        static = self.inputs.load(input_ids, batch, size, hidden)
        return tuple(out[: batch.batch_size if out.shape[0] == size else batch.num_tokens]
                     for out in self._launch(size, static))

    def replay_dp(self, input_ids: torch.Tensor, batch: ForwardBatch, size: int, dp_tokens: Sequence[int]
                  ) -> tuple[torch.Tensor, ...]:
        """Under DP attention: this rank's group's batch (b <= size requests, or an IDLE one of none) in the graph of
        `size` that every rank replays in the same step, `dp_tokens` every group's real token count -> the graph's
        whole outputs (logits [dp_size * size, vocab]: each group's `size` rows in group order, its first rows its
        real requests'; valid until the next replay). The padding rows reach no routed expert."""
        if batch.mode is not ForwardMode.IDLE and not self.can_run(batch):
            raise ValueError(f"no graph for a {batch.mode.name} batch of {batch.batch_size} requests")
        assert self.dp_real_rows is not None
        rows = real_rows(dp_tokens, size * self.tokens_per_request)
        self.dp_real_rows[: rows.numel()].copy_(to_device(rows, self.dp_real_rows.device))
        return self._launch(size, self.inputs.load(input_ids, batch, size, mode=self.mode))

    def _launch(self, size: int, static: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """Replay the graph of `size` on the loaded static batch; its full output buffers."""
        entry = self._graphs[size]
        if not entry.plan_in_graph:
            entry.attention.plan_replay(static)
        entry.graph.replay()
        return entry.outputs


# What a plan's forward is made of, once the model and the sampled vocabulary are known: (model, sample_vocab) ->
# the forward to capture.
ForwardFactory = Callable[["DeepseekForCausalLM", int], GraphForward]


@dataclass(frozen=True)
class GraphPlan:
    """A forward captured at every captured batch size. `label` names it in logs, in `CudaGraphs.status` and for
    lookups; `reads_hidden`: it reads hidden states [N, H] beside the token ids (the NextN layer does);
    `logits` / `hidden`: its outputs keep logits [N, vocab] float32 / hidden states [N, H] (what the graphs'
    memory holds); `modes`: every mode it runs attention in (default: `mode`); `plans_inside`: it plans
    attention for several sub-batches inside one graph, so every decode backend must plan on the device."""

    label: str
    mode: ForwardMode
    tokens_per_request: int
    forward: ForwardFactory
    reads_hidden: bool = False
    logits: bool = True
    hidden: bool = False
    modes: tuple[ForwardMode, ...] = ()
    plans_inside: bool = False

    @classmethod
    def of_model(cls, label: str, mode: ForwardMode, tokens_per_request: int, *, nextn: bool = False,
                 logits: bool = True, greedy: bool = False, hidden: bool = False) -> GraphPlan:
        """One forward of the target (or with `nextn` its NextN layer), its outputs as `model_forward` gives them."""
        return cls(label, mode, tokens_per_request, model_forward(nextn, logits, greedy, hidden), reads_hidden=nextn,
                   logits=logits, hidden=hidden)


class GraphPlans(NamedTuple):
    """The forwards to capture, the target's first (the widest: it sizes the graphs' memory), and notes on
    forwards that always run eagerly."""

    plans: list[GraphPlan]
    eager: tuple[str, ...] = ()


def model_forward(nextn: bool, logits: bool, greedy: bool, hidden: bool) -> ForwardFactory:
    """A forward of the target (or with `nextn` its NextN layer) whose outputs are, in order: logits [N, vocab]
    float32 when `logits`, each row's greedy token [N] int64 (argmax over the sampled vocabulary) when `greedy`,
    the final hidden states [N, H] when `hidden`."""

    def factory(model: DeepseekForCausalLM, sample_vocab: int) -> GraphForward:
        def forward(input_ids: torch.Tensor, states: torch.Tensor | None, batch: ForwardBatch,
                    attention: AttentionBackend) -> tuple[torch.Tensor, ...]:
            out = (model.forward_nextn(input_ids, states, batch, attention) if nextn  # type: ignore[arg-type]
                   else model(input_ids, batch, attention))
            scores = model.compute_logits(out, batch.dp_tokens) if logits or greedy else None
            return (*((scores,) if logits else ()),
                    *((scores[:, :sample_vocab].argmax(dim=-1),) if greedy else ()),  # type: ignore[index]
                    *((out,) if hidden else ()))

        return forward

    return factory


def decode_graph_plans() -> GraphPlans:
    """Without speculative decoding: the target's DECODE, keeping its logits."""
    return GraphPlans([GraphPlan.of_model(ForwardMode.DECODE.name, ForwardMode.DECODE, 1)])


def output_bytes(plans: Sequence[GraphPlan], vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 dp_size: int = 1) -> int:
    """Bytes the plans' graphs keep as outputs per captured request (under DP attention the logits hold every
    group's rows)."""
    logits_row = vocab_size * 4 * dp_size  # float32
    hidden_row = hidden_size * torch.empty(0, dtype=dtype).element_size()
    return sum(p.tokens_per_request * (logits_row * p.logits + hidden_row * p.hidden) for p in plans)


@dataclass
class CudaGraphs:
    """The captured graphs of one runner, by plan label, and `status`: what is captured and what runs eagerly,
    and why (for /server_info and the log)."""

    status: str
    runners: dict[str, CudaGraphRunner] = field(default_factory=dict)

    def get(self, label: str, batch: ForwardBatch) -> CudaGraphRunner | None:
        """The graph of plan `label` when it holds `batch` (never a draft tree's: its mask changes every round)."""
        graph = self.runners.get(label)
        return graph if graph is not None and batch.tree is None and graph.can_run(batch) else None

    def capture(self, planned: GraphPlans, sizes: list[int], backends: RunnerBackends, model: DeepseekForCausalLM,
                sample_vocab: int, hidden: tuple[int, torch.dtype], pool: MLAKVPool, padding_page: int,
                max_pages: int, dp_size: int = 1) -> None:
        """Capture every plan whose forwards the decode buckets' attention backends (in every mode it runs) and
        the MoE and GEMM backends can run under graphs, at `sizes`. A plan that cannot be captured, or all of
        them when a capture fails, runs eagerly, and `status` says which and why. `hidden`: (H, dtype) of the hidden
        states the NextN layer's plans read; `dp_size`: DP attention's groups (`CudaGraphRunner`)."""
        plans, eager = [], []
        for plan in planned.plans:
            if reason := _blocker(plan, backends):
                eager.append(f"{plan.label} {'is not one graph' if plan.plans_inside else 'runs eagerly'}: {reason}")
                logger.warning("CUDA graphs off for %s: %s", plan.label, reason)
            else:
                plans.append(plan)
        eager += planned.eager
        backend_for_size = functools.partial(in_bucket, backends.decode_buckets)
        runners = [CudaGraphRunner(p.mode, sizes, p.tokens_per_request, max_pages, pool, padding_page,
                                   backend_for_size, hidden if p.reads_hidden else None, dp_size)
                   for p in plans]
        captured = ""
        if runners:
            bar = Progress(len(sizes) * len(runners), "capturing CUDA graphs", "graphs")
            try:
                init_graph_attention(runners)
                pool_handle = torch.cuda.graph_pool_handle()  # one memory pool for every plan's graphs
                for plan, runner in zip(plans, runners, strict=True):
                    runner.capture(plan.forward(model, sample_vocab), pool_handle, progress=lambda _: bar.update())
                    self.runners[plan.label] = runner
            except Exception as exc:
                self.runners = {}
                eager = [f"{', '.join(p.label for p in plans)} run eagerly: capture failed: "
                         f"{type(exc).__name__}: {exc}", *eager]
                logger.exception("CUDA graph capture failed; the forwards run eagerly")
            else:
                captured = (f"{', '.join(p.label for p in plans)} captured at batch sizes {sizes} (larger "
                            "batches run eagerly)")
            finally:
                bar.close()
        self.status = "; ".join(filter(None, [captured, *eager]))
        logger.info("CUDA graphs: %s", self.status)


def dp_graph_size(graph: CudaGraphRunner, headers: Sequence[Header | None]) -> int | None:
    """The size of `graph` (a DECODE one of DP attention) that every rank replays for a step of these DP groups'
    headers (None: an idle group), or None when the step runs eagerly: a group's batch is not DECODE, is larger
    than the largest graph, is wider than its block table, or does not sample each of its requests' one token
    (the graph's logits are read as each group's first rows)."""
    live = [h for h in headers if h is not None]
    if not live or any(h.mode is not graph.mode or h.width > graph.inputs.max_pages or h.num_sampled != len(h.seq_lens)
                       or any(e != graph.tokens_per_request for e in h.extend_lens) for h in live):
        return None
    return graph_inputs.padded_size(graph.sizes, max(len(h.seq_lens) for h in live))


def _blocker(plan: GraphPlan, backends: RunnerBackends) -> str:
    """Why `plan` cannot be captured, or ''."""
    for mode in plan.modes or (plan.mode,):
        for bucket in backends.decode_buckets:
            if mode not in bucket.backend.capabilities.graph_modes:
                return f"attention backend {bucket.backend.name} does not run {mode.name} under CUDA graphs"
        for kind_backend in (backends.model.moe, backends.model.gemm):
            if kind_backend is not None and not kind_backend.capabilities.cuda_graph:
                return f"{kind_backend.kind} backend {kind_backend.name} cannot be captured in a CUDA graph"
    if plan.plans_inside:
        for bucket in backends.decode_buckets:
            if not bucket.backend.capabilities.graph_plan_on_device:
                return f"attention backend {bucket.backend.name} plans on the host before each replay"
    return ""


__getattr__ = moved_names(__name__)
