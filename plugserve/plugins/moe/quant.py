"""Per-token-group FP8 quantization of the MoE's activations (x before the w13 pass, h before the w2 pass) as a
Triton kernel, bit for bit the reference quantizer. Imported lazily, with the other kernels of the `triton` MoE
backend."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugserve.core.layers.quant import FP8_DTYPE, FP8_MAX, SCALE_EPS
from plugserve.core.triton_pdl import launch_options, programmatic_prologue
from plugserve.plugins.triton_shared import INTERPRETED

_QUANT_GROUPS = 8  # 1 x group_size groups per program


@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, scale_ptr, cols, num_groups, stride_x, stride_q, stride_scale,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
    PDL: tl.constexpr,
):
    """GROUPS 1 x GROUP groups of one row: scale = max(amax, EPS) / FP8_MAX, q = clamp(x / scale),
    with correctly rounded divisions, as the reference quantizer computes them."""
    programmatic_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = col < cols
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), EPS), FP8_MAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_q + col, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_scale + group, scale, mask=group < num_groups)


def per_token_group_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K/group_size)] float32), bit for
    bit `quant.per_token_group_quant_fp8` (both divide with correct rounding: a reciprocal multiply, one
    ulp off for about half the scales, flips the fp8 rounding of ties, frequent in 16-bit inputs)."""
    x = x.contiguous()
    rows, cols = x.shape
    num_groups = triton.cdiv(cols, group_size)
    # Interpreted, the kernel stores float32 and torch casts (the interpreter's own e4m3 cast rounds wrongly).
    q = torch.empty(rows, cols, dtype=torch.float32 if INTERPRETED else FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if rows:
        groups = min(_QUANT_GROUPS, triton.next_power_of_2(num_groups))
        _group_quant_kernel[(rows, triton.cdiv(num_groups, groups))](
            x, q, scales, cols, num_groups, x.stride(0), q.stride(0), scales.stride(0),
            GROUP=group_size, GROUPS=groups, FP8_MAX=FP8_MAX, EPS=SCALE_EPS, **launch_options(x),
        )
    return q.to(FP8_DTYPE), scales
