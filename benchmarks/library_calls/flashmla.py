"""FlashMLA, the library behind the flashmla backend, called directly on the inputs that backend gets, so that
the shootout can measure what plugserve's wrapper costs. GPU only (imports flash_mla; sm90a, bf16, pages of 64)."""

from __future__ import annotations

from collections.abc import Callable

import flash_mla
import torch


def mla_decode(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv_buffer: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, page_size: int, sm_scale: float,
) -> Callable[[], torch.Tensor]:
    """q_nope [B, H, 512], q_rope [B, H, 64] bf16; kv_buffer [num_slots, 576] bf16 (slot = page * page_size +
    offset); block_table [B, max_pages] int32; seq_lens [B] int32 (cuda); page_size 64 -> a callable returning
    out [B, H, 512] bf16: q_nope ++ q_rope as [B, 1, H, 576], then flash_mla_with_kvcache over the pool viewed
    as [num_pages, 64, 1, 576]. The scheduler metadata is made and filled here, before the callable, as the
    layers after a forward's first reuse it."""
    if page_size != 64:
        raise ValueError(f"FlashMLA reads pages of 64 tokens, not {page_size}")
    batch, heads, rank = q_nope.shape
    k_cache = kv_buffer.view(-1, page_size, 1, kv_buffer.shape[-1])
    metadata, num_splits = flash_mla.get_mla_metadata(seq_lens, heads, 1)

    def call() -> torch.Tensor:
        q = torch.cat([q_nope, q_rope], dim=-1).view(batch, 1, heads, -1)
        out, _ = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seq_lens, rank, metadata, num_splits,
                                                  softmax_scale=sm_scale, causal=True)
        return out.view(batch, heads, rank)

    call()  # FlashMLA (9241ae3) fills the metadata in its first call
    return call
