"""CUDA-graph replay of the forwards over the paged cache, with a fixed number of new tokens per request:
the target's DECODE (1), and with speculative decoding the target's TARGET_VERIFY (num_draft_tokens), the
NextN layer's draft DECODE steps (1) and its DRAFT_EXTEND (num_draft_tokens: `SpeculativeWorker` pads the
accepted tokens to that many), and a whole round of greedy chains in one graph (`speculative.greedy_round_forward`,
num_draft_tokens).

At start-up one graph per mode is captured per batch size of `capture_sizes(--cuda-graph-max-bs)`, largest
first, every mode's in one memory pool. A batch of b requests replays the graph of the smallest captured size
>= b: its inputs (token ids, and for the NextN layer the hidden states it reads) are copied into static
buffers (`GraphInputs`), the rows past b are padding (tokens at positions 0.. of a row whose pages are all the
pool's padding page, so they read and write only that page), the attention backend refreshes its metadata in
place (`plan_replay`: on the host before the replay, or recorded in the graph when the backend declares
`graph_plan_on_device`), and the first b requests' rows of the graph's outputs are returned: logits (the lm head
is one GEMM whether the batch is padded or not) and, where the round needs them, hidden states. Sampling and
acceptance run outside, because they depend on per-request parameters.

A decode backend that does not declare the mode in `capabilities.graph_modes`, or a batch larger than the
largest graph, runs eagerly; `ModelRunner.graph_status` says which and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.graph_inputs import GraphInputs, padded_size
from plugserve.core.interfaces import AttentionBackend
from plugserve.core.kv_cache import MLAKVPool

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
    backends = {id(b): b for r in runners for b in map(r.attention_for, r.sizes)}
    max_bs = max(r.max_batch_size for r in runners)
    max_tokens = max(r.max_batch_size * r.tokens_per_request for r in runners)
    max_pages = max(r.inputs.max_pages for r in runners)
    for backend in backends.values():
        backend.init_cuda_graph(max_bs, max_tokens, max_pages)


class CudaGraphRunner:
    """Captures `forward` for one mode at the given batch sizes and replays it. `hidden` = (H, dtype) for a
    forward of the NextN layer, which reads hidden states beside the token ids."""

    def __init__(self, mode: ForwardMode, sizes: list[int], tokens_per_request: int, max_pages: int,
                 pool: MLAKVPool, padding_page: int, attention_for: Callable[[int], AttentionBackend],
                 hidden: tuple[int, torch.dtype] | None = None) -> None:
        self.mode, self.sizes, self.tokens_per_request = mode, sorted(sizes), tokens_per_request
        self.inputs = GraphInputs(self.sizes[-1], tokens_per_request, max_pages, pool, padding_page, hidden)
        self.attention_for = attention_for
        self._graphs: dict[int, _Graph] = {}

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
        eagerly twice first: JIT compiles and lazy allocations happen outside the graph."""
        device = self.inputs.pool.device
        stream = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            attention = self.attention_for(size)
            batch = self.inputs.batch(self.mode, size)
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
                for _ in range(2):
                    run()
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool_handle, stream=stream):
                outputs = run()
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
        size = padded_size(self.sizes, batch.batch_size)
        if size is None or not self.can_run(batch):
            raise ValueError(f"no graph for a {batch.mode.name} batch of {batch.batch_size} requests")
        static = self.inputs.load(input_ids, batch, size, hidden)
        return tuple(out[: batch.batch_size if out.shape[0] == size else batch.num_tokens]
                     for out in self._launch(size, static))

    def _launch(self, size: int, static: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """Replay the graph of `size` on the loaded static batch; its full output buffers."""
        entry = self._graphs[size]
        if not entry.plan_in_graph:
            entry.attention.plan_replay(static)
        entry.graph.replay()
        return entry.outputs
