"""The paged MLA latent pool: per layer and per token, the compressed KV latent and the rope key.

An fp8 pool (float8_e4m3fn) stores value / scale, saturated to e4m3's range and rounded to nearest even, with one
float32 `scale` for the whole pool (SGLang's per-tensor k_scale): a reader upcasts and multiplies by it. Per-tensor
because the normed latent and the rotated rope key of DeepSeek's layers stay well inside e4m3's range (|x| < 448
with 2^-9 the smallest step), so a finer scale would buy nothing e4m3's 3-bit mantissa does not already bound
(relative error 2^-4 per element), and a single number costs the kernels one multiply per tile, not a load.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The largest finite float8_e4m3fn; torch's cast gives NaN beyond it, so values are clamped first.
E4M3_MAX = 448.0

class MLAKVPool:
    """KV storage for MLA: `kv_lora_rank + qk_rope_head_dim` values per token per layer.

    Slot `s` of a layer lives at row `s` of `buffer(layer)` [num_pages * page_size, kv_lora_rank + rope];
    the first `kv_lora_rank` columns are the normalized latent c_kv, the rest the rotated rope key.
    Page `p` holds slots [p * page_size, (p + 1) * page_size). Keeping latent and rope in one row is
    the layout FlashMLA reads; backends that want them split take the two column views. `scale` (float32, 1.0
    unless set): a float8_e4m3fn pool stores value / scale, and `read` multiplies it back (module docstring); other
    dtypes store values as they are and must keep it at 1.0.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scale: float = 1.0,
    ) -> None:
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"page_size and num_pages must be >= 1, got {page_size} and {num_pages}")
        if not scale > 0 or (scale != 1.0 and dtype != torch.float8_e4m3fn):
            raise ValueError(f"a KV scale of {scale} needs a float8_e4m3fn pool (and > 0), not {dtype}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.dtype = dtype
        self.scale = scale
        self.device = torch.device(device)
        width = kv_lora_rank + qk_rope_head_dim
        self._buffers = [
            torch.zeros(num_pages * page_size, width, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def buffer(self, layer_id: int) -> torch.Tensor:
        """[num_slots, kv_lora_rank + rope] of `dtype`."""
        return self._buffers[layer_id]

    def paged(self, layer_id: int) -> torch.Tensor:
        """[num_pages, page_size, kv_lora_rank + rope], a view of `buffer(layer_id)`."""
        return self._buffers[layer_id].view(self.num_pages, self.page_size, -1)

    def latent(self, layer_id: int) -> torch.Tensor:
        """[num_slots, kv_lora_rank], a strided view."""
        return self._buffers[layer_id][:, : self.kv_lora_rank]

    def rope(self, layer_id: int) -> torch.Tensor:
        """[num_slots, qk_rope_head_dim], a strided view."""
        return self._buffers[layer_id][:, self.kv_lora_rank :]

    def write(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Store latent [n, kv_lora_rank] and k_rope [n, rope] at `slots` [n] int64 (`store_rows`)."""
        store_rows(self._buffers[layer_id], slots, latent, k_rope, self.scale)

    def gather(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows at `slots` [n] int64 -> [n, kv_lora_rank + rope], stored values (fp8: not yet times `scale`)."""
        return self._buffers[layer_id][slots]

    def read(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows at `slots` [n] int64 as the values they hold, in `dtype`: [n, kv_lora_rank + rope] (fp8 rows upcast
        and times `scale`)."""
        rows = self._buffers[layer_id][slots]
        return dequantize(rows, self.scale, dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, layers: Sequence[int]) -> None:
        """Row src[i] into row dst[i] of each of `layers` (src, dst [n] int64; dst distinct); every row is read
        before any is written, so the two may overlap."""
        for layer in layers:
            buf = self._buffers[layer]
            buf[dst] = buf[src]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x cast to the pool's `dtype`; to float8_e4m3fn as x / scale in float32, saturated to +-E4M3_MAX and rounded
    to nearest even."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(dtype)


def dequantize(rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored pool values in `dtype`: fp8 ones upcast to float32 and times `scale` first."""
    if rows.dtype != torch.float8_e4m3fn:
        return rows.to(dtype)
    return (rows.float() * scale).to(dtype)


def store_rows(buffer: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
               scale: float = 1.0) -> None:
    """Rows `slots` [n] int64 of one layer's buffer [num_slots, R + P] = latent [n, R] ++ k_rope [n, P], cast to
    the buffer's dtype (`quantize`: an fp8 buffer stores value / scale)."""
    r = latent.shape[-1]
    buffer[slots, :r] = quantize(latent, buffer.dtype, scale)
    buffer[slots, r:] = quantize(k_rope, buffer.dtype, scale)


def token_slots(
    block_table: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Pool slots of tokens: block_table [B, max_pages] int32 page ids; requests [n] int64 (each token's
    row of the block table) and positions [n] int64 (its position in its request). Returns [n] int64."""
    pages = block_table[requests, positions // page_size].to(torch.int64)
    return pages * page_size + positions % page_size


def sequence_slots(block_table: torch.Tensor, seq_lens: Sequence[int], page_size: int) -> torch.Tensor:
    """Slots of positions 0..seq_lens[b]-1 of every request b, request-major: [sum(seq_lens)] int64."""
    device = block_table.device
    requests = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens, dtype=torch.int64))
    positions = torch.cat([torch.arange(n) for n in seq_lens] or [torch.zeros(0, dtype=torch.int64)])
    return token_slots(block_table, requests.to(device), positions.to(device), page_size)


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than asked for; the scheduler waits or retracts a request."""


class PoolAccountingError(AssertionError):
    """KV pages leaked (allocated, owned by no one) or owned twice: a scheduler or prefix-cache bug."""


class PageAllocator:
    """Hands out and takes back the pool's page ids. Freed pages are reused first (warm in cache)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives 0, 1, 2, ...
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} of {self.num_pages} are free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise ValueError(f"page {page} is not allocated")
            self._used.remove(page)
            self._free.append(page)

    def check(self) -> set[int]:
        """The free pages, after checking that each page is either free (once) or allocated."""
        free = set(self._free)
        if len(free) != len(self._free):
            twice = sorted(p for p in free if self._free.count(p) > 1)
            raise PoolAccountingError(f"pages on the free list twice: {twice}")
        if free & self._used:
            raise PoolAccountingError(f"pages both free and allocated: {sorted(free & self._used)}")
        if len(free) + len(self._used) != self.num_pages:
            lost = self.num_pages - len(free) - len(self._used)
            raise PoolAccountingError(f"{lost} pages are neither free nor allocated")
        return free


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
