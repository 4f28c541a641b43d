"""Batch-invariant matmuls as one Triton kernel: `BatchInvariantMode`'s mm / addmm / bmm / baddbmm on CUDA.

Every call, whatever M (and whatever the number of batch entries), launches the same kernel with the same tile
(`BLOCK_M` x `BLOCK_N` output, K in steps of `BLOCK_K` from k = 0 up, float32 accumulation) and the same split of K
(`num_splits`: from the weight's shape and the GPU's SM count, never from M), so each output element is the same
sequence of MMA steps over its own row of A and column of B, and the same float32 sum of its splits in split order:
a row's bits do not depend on how many rows share the call or where in a tile it sits. On CUDA that replaces the
row-at-a-time product (M GEMVs, each re-reading the weight) by one weight read per row tile; the split gives a
decode batch's few column tiles enough programs to fill the GPU.

Imported lazily, by `batch_invariant` on the first CUDA matmul and by tests: importing plugserve.core must not import
triton, and `triton.jit` decides when a kernel is defined whether it compiles for the GPU or runs in the interpreter
(TRITON_INTERPRET=1, the CPU tests). Only plain tl.load / tl.dot / tl.store and tl.atomic_add (split-K's arrival
count, as the FP8 GEMM's), so that it compiles with triton 3.6.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from plugserve.core.hardware import Hardware
from plugserve.core.triton_tiles import grouped_tile, split_k_arrivals, split_k_arrive, split_k_sum

# The one tile of every call (invariance needs it fixed at every M; none of it is chosen by shape). 16 rows: a decode
# batch is a few rows, and a 64-row tile mostly masked cost more at batch 1 and 64 alike (docs/kernels.md). 64 columns,
# not 128: a decode batch's projections have few column tiles, which (times the splits of K) are the parallelism.
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 128  # a decode step streams the weight: each pipeline stage brings 16 KB of it (bf16)
NUM_WARPS = 4
NUM_STAGES = 4  # for 16-bit operands; float32 ones (twice the shared memory a stage) take 2
# Row tiles that sweep the column tiles together (programs in a group share B's tiles in L2): only which program
# computes which tile, never a tile's sums.
GROUP_M = 8
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
MIN_SPLIT_STEPS = 2  # K steps a split keeps at least: each split adds a float32 tile's store and load to its steps
# The float32 partial sums of a split call: rows go through in slices that keep them within this many elements (one
# row tile of every entry at least); a row's result does not depend on its slice.
WORKSPACE_ELEMENTS = 1 << 24


@triton.jit(do_not_specialize=["M"],
            do_not_specialize_on_alignment=["stride_ab", "stride_biasb", "stride_cb", "stride_ps", "stride_pb"])
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, partial_ptr, arrivals_ptr, M, N, K, K_SPLIT,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    stride_biasb, stride_biasm, stride_biasn, stride_cb, stride_cm, stride_cn, stride_ps, stride_pb,
    alpha, beta,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Program (tile, e, s): c[e, m-block, n-block] = alpha * (a[e] @ b[e]) (+ beta * bias[e], float32, before the one
    rounding to c's dtype) for batch entry e, over K's split s: k in [s * K_SPLIT, (s + 1) * K_SPLIT) (K_SPLIT a
    multiple of BLOCK_K). SPLIT_K > 1: each split's float32 sum goes to partial[s, e] (a contiguous [SPLIT_K, E, M, N]
    workspace, strides stride_ps, stride_pb, N, 1) and the program counts itself in arrivals[e * tiles + tile] (int32,
    zero between launches); the tile's last program to arrive adds the slices in split order (the same sum whichever
    arrives last) and finishes the tile. Rows past M are masked (not loaded: a decode batch's tile is mostly
    past M, and only B's bytes should stream); columns past N wrap around (n % N), in bounds unmasked, and the store
    drops them; K's last step is masked unless EVEN_K. M is not specialized
    (one compiled kernel for every batch size, 1 included); int64 row and column offsets (an LM head's output passes
    2^31 elements)."""
    pid = tl.program_id(0)
    entry = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = (offs_m < M)[:, None]
    cols = offs_n % N
    first_k = split * K_SPLIT
    offs_k = tl.arange(0, BLOCK_K)
    k_rows = first_k.to(tl.int64) + offs_k
    a_ptrs = a_ptr + entry * stride_ab + offs_m[:, None] * stride_am + k_rows[None, :] * stride_ak
    b_ptrs = b_ptr + entry * stride_bb + k_rows[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(first_k, tl.minimum(first_k + K_SPLIT, K), BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok, other=0.0)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=row_ok & (offs_k[None, :] < K - k0), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_mask = row_ok & (offs_n < N)[None, :]
    if SPLIT_K > 1:
        part = partial_ptr + entry * stride_pb + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + split * stride_ps, acc, mask=c_mask)
        count = arrivals_ptr + entry * tl.num_programs(0) + pid
        if split_k_arrive(count) < SPLIT_K - 1:
            return
        acc = split_k_sum(part, stride_ps, c_mask, SPLIT_K)
        tl.store(count, 0)
    acc = acc * alpha
    if HAS_BIAS:
        bias = tl.load(bias_ptr + entry * stride_biasb + offs_m[:, None] * stride_biasm + cols[None, :] * stride_biasn,
                       mask=row_ok, other=0.0)
        acc += bias.to(tl.float32) * beta
    c_ptrs = c_ptr + entry * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def num_splits(n: int, k: int, multiprocessors: int) -> int:
    """How many splits of K a product with an [K, N] weight takes on a GPU of `multiprocessors` SMs: the fewest (a
    power of two) that make the column tiles times the splits fill the SMs, at most as many as leave every split
    MIN_SPLIT_STEPS K steps. From the weight's shape and the GPU alone (never M): a row's sums must not change with
    the batch. At one row a product runs as many programs as column tiles times splits, each streaming its share of
    the weight: without splits a narrow weight's few programs leave most SMs idle."""
    most = max(1, k // (MIN_SPLIT_STEPS * BLOCK_K))
    splits = 1
    while 2 * splits <= most and triton.cdiv(n, BLOCK_N) * splits < multiprocessors:
        splits *= 2
    return splits


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The SM count of a CUDA device (`Hardware.detect`), asked once: every call's split count needs it."""
    return Hardware.detect(device).multiprocessors


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: one dtype of `DTYPES` (aten's matmuls take no mixed dtypes)."""
    return all(t.dtype == tensors[0].dtype for t in tensors) and tensors[0].dtype in DTYPES


def bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, beta: float = 1.0,
        alpha: float = 1.0, splits: int | None = None) -> torch.Tensor:
    """aten.bmm / baddbmm: a [E, M, K] @ b [E, K, N] -> [E, M, N] (a new contiguous tensor in their dtype), as
    beta * bias + alpha * (a @ b) with bias (broadcast to [E, M, N]) when given and beta != 0 (beta == 0 ignores
    bias, NaNs included, as torch does). Any strides (a transposed weight view included); float32 operands are
    multiplied exactly (no TF32), as torch's default. K in `splits` runs of whole K steps (fewer where a run would be
    empty): by default `num_splits` of the weight's shape and the GPU on CUDA, 1 elsewhere; a test forces others.
    Allocates the output and, split, a float32 workspace of at most about WORKSPACE_ELEMENTS (rows in slices):
    fine in a CUDA graph."""
    e, m, k = a.shape
    n = b.shape[2]
    if b.shape[0] != e or b.shape[1] != k:
        raise ValueError(f"bmm of {tuple(a.shape)} and {tuple(b.shape)}: shapes do not chain")
    if not supports(a, b, *([bias] if bias is not None else [])):
        raise ValueError(f"the batch-invariant matmul takes one dtype of {sorted(map(str, DTYPES))}, got "
                         f"{[str(t.dtype) for t in (a, b, bias) if t is not None]}")
    if splits is None:
        splits = num_splits(n, k, _multiprocessors(a.device)) if a.device.type == "cuda" else 1
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    out = torch.empty((e, m, n), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    has_bias = bias is not None and beta != 0
    bias = bias.expand(e, m, n) if has_bias else out  # `out` unread without a bias
    steps_per_split = triton.cdiv(max(1, triton.cdiv(k, BLOCK_K)), splits)
    splits = triton.cdiv(max(1, triton.cdiv(k, BLOCK_K)), steps_per_split)
    rows = m if splits == 1 else max(BLOCK_M, WORKSPACE_ELEMENTS // (splits * e * n) // BLOCK_M * BLOCK_M)
    for first in range(0, m, rows):
        a_rows, bias_rows, out_rows = (t[:, first : first + rows] for t in (a, bias, out))
        count = a_rows.shape[1]
        tiles = triton.cdiv(count, BLOCK_M) * triton.cdiv(n, BLOCK_N)
        partial = torch.empty((splits, e, count, n), dtype=torch.float32, device=a.device) if splits > 1 else out
        arrivals = split_k_arrivals(a.device, e * tiles) if splits > 1 else out
        _matmul_kernel[(tiles, e, splits)](
            a_rows, b, bias_rows, out_rows, partial, arrivals, count, n, k, steps_per_split * BLOCK_K,
            a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
            bias.stride(0), bias.stride(1), bias.stride(2), out.stride(0), out.stride(1), out.stride(2),
            partial.stride(0), partial.stride(1), float(alpha), float(beta),
            HAS_BIAS=has_bias, EVEN_K=k % BLOCK_K == 0, INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            SPLIT_K=splits, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, num_warps=NUM_WARPS,
            num_stages=2 if a.dtype == torch.float32 else NUM_STAGES,
        )
    return out


def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, beta: float = 1.0,
       alpha: float = 1.0, splits: int | None = None) -> torch.Tensor:
    """aten.mm / addmm: a [M, K] @ b [K, N] -> [M, N], bias broadcast to [M, N]; `bmm` with one batch entry."""
    bias3 = bias.expand(a.shape[0], b.shape[1]).unsqueeze(0) if bias is not None else None
    return bmm(a.unsqueeze(0), b.unsqueeze(0), bias3, beta, alpha, splits)[0]
