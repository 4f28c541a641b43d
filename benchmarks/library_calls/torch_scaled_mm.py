"""torch's block-wise scaled_mm, the library behind the torch_scaled_mm backend, called directly on the
inputs that backend gets, so that the shootout can measure what plugserve's wrapper costs. GPU only."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from plugserve.plugins.gemm import triton_kernels


def gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x [M, K] bf16, w_q [N, K] float8_e4m3fn, w_scale [ceil(N/128), ceil(K/128)] float32 -> a callable
    returning [M, N] bf16: Triton per-token-group quantization with M-major scales, then F.scaled_mm
    (1x128 x 128x128). cuBLASLt's own shape rules apply: M a multiple of 4, N of 16, K of 128 (all the
    shootout's shapes); the weight-scale layout is made here, once, outside the callable."""
    kb = w_scale.shape[1]
    scale_b = torch.zeros((w_scale.shape[0], -(-kb // 4) * 4), dtype=torch.float32, device=w_scale.device)
    scale_b[:, :kb] = w_scale
    w_t, scale_b = w_q.t(), scale_b.t()  # [K, N] column-major; [round_up(Kb, 4), Nb] with strides (1, round_up)

    def call() -> torch.Tensor:
        x_q, x_scales = triton_kernels.per_token_group_quant_fp8(x, 128, column_major_scales=True)
        return F.scaled_mm(x_q, w_t, x_scales, F.ScalingType.BlockWise1x128, scale_b, F.ScalingType.BlockWise128x128,
                           output_dtype=torch.bfloat16)

    return call
