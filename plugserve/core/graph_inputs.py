"""The static inputs of CUDA-graph replay, as attention backends and the graph runner see them: the sizes
graphs are captured at, and the fixed device buffers a captured batch is read from (rows past the real batch
are padding on the pool's padding page)."""

from __future__ import annotations

import bisect

import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool


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
             hidden: torch.Tensor | None = None, mode: ForwardMode | None = None) -> ForwardBatch:
        """Copy a real batch (b <= batch_size requests of tokens_per_request tokens each; `hidden` [R, H] with
        the `hidden` buffer, else None: R = T, one row per token, or b for a forward that reads one per request)
        into the first rows and make rows b..batch_size-1 padding (their hidden rows keep whatever they held:
        padding rows' outputs are never read). Returns the static batch of `batch_size` rows, in `mode` (default:
        the batch's; an IDLE batch of no requests loads as all padding in the graph's mode)."""
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
        static = self.batch(mode or batch.mode, batch_size, batch.seq_lens_cpu + pad)
        static.attn_method = batch.attn_method
        return static
