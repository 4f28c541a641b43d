"""Triton device functions that kernels of several plugins share (the block-FP8 GEMM's and the MoE's), and whether
they run interpreted; split-K's are in `plugserve.core.triton_tiles`, which the core's dense matmul shares. Imported
lazily with those kernels, never at plugin load: `triton.jit` reads TRITON_INTERPRET when it defines a function (see
`plugserve.plugins.triton_support.triton_availability`)."""

from __future__ import annotations

import triton
import triton.language as tl

from plugserve.core.moved import moved_names

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


__getattr__ = moved_names(__name__)
