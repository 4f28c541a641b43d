"""DeepGEMM's fp8_gemm_nt, the library behind the deepgemm GEMM backend, called directly on the inputs that
backend gets, so that the shootout can measure what plugserve's wrapper costs. GPU (sm90) only; run with
LD_PRELOAD of libstdc++ where plugserve.plugins.deepgemm_support says so."""

from __future__ import annotations

from collections.abc import Callable

import deep_gemm
import torch

from plugserve.plugins.gemm import triton_kernels


def gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x [M, K] bf16, w_q [N, K] float8_e4m3fn, w_scale [ceil(N/128), ceil(K/128)] float32 -> a callable
    returning [M, N] bf16: Triton per-token-group quantization with MN-major, TMA-aligned scales (the
    layout DeepGEMM reads without copying), then fp8_gemm_nt into a fresh output. N a multiple of 8 and K
    of 128 (all the shootout's shapes); the weight scales are made contiguous here, once."""
    w_scale = w_scale.contiguous()

    def call() -> torch.Tensor:
        x_q, x_scales = triton_kernels.per_token_group_quant_fp8(x, 128, column_major_scales=True,
                                                                 tma_aligned_scales=True)
        out = torch.empty((x.shape[0], w_q.shape[0]), dtype=torch.bfloat16, device=x.device)
        deep_gemm.fp8_gemm_nt((x_q, x_scales), (w_q, w_scale), out)
        return out

    return call
