"""The torch reference block-FP8 GEMM: plain and obviously correct, itself checked against the kit's
float64 oracle (plugserve/conformance/oracle.py). Runs on the CPU and on CUDA.

Weights are e4m3 in `block_shape` (bn, bk) blocks with one float32 scale each; activations are
quantized per 1 x bk token group. e4m3 matmuls do not exist on the CPU, so the reference
dequantizes both operands to float32 and multiplies there; the quantization itself is what a
w8a8 kernel does, so only the accumulation order differs from one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from plugserve.core.batch_invariant import batch_invariant
from plugserve.core.interfaces import Fp8GemmBackend, GemmCapabilities
from plugserve.core.layers.quant import dequantize_block_fp8, per_token_group_quant_fp8
from plugserve.registry import hookimpl


def block_fp8_matmul(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_shape: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_q [M, K] e4m3 with per-token-group scales [M, ceil(K/bk)] float32, times w_q [N, K] e4m3
    with block scales [ceil(N/bn), ceil(K/bk)] float32, transposed: [M, N] in out_dtype, computed
    in float32 on the dequantized operands."""
    return _times_dequantized(x_q, x_scales, dequantize_block_fp8(w_q, w_scale_inv, block_shape), block_shape[1],
                              out_dtype)


def _times_dequantized(x_q: torch.Tensor, x_scales: torch.Tensor, w: torch.Tensor, group_size: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """x_q [M, K] e4m3 with scales [M, ceil(K/group_size)] float32, dequantized, times w [N, K] float32,
    transposed: [M, N] in out_dtype."""
    return (dequantize_block_fp8(x_q, x_scales, (1, group_size)) @ w.T).to(out_dtype)


@dataclass(frozen=True)
class TorchRefFp8Weight:
    """w [N, K] float32: the block-FP8 weight dequantized once at prepare (what block_fp8_matmul would dequantize
    on every call)."""

    w: torch.Tensor


class TorchRefFp8Gemm(Fp8GemmBackend):
    name: ClassVar[str] = "torch_ref"
    verified: ClassVar[str] = "cpu"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        devices=frozenset({"cpu", "cuda"}),
        cuda_graph=True,  # torch ops sized by shapes alone
        batch_invariant=True,  # matmuls in fixed row blocks (core/batch_invariant.py) under the spec's flag
    )
    priority: ClassVar[dict[str, int]] = {"default": 0}

    def prepare(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> TorchRefFp8Weight:
        """weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32, dequantized on this
        backend's device."""
        self.check_weight(weight, weight_scale_inv)
        return TorchRefFp8Weight(dequantize_block_fp8(weight.to(self.device), weight_scale_inv.to(self.device),
                                                      self.spec.block_shape))

    def apply(self, x: torch.Tensor, packed: TorchRefFp8Weight) -> torch.Tensor:
        """x [M, K] of spec.dtype -> [M, N] of spec.dtype."""
        k = packed.w.shape[1]
        if x.dim() != 2 or x.shape[1] != k or x.dtype != self.spec.dtype:
            raise ValueError(f"x must be [M, {k}] of dtype {self.spec.dtype}, "
                             f"got shape {tuple(x.shape)} of dtype {x.dtype}")
        x_q, x_scales = self.quantize_activation(x)
        with batch_invariant(self.spec.batch_invariant):
            return _times_dequantized(x_q, x_scales, packed.w, self.spec.block_shape[1], self.spec.dtype)

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K/bk)] float32)."""
        return per_token_group_quant_fp8(x, self.spec.block_shape[1])


@hookimpl
def plugserve_backends() -> list[type[Fp8GemmBackend]]:
    return [TorchRefFp8Gemm]
