"""Triton device functions that kernels of several plugins share (the block-FP8 GEMM's and the MoE's), and whether
they run interpreted. Imported lazily with those kernels, never at plugin load: `triton.jit` reads TRITON_INTERPRET
when it defines a function (see `plugserve.plugins.triton_support.triton_availability`)."""

from __future__ import annotations

import triton
import triton.language as tl

# Kernels defined in this process run in Triton's interpreter (TRITON_INTERPRET=1: the CPU tests). The interpreter
# computes tl.dot on bfloat16 operands wrongly and casts float32 to e4m3 without carrying a round-up into the
# exponent (124.9 becomes 64, not 128): interpreted launches widen bfloat16 tiles to float32 before tl.dot and round
# onto the e4m3 grid (`round_to_e4m3_grid`) or let torch cast, so that they give the compiled kernels' values.
INTERPRETED = triton.knobs.runtime.interpret


@triton.jit
def round_to_e4m3_grid(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32: e4m3
    steps are 2^(e-3) for 2^e <= |v| < 2^(e+1), and 2^-9 below 2^-6 (subnormals)."""
    power = (v.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2^floor(log2|v|)
    step = tl.maximum(power * 0.125, 0.001953125)
    magic = 8388608.0  # 2^23: adding it to a float32 below 2^22 rounds to an integer, ties to even
    units = (tl.math.div_rn(tl.abs(v), step) + magic) - magic
    return tl.where(v < 0, -units * step, units * step)


@triton.jit
def split_k_arrive(count_ptr):
    """Count this program in at count_ptr (int32) once every thread's slice of the split-K workspace is stored;
    returns the count before it: SPLIT_K - 1 for the last program, which then adds the slices (`split_k_sum`) and
    sets the count back to 0. The counts come from `plugserve.plugins.triton_support.split_k_arrivals`."""
    tl.debug_barrier()  # every thread's stores before one thread's release makes them visible to the last program
    return tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def split_k_sum(ptrs, stride_split, mask, SPLIT_K: tl.constexpr):
    """The float32 slices at ptrs + s * stride_split, s = 0 ... SPLIT_K - 1, added in split order (the result does
    not depend on which program arrived last)."""
    total = tl.zeros(ptrs.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        # .cg: from L2, where the other programs' slices are, never a stale line of this SM's L1.
        total += tl.load(ptrs + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
    return total
