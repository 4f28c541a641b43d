"""Block-FP8 GEMM for Hopper in Gluon, scheduled as DeepGEMM's sm90 kernel is: the Triton backend's GEMM where
`gluon_gemm_fits` (sm90, at least `GLUON_MIN_M` rows and `GLUON_MIN_K` deep, tiles that fill the SMs' waves).

Persistent: one program an SM walks the [128, 128] output tiles (groups of GROUP_M row tiles sweep the column
tiles together, so that the programs running at once share A and B tiles in L2). Three warp-specialized
partitions:
- a producer warp (24 registers) streams each tile's K blocks, A as two [64, 128] halves and B as [128, 128]
  e4m3 boxes, through a STAGES-deep ring, refilling a slot once both consumers released it (empty barriers of
  count 2); it runs ahead into the next tile while the consumers finish and store the last one;
- two consumer warpgroups (240 registers each) take 64 rows each. Every K block's product lands in its own wgmma
  accumulator (use_acc=False) and is promoted into the float32 total with one FMA by its scales (the row's
  per-token-group scale times the weight block's). Two K blocks a step: both issued, the first waited for alone
  (wait_group 1), its slot released and promoted while the second's wgmma runs, then the second. Three [64, 128]
  float32 tiles live in registers: the total and the two products. The tile leaves through shared memory and a
  TMA store, which the consumer does not wait for before starting the next tile.
The consumers never wait for each other, so one's promotions run beside the other's wgmmas. Gluon kernels do not
run in Triton's interpreter: tested on a GPU only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from plugserve.plugins.gluon_support import release, tma_load, tma_store
from plugserve.plugins.triton_support import tma_source

BLOCK = 128  # the tile's rows and columns and the K block: DeepSeek's 128 x 128 weight scale blocks
HALF = gl.constexpr(64)  # rows a consumer warpgroup: its wgmma M
# 32 KB a ring stage (A and B e4m3 blocks), and the two consumers' output tiles: 32 KB in 16 bits (6 stages, 224
# KB of shared memory), 64 KB in float32 (5 stages).
STAGES = {2: 6, 4: 5}
OUT_ELEMENT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}
GROUP_M = 8
# Where the Gluon kernel takes over from the Triton one (measurements: docs/kernels.md, "Gluon GEMM"): below 256
# rows most of a 128-row tile is padding and the Triton kernel's decode configs (small tiles, split-K) fit better.
GLUON_MIN_M = 256
GLUON_MIN_K = 512  # the shallowest depth measured
# More tiles than SMs run in waves; where they fill under this share of the waves' slots the Triton kernel's smaller
# tiles are faster.
GLUON_MIN_WAVE_FILL = 0.6
CONSUMER_REGS = gl.constexpr(240)  # consumer 1's; Triton gives consumer 0 (the kernel's own warps) the same
PRODUCER_REGS = gl.constexpr(24)


@gluon.jit
def _tile_offsets(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """Row and column offsets of output tile `tile` in GROUP_M-row-tile groups that walk the column tiles."""
    per_group = GROUP_M * num_n
    first_m = tile // per_group * GROUP_M
    group_m = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    return pid_m * 128, pid_n * 128


@gluon.jit
def _producer(a_desc, b_desc, a_smem, b_smem, full, empty, num_m, num_n, num_kb, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr):
    """The TMA warp: every K block of every tile this program owns, into slot it % STAGES of the ring."""
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, num_m, num_n, GROUP_M)
        for kb in range(num_kb):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it - STAGES) // STAGES) & 1, pred=it >= STAGES)
            mbarrier.expect(full.index(slot), 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [off_m, kb * 128], full.index(slot), a_smem.index(2 * slot))
            tma_load(a_desc, [off_m + HALF, kb * 128], full.index(slot), a_smem.index(2 * slot + 1))
            tma_load(b_desc, [off_n, kb * 128], full.index(slot), b_smem.index(slot))
            it += 1


@gluon.jit
def _issue(a_smem, b_smem, full, it, C: gl.constexpr, STAGES: gl.constexpr, layout: gl.constexpr):
    """The product of the K block in ring slot it % STAGES, issued (async) once its TMA copies landed."""
    slot = it % STAGES
    mbarrier.wait(full.index(slot), (it // STAGES) & 1)
    return warpgroup_mma(a_smem.index(2 * slot + C), b_smem.index(slot).permute((1, 0)),
                         gl.zeros([HALF, 128], gl.float32, layout), use_acc=False, is_async=True)


@gluon.jit
def _promote(part, outstanding: gl.constexpr, scale, total, empty, it, STAGES: gl.constexpr):
    """Waits for `part` (leaving `outstanding` products in flight), releases its slot (ring position it) and adds it,
    times its scales [64], to the float32 total."""
    done = warpgroup_mma_wait(num_outstanding=outstanding, deps=(part,))
    release(empty.index(it % STAGES))
    return gl.fma(done, scale[:, None], total)


@gluon.jit
def _consumer(a_smem, b_smem, c_smem, full, empty, c_desc, a_s_ptr, b_s_ptr, M, stride_as_k, stride_bs_n, num_m,
              num_n, num_kb, C: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Rows C * 64 ... of every tile this program owns: its K blocks' products, promoted by their scales into the
    float32 total, then the tile's store. Two K blocks a step: the first is promoted while the second's wgmma runs,
    and both have retired by the step's end (the other consumer's wgmmas fill the tensor cores meanwhile). A
    product still in flight across the loop's back edge is copied between registers there, and ptxas then
    serializes every wgmma (its C7514); four blocks a step ran out of registers (C7512)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    it = 0  # this program's K blocks so far: the ring position
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, num_m, num_n, GROUP_M)
        rows = off_m + C * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
        a_scales = a_s_ptr + gl.where(rows < M, rows, 0)
        b_scales = b_s_ptr + (off_n // 128) * stride_bs_n  # the tile lies in one weight block: one scale a K block
        total = gl.zeros([HALF, 128], gl.float32, layout)
        for kb in range(0, num_kb - 1, 2):
            first = _issue(a_smem, b_smem, full, it + kb, C, STAGES, layout)
            first_scale = gl.load(a_scales + kb * stride_as_k) * gl.load(b_scales + kb)
            second = _issue(a_smem, b_smem, full, it + kb + 1, C, STAGES, layout)
            second_scale = gl.load(a_scales + (kb + 1) * stride_as_k) * gl.load(b_scales + kb + 1)
            total = _promote(first, 1, first_scale, total, empty, it + kb, STAGES)
            total = _promote(second, 0, second_scale, total, empty, it + kb + 1, STAGES)
        if num_kb % 2 == 1:
            last = num_kb - 1
            part = _issue(a_smem, b_smem, full, it + last, C, STAGES, layout)
            scale = gl.load(a_scales + last * stride_as_k) * gl.load(b_scales + last)
            total = _promote(part, 0, scale, total, empty, it + last, STAGES)
        it += num_kb
        # The tile leaves through shared memory and one TMA store (clipped at M and N), so that the consumer goes on
        # to the next tile at once; the previous tile's store must have read the buffer before it is rewritten.
        tma.store_wait(0)
        c_smem.store(total.to(c_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma_store(c_desc, [off_m + C * HALF, off_n], c_smem)
    tma.store_wait(0)


@gluon.jit
def _gluon_fp8_gemm_kernel(a_desc, b_desc, c_desc, a_s_ptr, b_s_ptr, M, N, K, stride_as_k, stride_bs_n,
                           STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """C [M, N] = sum over K blocks kb of (A[:, kb] @ B[:, kb]^T) * a_s[m, kb] * b_s[n // 128, kb]; a_desc / b_desc:
    [64, 128] / [128, 128] e4m3 boxes of A [M, K] and B [N, K] (zero-filled past M and N). num_warps 4: consumer 0;
    consumer 1 and the producer are workers."""
    gl.static_assert(num_warps == 4, "consumer 0 runs the kernel's warps; consumer 1 and the producer are workers")
    num_m = gl.cdiv(M, 128)
    num_n = gl.cdiv(N, 128)
    num_kb = K // 128
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF, 128], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 128, 128], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, HALF, 128], c_desc.layout)  # a consumer's tile each
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, c_smem.index(0), full, empty, c_desc, a_s_ptr, b_s_ptr, M, stride_as_k,
                     stride_bs_n, num_m, num_n, num_kb, 0, STAGES, GROUP_M)),
        (_consumer, (a_smem, b_smem, c_smem.index(1), full, empty, c_desc, a_s_ptr, b_s_ptr, M, stride_as_k,
                     stride_bs_n, num_m, num_n, num_kb, 1, STAGES, GROUP_M)),
        (_producer, (a_desc, b_desc, a_smem, b_smem, full, empty, num_m, num_n, num_kb, STAGES, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))


def gluon_gemm_fits(a: torch.Tensor, b: torch.Tensor, block_shape: tuple[int, int],
                    capability: tuple[int, int] | None, multiprocessors: int) -> bool:
    """Should a [M, K] x b [N, K]^T run as the Gluon kernel: e4m3 operands that are TMA sources (K contiguous,
    rows 16-byte aligned), an output whose rows are too (N a multiple of 8, for 16- and 32-bit outputs alike),
    128 x 128 weight scale blocks, K a multiple of 128, M and K of at least GLUON_MIN_M and GLUON_MIN_K, its
    [128, 128] tiles in one wave over the `multiprocessors` or filling GLUON_MIN_WAVE_FILL of their waves, on sm90
    (wgmma; the interpreter, None, runs no Gluon)."""
    m, k = a.shape
    tiles = -(-m // BLOCK) * -(-b.shape[0] // BLOCK)
    waves = -(-tiles // multiprocessors)
    return (tuple(block_shape) == (BLOCK, BLOCK) and k % BLOCK == 0 and m >= GLUON_MIN_M and k >= GLUON_MIN_K
            and b.shape[0] % 8 == 0 and (waves == 1 or tiles >= GLUON_MIN_WAVE_FILL * waves * multiprocessors)
            and a.dtype == b.dtype == torch.float8_e4m3fn and tma_source(a) and tma_source(b)
            and capability is not None and capability[0] == 9)


def gluon_block_fp8_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                           out_dtype: torch.dtype, multiprocessors: int) -> torch.Tensor:
    """a [M, K] float8_e4m3fn with per-token-group scales a_scales [M, K/128] float32, column-major (stride (1, M)),
    times b [N, K] float8_e4m3fn with 128 x 128 block scales b_scales [ceil(N/128), K/128] float32 (unit stride
    along K), transposed: [M, N] in out_dtype (bf16, fp16 or fp32). `gluon_gemm_fits` checked the operands; one
    program a multiprocessor at most."""
    m, k = a.shape
    n = b.shape[0]
    if a_scales.stride(0) != 1 or b_scales.stride(1) != 1:
        raise ValueError(f"a_scales must be column-major and b_scales K-contiguous, got strides {a_scales.stride()} "
                         f"and {b_scales.stride()}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [64, BLOCK], gl.NVMMASharedLayout.get_default_for([64, BLOCK],
                                                                                               gl.float8e4nv))
    b_desc = TensorDescriptor.from_tensor(b, [BLOCK, BLOCK], gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK],
                                                                                                  gl.float8e4nv))
    c_desc = TensorDescriptor.from_tensor(c, [64, BLOCK], gl.NVMMASharedLayout.get_default_for([64, BLOCK],
                                                                                      OUT_ELEMENT[out_dtype]))
    tiles = -(-m // BLOCK) * -(-n // BLOCK)
    _gluon_fp8_gemm_kernel[(min(tiles, multiprocessors),)](
        a_desc, b_desc, c_desc, a_scales, b_scales, m, n, k, a_scales.stride(1), b_scales.stride(0),
        STAGES=STAGES[c.element_size()], GROUP_M=GROUP_M, num_warps=4,
    )
    return c
