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

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.interfaces import AttentionBackend
from plugserve.core.kv_cache import MLAKVPool

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """SGLang's default capture list (1, 2, 4, 8, 12, then every 8 up to 256), cut at `max_batch_size`,
    which is always captured itself."""
    sizes = [s for s in [1, 2, 4, 8, 12, *range(16, 257, 8)] if s < max_batch_size]
    return [*sizes, max_batch_size]


def padded_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest captured size holding `batch_size` requests (sizes ascending), or None."""
    at = bisect.bisect_left(sizes, batch_size)
    return sizes[at] if at < len(sizes) else None


class GraphInputs:
    """The static device buffers a graph reads its batch from; a graph of b requests sees the first b
    rows (b * tokens_per_request tokens) of each.

      input_ids [N] int64, positions [N] int64, out_cache_loc [N] int64 (N = max_bs * tokens_per_request)
      seq_lens [max_bs] int32, extend_lens [max_bs] int32 (all tokens_per_request),
      cu_extend_lens [max_bs + 1] int32, block_table [max_bs, max_pages] int32
      hidden [N, H] of `hidden`'s dtype, only given `hidden` = (H, dtype): what the NextN layer reads
    """

    def __init__(self, max_batch_size: int, tokens_per_request: int, max_pages: int, pool: MLAKVPool,
                 padding_page: int, hidden: tuple[int, torch.dtype] | None = None) -> None:
        self.max_batch_size, self.tokens_per_request, self.max_pages = max_batch_size, tokens_per_request, max_pages
        self.pool, self.padding_page = pool, padding_page
        n, device = max_batch_size * tokens_per_request, pool.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.extend_lens = torch.full((max_batch_size,), tokens_per_request, dtype=torch.int32, device=device)
        self.cu_extend_lens = torch.arange(0, n + 1, tokens_per_request, dtype=torch.int32, device=device)
        # Padding: request r's tokens at positions 0..tokens_per_request-1 of a row of padding pages.
        self._pad_positions = torch.arange(tokens_per_request, dtype=torch.int64, device=device).repeat(max_batch_size)
        self._pad_slots = padding_page * pool.page_size + self._pad_positions % pool.page_size
        self.positions = self._pad_positions.clone()
        self.out_cache_loc = self._pad_slots.clone()
        self.seq_lens = self.extend_lens.clone()
        self.block_table = torch.full((max_batch_size, max_pages), padding_page, dtype=torch.int32, device=device)
        self.hidden = None if hidden is None else torch.zeros(n, hidden[0], dtype=hidden[1], device=device)

    def batch(self, mode: ForwardMode, batch_size: int, seq_lens_cpu: list[int] | None = None) -> ForwardBatch:
        """The ForwardBatch of the first `batch_size` rows: views of the static buffers, with host lengths
        `seq_lens_cpu` (default: all padding)."""
        n = batch_size * self.tokens_per_request
        return ForwardBatch(
            mode=mode,
            seq_lens_cpu=seq_lens_cpu or [self.tokens_per_request] * batch_size,
            extend_lens_cpu=[self.tokens_per_request] * batch_size,
            seq_lens=self.seq_lens[:batch_size],
            extend_lens=self.extend_lens[:batch_size],
            cu_extend_lens=self.cu_extend_lens[: batch_size + 1],
            positions=self.positions[:n],
            block_table=self.block_table[:batch_size],
            out_cache_loc=self.out_cache_loc[:n],
            kv_pool=self.pool,
        )

    def load(self, input_ids: torch.Tensor, batch: ForwardBatch, batch_size: int,
             hidden: torch.Tensor | None = None) -> ForwardBatch:
        """Copy a real batch (b <= batch_size requests of tokens_per_request tokens each; `hidden` [R, H] with
        the `hidden` buffer, else None: R = T, one row per token, or b for a forward that reads one per request)
        into the first rows and make rows b..batch_size-1 padding (their hidden rows keep whatever they held:
        padding rows' outputs are never read). Returns the static batch of `batch_size` rows."""
        b, n = batch.batch_size, batch.num_tokens
        padded_n = batch_size * self.tokens_per_request
        if any(e != self.tokens_per_request for e in batch.extend_lens_cpu):
            raise ValueError(f"graph inputs take {self.tokens_per_request} new tokens per request, got "
                             f"{batch.extend_lens_cpu}")
        width = batch.block_table.shape[1]
        if b > batch_size or width > self.max_pages:
            raise ValueError(f"a batch of {b} requests and {width} pages does not fit a graph of {batch_size} "
                             f"requests and {self.max_pages} pages")
        if (hidden is None) != (self.hidden is None):
            raise ValueError("hidden states go with graphs of the NextN layer, and only with them")
        if hidden is not None:
            self.hidden[: hidden.shape[0]].copy_(hidden, non_blocking=True)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc, non_blocking=True)
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        self.block_table[:b, :width].copy_(batch.block_table, non_blocking=True)
        if b < batch_size:
            self.positions[n:padded_n].copy_(self._pad_positions[n:padded_n])
            self.out_cache_loc[n:padded_n].copy_(self._pad_slots[n:padded_n])
            self.seq_lens[b:batch_size].fill_(self.tokens_per_request)
            self.block_table[b:batch_size].fill_(self.padding_page)
        pad = [self.tokens_per_request] * (batch_size - b)
        static = self.batch(batch.mode, batch_size, batch.seq_lens_cpu + pad)
        static.attn_method = batch.attn_method
        return static


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
