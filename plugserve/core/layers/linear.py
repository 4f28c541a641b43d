"""Linear layers without bias, in the model dtype or block-FP8 (run by the selected GEMM backend).

A layer may be the concatenation of several checkpoint tensors along the output dim ("shards":
q_a_proj ++ kv_a_proj_with_mqa, gate_proj ++ up_proj) loaded one by one. A block-FP8 layer takes
e4m3 shards with their `weight_scale_inv`, or float shards that it quantizes once all are loaded
(--quantization fp8); `finalize` hands the weight to the GEMM backend's own packed form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.core.interfaces import Fp8GemmBackend
from plugserve.core.layers.quant import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8, scale_grid


class WeightLoadError(ValueError):
    """A checkpoint tensor does not fit the parameter it is loaded into; the message names it."""


class Linear(nn.Module):
    """y = x W^T with W [out_features, in_features].

    Model dtype: `weight` [N, K]. Block-FP8 (`fp8_block` = (bn, bk)): `weight` [N, K] float8_e4m3fn and
    `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32, dequantized W = weight * scale of its block.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.dtype = dtype
        self.fp8_block = fp8_block
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=FP8_DTYPE if fp8_block else dtype, device=device),
            requires_grad=False,
        )
        if fp8_block:
            grid = scale_grid(self.out_features, in_features, fp8_block)
            self.weight_scale_inv = nn.Parameter(torch.empty(grid, dtype=torch.float32, device=device),
                                                 requires_grad=False)
        self._staging: torch.Tensor | None = None  # float shards awaiting quantization
        self._gemm: Fp8GemmBackend | None = None
        self._packed: Any = None

    def checkpoint_shape(self, shard: int) -> tuple[int, int]:
        """Shape of the checkpoint tensor of `shard`: [output_sizes[shard], in_features] here; the whole
        tensor, of which they hold a slice, in the tensor-parallel subclasses."""
        return self.output_sizes[shard], self.in_features

    def load_shard(self, shard: int, name: str, weight: torch.Tensor, scale_inv: torch.Tensor | None = None) -> None:
        """Copy checkpoint tensor `name` ([output_sizes[shard], in_features], with its block scales when it is
        e4m3) into its rows of this layer."""
        start = sum(self.output_sizes[:shard])
        rows = self.output_sizes[shard]
        if tuple(weight.shape) != (rows, self.in_features):
            raise WeightLoadError(f"{name}: shape {tuple(weight.shape)} does not match the model's "
                                  f"{(rows, self.in_features)}")
        is_fp8 = weight.dtype == FP8_DTYPE
        if scale_inv is not None and not is_fp8:
            raise WeightLoadError(f"{name} is {weight.dtype} but the checkpoint also has {name}_scale_inv")
        if is_fp8:
            if self.fp8_block is None:
                raise WeightLoadError(f"{name} is float8_e4m3fn but the model's config has no FP8 quantization_config")
            if scale_inv is None:
                raise WeightLoadError(f"{name} is float8_e4m3fn but the checkpoint has no {name}_scale_inv")
            grid = scale_grid(rows, self.in_features, self.fp8_block)
            if tuple(scale_inv.shape) != grid:
                raise WeightLoadError(f"{name}_scale_inv: shape {tuple(scale_inv.shape)} does not match the "
                                      f"{grid} blocks of {self.fp8_block} for a {tuple(weight.shape)} weight")
        if self.fp8_block is None:
            self.weight.data[start : start + rows].copy_(weight)
        elif self._shards_block_aligned():
            # Every shard owns whole rows of scale blocks: store (or quantize) it on its own.
            if not is_fp8:
                weight, scale_inv = quantize_block_fp8(weight, self.fp8_block)
            first = start // self.fp8_block[0]
            self.weight.data[start : start + rows].copy_(weight)
            self.weight_scale_inv.data[first : first + scale_inv.shape[0]].copy_(scale_inv)
        else:
            # Shards share scale blocks: gather the layer in float32, quantize it whole in finalize.
            if self._staging is None:
                self._staging = torch.zeros(self.out_features, self.in_features, dtype=torch.float32,
                                            device=self.weight.device)
            floats = dequantize_block_fp8(weight, scale_inv, self.fp8_block) if is_fp8 else weight
            self._staging[start : start + rows].copy_(floats)

    def _shards_block_aligned(self) -> bool:
        starts = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        return self.fp8_block is not None and all(s % self.fp8_block[0] == 0 for s in starts)

    def finalize(self, gemm: Fp8GemmBackend | None) -> None:
        """After loading: quantize staged float shards, and let `gemm` pack FP8 weights (None: the weights
        are handed elsewhere, e.g. experts stacked for the MoE backend)."""
        if self.fp8_block is None:
            return
        if self._staging is not None:
            weight, scale_inv = quantize_block_fp8(self._staging, self.fp8_block)
            self.weight.data.copy_(weight)
            self.weight_scale_inv.data.copy_(scale_inv)
            self._staging = None
        if gemm is not None:
            self._gemm = gemm
            self._packed = gemm.prepare(self.weight.data, self.weight_scale_inv.data)

    def dequantized_weight(self) -> torch.Tensor:
        """W [N, K] in the model dtype (for layers used as batched matmuls, like W_UK / W_UV)."""
        if self.fp8_block is None:
            return self.weight.data
        return dequantize_block_fp8(self.weight.data, self.weight_scale_inv.data, self.fp8_block).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in the model dtype."""
        if self.fp8_block is None:
            return F.linear(x, self.weight)
        if self._gemm is None:
            raise RuntimeError("block-FP8 Linear used before finalize()")
        return self._gemm.apply(x.reshape(-1, self.in_features), self._packed).view(*x.shape[:-1], -1)

