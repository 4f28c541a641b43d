"""How a key block of the paged MLA pool reaches a stage of the Gluon MLA decode's shared memory (`gluon_mla`):
one TMA box where the pages hold whole 64-key blocks, masked loads for a sequence's partial last block, and on
shorter pages (the server's default is 1) a row a key by cp.async, whose readers fence the async proxy first."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from plugserve.plugins.gluon_support import tma_load

BLOCK_N = gl.constexpr(64)  # keys a block: one warpgroup's score wgmma N
IO_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # global loads


@gluon.jit
def load_rows(base, rows, row_stride, row_mask, COLS: gl.constexpr, layout: gl.constexpr):
    """[len(rows), COLS] elements at base + rows * row_stride + col, 0 where row_mask is false."""
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    return gl.load(base + rows[:, None] * row_stride + cols[None, :], mask=row_mask[:, None], other=0.0)


@gluon.jit
def fill_block(desc, kv_ptr, dst, ready, block_table_row, stride_kv, b, last, full, kv_len, col0,
               COLS: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Key block b's columns col0 .. col0 + COLS of the pool into `dst` [64, COLS] (nothing when b >= last), arriving
    on `ready`. Pages of a multiple of 64 keys: one TMA box for a full block (inside one page), masked loads for the
    sequence's partial last block. Smaller pages: a row a key through cp.async (`_fill_rows`). Run by one
    warpgroup."""
    if PAGE_SIZE % BLOCK_N == 0:
        if b < full:
            row = gl.load(block_table_row + b * BLOCK_N // PAGE_SIZE) * PAGE_SIZE + b * BLOCK_N % PAGE_SIZE
            mbarrier.expect(ready, desc.block_type.nbytes)
            tma_load(desc, [row, col0], ready, dst)
        elif b < last:
            _fill_rows(kv_ptr, dst, ready, block_table_row, stride_kv, b, kv_len, col0, COLS, PAGE_SIZE, False)
    elif b < last:
        _fill_rows(kv_ptr, dst, ready, block_table_row, stride_kv, b, kv_len, col0, COLS, PAGE_SIZE, True)


@gluon.jit
def _fill_rows(kv_ptr, dst, ready, block_table_row, stride_kv, b, kv_len, col0, COLS: gl.constexpr,
               PAGE_SIZE: gl.constexpr, ASYNC: gl.constexpr):
    """`fill_block` a row a key, 128 bytes at a time, zeros past kv_len. ASYNC (pages shorter than a block): by
    cp.async, without waiting for the copies: each thread's arrival on `ready` lands when its copies have
    (cp.async.mbarrier.arrive, which first raises the barrier's count, so the barrier's own single arrival, after
    every thread's, completes it only then); a reader fences before its wgmmas (`_scores`), the copies writing
    through the generic proxy. Else (a sequence's partial last block on pages of 64) by masked loads and stores.
    (Inlined: as a noinline function its thread barrier lowers to the whole CTA's, which a warp-specialized
    partition must not wait on.)"""
    n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, IO_LAYOUT))
    valid = n < kv_len
    page = gl.load(block_table_row + n // PAGE_SIZE, mask=valid, other=0).to(gl.int64)
    rows = kv_ptr + (page * PAGE_SIZE + n % PAGE_SIZE)[:, None] * stride_kv
    CHUNK: gl.constexpr = min(COLS, 1024 // dst.dtype.primitive_bitwidth)  # 128 bytes: one swizzle row
    for c in gl.static_range(COLS // CHUNK):
        cols = col0 + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, IO_LAYOUT))
        part = dst.slice(c * CHUNK, CHUNK, dim=1)
        if ASYNC:
            async_copy.async_copy_global_to_shared(part, rows + cols[None, :], mask=valid[:, None])
        else:
            part.store(gl.load(rows + cols[None, :], mask=valid[:, None], other=0.0))
    if ASYNC:
        async_copy.mbarrier_arrive(ready)
    else:
        fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ready, count=1)
