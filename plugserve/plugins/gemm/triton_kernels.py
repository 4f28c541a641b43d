"""Triton kernels of the "triton" block-FP8 GEMM backend: per-token-group activation quantization and
the w8a8 block-scaled GEMM, with their launch wrappers.

Imported lazily (by `plugserve.plugins.gemm.triton` and the tuning script), never at plugin load:
`triton.jit` reads TRITON_INTERPRET when a kernel is defined, so on the CPU set TRITON_INTERPRET=1
before the first import. The kernels compile with triton 3.6 and run in the 3.9 interpreter.

Arguments that change with every batch (token, pair and split counts, and the strides that follow them) are
`do_not_specialize_on_alignment`: Triton would otherwise compile a variant for each count divisible by 16 and
one for the rest, the later inside a request after the warm-up. Their == 1 variants stay: M = 1 is decode at
batch 1.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from plugserve.core.layers.quant import FP8_DTYPE, FP8_MAX, SCALE_EPS, ceil_div
from plugserve.core.triton_pdl import launch_options, programmatic_prologue
from plugserve.core.triton_tiles import grouped_tile, split_k_arrivals, split_k_arrive, split_k_sum
from plugserve.plugins.triton_shared import INTERPRETED, round_to_e4m3_grid
from plugserve.plugins.triton_support import tma_source

# Groups one program of the quantization kernel handles (a [groups, group_size] tile).
MAX_GROUPS_PER_PROGRAM = 8
# Column-major scales padded so each column starts 16-byte aligned, as TMA loads need.
TMA_ALIGNMENT = 4  # float32 elements


@triton.jit(do_not_specialize_on_alignment=["stride_sg"])
def _per_token_group_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    num_groups,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    stride_sg,
    GROUP_SIZE: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    EPS: tl.constexpr,
    QMAX: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row, GROUPS_PER_PROGRAM consecutive groups of it: scale = max(amax, EPS) / QMAX and
    q = clamp(x / scale, -QMAX, QMAX) as e4m3, both divisions and the cast rounded to nearest like
    torch's on the CPU. ROUND_IN_FP32: round onto the e4m3 grid before the cast (see INTERPRETED).
    PDL: launched as a programmatic dependent (`plugserve.core.triton_pdl`)."""
    programmatic_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = cols < K  # also masks the groups past the last one
    x = tl.load(x_ptr + row * stride_xm + cols * stride_xk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, EPS), QMAX)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    if ROUND_IN_FP32:
        q = round_to_e4m3_grid(q)
    tl.store(q_ptr + row * stride_qm + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    column_major_scales: bool = False,
    tma_aligned_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32, float16 or bfloat16; any strides) -> (x_q [M, K] float8_e4m3fn contiguous,
    scales [M, ceil(K/group_size)] float32), matching `plugserve.core.layers.quant`'s quantizer.

    column_major_scales: the scales live in a [ceil(K/group_size), M] buffer and the result is its
    transposed view (stride (1, M)), so that the M scales of one group are contiguous.
    tma_aligned_scales (needs column_major_scales): that buffer's rows are padded to a multiple of 4
    elements (stride (1, round_up(M, 4))), the layout TMA-based GEMMs read."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if tma_aligned_scales and not column_major_scales:
        raise ValueError("tma_aligned_scales applies to column-major scales: pass column_major_scales=True")
    if group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two, got {group_size}")
    m, k = x.shape
    num_groups = ceil_div(k, group_size)
    x_q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        rows = ceil_div(m, TMA_ALIGNMENT) * TMA_ALIGNMENT if tma_aligned_scales else m
        scales = torch.empty((num_groups, rows), dtype=torch.float32, device=x.device)[:, :m].t()
    else:
        scales = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return x_q, scales
    groups_per_program = min(triton.next_power_of_2(num_groups), MAX_GROUPS_PER_PROGRAM)
    grid = (m, triton.cdiv(num_groups, groups_per_program))
    _per_token_group_quant_kernel[grid](
        x, x_q, scales, k, num_groups,
        x.stride(0), x.stride(1), x_q.stride(0), scales.stride(0), scales.stride(1),
        GROUP_SIZE=group_size, GROUPS_PER_PROGRAM=groups_per_program, EPS=SCALE_EPS, QMAX=FP8_MAX,
        ROUND_IN_FP32=INTERPRETED,
        **launch_options(x),
        num_warps=4 if groups_per_program * group_size >= 1024 else 2,
    )
    return x_q, scales


