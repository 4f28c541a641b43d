"""Random forward batches over a paged MLA pool, for the kit, the tests and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool, token_slots
from plugserve.core.specs import AttentionSpec


def random_batch(
    mode: ForwardMode,
    seq_lens: Sequence[int],
    extend_lens: Sequence[int],
    spec: AttentionSpec,
    device: torch.device,
    num_layers: int = 2,
    kv_scale: float = 1.0,
) -> ForwardBatch:
    """A batch whose requests own shuffled (non-contiguous, out-of-order) pages of a fresh pool, with
    random latents and rope keys already cached at every prefix position of every layer.
    Uses spec.page_size (1 when None) and spec.kv_dtype; `kv_scale` is the pool's (an fp8 one's)."""
    page_size = spec.page_size or 1
    pages_per_request = [-(-s // page_size) for s in seq_lens]
    max_pages = max([*pages_per_request, 1])
    num_pages = sum(pages_per_request) + 3  # spare pages so no request happens to own page 0..n in order
    order = torch.randperm(num_pages)
    block_table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    used = 0
    for row, n in enumerate(pages_per_request):
        block_table[row, :n] = order[used : used + n]
        used += n
    pool = MLAKVPool(num_layers, num_pages, page_size, spec.kv_lora_rank, spec.qk_rope_head_dim,
                     spec.kv_dtype, device, kv_scale)
    batch = ForwardBatch.build(mode, seq_lens, extend_lens, block_table.to(device), pool)
    prefix_lens = batch.prefix_lens_cpu
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(prefix_lens)).to(device)
    positions = torch.cat([torch.arange(p) for p in prefix_lens] or [torch.zeros(0)]).long().to(device)
    slots = token_slots(batch.block_table, rows, positions, page_size)
    for layer in range(num_layers):
        latent = torch.randn(len(slots), spec.kv_lora_rank, device=device)
        rope = torch.randn(len(slots), spec.qk_rope_head_dim, device=device)
        pool.write(layer, slots, latent, rope)
    return batch
