"""The Triton kernel of `ForwardBatch.build` on CUDA: every new token's position and KV-pool slot in one launch,
where torch takes about ten (the positions' arithmetic, the page lookup, the slot's).

Imported only by `ForwardBatch.build` on CUDA and by tests: importing plugserve.core must not import triton, and
`triton.jit` decides when the kernel is defined whether it compiles or runs in the interpreter (TRITON_INTERPRET=1).
The batch and row counts change with every batch, so the kernel does not specialize on their divisibility.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens a program places per step: a prefill row of many tokens loops over them in blocks of at most this.
MAX_BLOCK = 1024
MIN_BLOCK = 16


@triton.jit(do_not_specialize_on_alignment=["stride_bt"])
def _token_layout_kernel(seq_lens_ptr, extend_lens_ptr, cu_extend_lens_ptr, block_table_ptr, positions_ptr,
                         slots_ptr, stride_bt, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: request r's new tokens i = 0 .. extend_len - 1 at position seq_len - extend_len + i, in the slot
    of that position's page (block_table[r, position // PAGE_SIZE]), written at row cu_extend_lens[r] + i."""
    r = tl.program_id(0).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r)
    extend_len = tl.load(extend_lens_ptr + r)
    start = tl.load(cu_extend_lens_ptr + r).to(tl.int64)
    first = (seq_len - extend_len).to(tl.int64)
    for block in range(0, extend_len, BLOCK):
        i = block + tl.arange(0, BLOCK)
        mask = i < extend_len
        position = first + i
        page = tl.load(block_table_ptr + r * stride_bt + position // PAGE_SIZE, mask=mask, other=0)
        tl.store(positions_ptr + start + i, position, mask=mask)
        tl.store(slots_ptr + start + i, page.to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE, mask=mask)


def token_layout(seq_lens: torch.Tensor, extend_lens: torch.Tensor, cu_extend_lens: torch.Tensor,
                 block_table: torch.Tensor, page_size: int, num_tokens: int, max_extend: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_lens, extend_lens [B] int32, cu_extend_lens [B + 1] int32, block_table [B, max_pages] int32 (last dim
    contiguous); `num_tokens` = sum(extend_lens) and `max_extend` = max(extend_lens), known on the host. Returns the
    new tokens' positions and pool slots, [num_tokens] int64 each, request after request."""
    device = block_table.device
    positions = torch.empty(num_tokens, dtype=torch.int64, device=device)
    slots = torch.empty(num_tokens, dtype=torch.int64, device=device)
    batch = seq_lens.shape[0]
    if batch and num_tokens:
        block = min(MAX_BLOCK, max(MIN_BLOCK, triton.next_power_of_2(max_extend)))
        _token_layout_kernel[(batch,)](seq_lens, extend_lens, cu_extend_lens, block_table, positions, slots,
                                       block_table.stride(0), PAGE_SIZE=page_size, BLOCK=block)
    return positions, slots