@triton.jit(do_not_specialize_on_alignment=["M", "stride_as_k"])
def _w8a8_block_fp8_matmul_kernel(
    a_ptr,
    b_ptr,
    a_desc,
    b_desc,
    c_ptr,
    partial_ptr,
    arrivals_ptr,
    a_s_ptr,
    b_s_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_ps,
    stride_cm,
    stride_cn,
    stride_as_m,
    stride_as_k,
    stride_bs_n,
    stride_bs_k,
    GROUP_N: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """C[M, N] = sum over K blocks kb of (A[:, kb] @ B[:, kb]^T) * a_s[m, kb] * b_s[n // GROUP_N, kb].

    BLOCK_SIZE_K is the scale group along K, so each K step uses one activation scale per row and
    one weight scale per column; each step's e4m3 product is scaled into a float32 accumulator by one FMA an
    element (the wgmma's product waits for it, so the promotion's cost adds to every K step's).
    SPLIT_K > 1: program (tile, s) sums the s-th of SPLIT_K runs of K blocks into the float32 slice
    partial[s] of a [SPLIT_K, M, N] workspace (stride_ps) and counts itself in arrivals[tile] (int32, zero
    between launches); the tile's last program to arrive adds the SPLIT_K slices into C, in split order (the
    same sum whichever program is last), and zeroes the count for the next launch.
    TMA: A and B tiles come as TMA boxes through the descriptors a_desc [BLOCK_SIZE_M, BLOCK_SIZE_K] and b_desc
    [BLOCK_SIZE_N, BLOCK_SIZE_K] (zero-filled past the edges) instead of cp.async through a_ptr / b_ptr.
    PDL: launched as a programmatic dependent of the activations' quantization (`plugserve.core.triton_pdl`)."""
    programmatic_prologue(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)

    num_kb = tl.cdiv(K, BLOCK_SIZE_K)
    kb_per_split = tl.cdiv(num_kb, SPLIT_K)
    first_kb = split * kb_per_split
    last_kb = tl.minimum(first_kb + kb_per_split, num_kb)

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    # Rows and columns past the edge wrap around: loads stay in bounds unmasked, the store drops them.
    rows = offs_m % M
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + (first_kb * BLOCK_SIZE_K + offs_k[None, :]) * stride_ak
    b_ptrs = b_ptr + cols[None, :] * stride_bn + (first_kb * BLOCK_SIZE_K + offs_k[:, None]) * stride_bk
    a_s_ptrs = a_s_ptr + rows * stride_as_m
    b_s_ptrs = b_s_ptr + (cols // GROUP_N) * stride_bs_n

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kb in range(first_kb, last_kb):
        if TMA:
            a = a_desc.load([pid_m * BLOCK_SIZE_M, kb * BLOCK_SIZE_K])
            b = tl.trans(b_desc.load([pid_n * BLOCK_SIZE_N, kb * BLOCK_SIZE_K]))
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kb * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_s = tl.load(a_s_ptrs + kb * stride_as_k)
        if GROUP_N % BLOCK_SIZE_N == 0:
            # The tile's columns lie in one weight block (columns past N wrap, and are not stored): one scale a
            # row, so promoting the block's product into the accumulator is one FMA an element.
            scale = a_s * tl.load(b_s_ptr + (pid_n * BLOCK_SIZE_N // GROUP_N) * stride_bs_n + kb * stride_bs_k)
            acc = tl.fma(tl.dot(a, b), scale[:, None], acc)
        else:
            b_s = tl.load(b_s_ptrs + kb * stride_bs_k)
            acc = tl.fma(tl.dot(a, b), a_s[:, None] * b_s[None, :], acc)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    tile = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(c_ptr + tile, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        tl.store(partial_ptr + split * stride_ps + tile, acc, mask=c_mask)
        if split_k_arrive(arrivals_ptr + pid) == SPLIT_K - 1:
            total = split_k_sum(partial_ptr + tile, stride_ps, c_mask, SPLIT_K)
            tl.store(c_ptr + tile, total.to(c_ptr.dtype.element_ty), mask=c_mask)
            tl.store(arrivals_ptr + pid, 0)


def w8a8_block_fp8_matmul(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    block_shape: tuple[int, int],
    out_dtype: torch.dtype,
    config: Mapping[str, int],
) -> torch.Tensor:
    """a [M, K] float8_e4m3fn with per-token-group scales a_scales [M, ceil(K/bk)] float32 (any
    strides; column-major reads best), times b [N, K] float8_e4m3fn with block scales b_scales
    [ceil(N/bn), ceil(K/bk)] float32, transposed: [M, N] in out_dtype, accumulated in float32.

    config: BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K (must equal bk), GROUP_SIZE_M, num_warps,
    num_stages, and optionally SPLIT_K (default 1): with few output tiles (small M), K is cut into
    SPLIT_K runs computed by separate programs into a float32 [SPLIT_K, M, N] workspace, summed by each tile's
    last program (no second kernel); TMA (default 0), see `_w8a8_block_fp8_matmul_kernel`: a speed hint, taken only
    where a and b can be TMA sources (`tma_source`), the same product through pointers otherwise."""
    m, k = a.shape
    n = b.shape[0]
    bn, bk = block_shape
    if b.shape[1] != k:
        raise ValueError(f"a is [{m}, {k}] but b is {list(b.shape)}: K differs")
    if tuple(a_scales.shape) != (m, ceil_div(k, bk)) or tuple(b_scales.shape) != (ceil_div(n, bn), ceil_div(k, bk)):
        raise ValueError(f"scales {tuple(a_scales.shape)} / {tuple(b_scales.shape)} do not fit a [{m}, {k}] x "
                         f"[{n}, {k}] product in {block_shape} blocks")
    if config["BLOCK_SIZE_K"] != bk:
        raise ValueError(f"BLOCK_SIZE_K must be the scale group {bk}, got {config['BLOCK_SIZE_K']}")
    split_k = config.get("SPLIT_K", 1)
    if split_k < 1:
        raise ValueError(f"SPLIT_K must be at least 1, got {split_k}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    tiles = triton.cdiv(m, config["BLOCK_SIZE_M"]) * triton.cdiv(n, config["BLOCK_SIZE_N"])
    partial = c if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=a.device)
    arrivals = partial if split_k == 1 else split_k_arrivals(a.device, tiles)
    tma = bool(config.get("TMA", 0)) and tma_source(a) and tma_source(b)
    a_desc = TensorDescriptor.from_tensor(a, [config["BLOCK_SIZE_M"], bk]) if tma else None
    b_desc = TensorDescriptor.from_tensor(b, [config["BLOCK_SIZE_N"], bk]) if tma else None
    _w8a8_block_fp8_matmul_kernel[(tiles, split_k)](
        a, b, a_desc, b_desc, c, partial, arrivals, a_scales, b_scales, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        partial.stride(0) if split_k > 1 else 0, c.stride(0), c.stride(1),
        a_scales.stride(0), a_scales.stride(1), b_scales.stride(0), b_scales.stride(1),
        GROUP_N=bn,
        BLOCK_SIZE_M=config["BLOCK_SIZE_M"],
        BLOCK_SIZE_N=config["BLOCK_SIZE_N"],
        BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=config["GROUP_SIZE_M"],
        SPLIT_K=split_k,
        EVEN_K=k % bk == 0,
        TMA=tma,
        **launch_options(a),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return c
