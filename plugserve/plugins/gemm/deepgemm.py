"""The "deepgemm" block-FP8 GEMM: DeepGEMM's `fp8_gemm_nt` (its sm90 1D2D kernel: float32 scales per
1 x 128 activation group and per 128 x 128 weight block, bf16 output), with activations quantized by
plugserve's Triton per-token-group kernel. Needs DeepGEMM v2.6+ on an sm90 GPU and, where the machine's
libstdc++ setup calls for it, LD_PRELOAD of libstdc++ (see plugserve.plugins.deepgemm_support).

What DeepGEMM asks of the operands, and where it is done:
- weight [N, K] e4m3 K-major with its float32 scales [ceil(N/128), ceil(K/128)], contiguous (sm90 reads
  them as they are): `prepare` copies them to the device once, padding the weight with zero rows to N a
  multiple of 8 (its epilogue stores 16-byte rows) and zero columns to K a multiple of 128 (whole K
  blocks; zero columns add nothing). Neither changes the scale grid; DeepSeek's shapes need neither.
- activation scales [M, ceil(K/128)] MN-major and TMA-aligned (strides (1, round_up(M, 4))): the quantizer
  writes them so, and DeepGEMM then uses them without its own transposing copy.
- output [M, N] bf16, allocated per call.

Every kernel compiles on its first use per shape (2-5 s, cached on disk in ~/.deep_gemm): warm a shape up
before capturing it in a CUDA graph. `apply` does no host synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import Availability, Fp8GemmBackend, GemmCapabilities
from plugserve.core.layers.quant import ceil_div
from plugserve.core.specs import GemmSpec
from plugserve.plugins.deepgemm_support import deepgemm_availability, import_deep_gemm
from plugserve.plugins.triton_support import triton_availability
from plugserve.registry import hookimpl

BLOCK = 128
N_MULTIPLE = 8  # bf16 output rows of whole 16-byte units


def padded_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [round_up(N, 8), round_up(K, 128)] with zeros appended (the same tensor when
    nothing is missing). The scale grid [ceil(N/128), ceil(K/128)] fits both."""
    n, k = weight.shape
    n_pad, k_pad = ceil_div(n, N_MULTIPLE) * N_MULTIPLE, ceil_div(k, BLOCK) * BLOCK
    if (n_pad, k_pad) == (n, k):
        return weight
    padded = torch.zeros((n_pad, k_pad), dtype=weight.dtype, device=weight.device)
    padded[:n, :k] = weight
    return padded


@dataclass(frozen=True)
class DeepGemmFp8Weight:
    """weight [N', K'] float8_e4m3fn (N, K padded, see `padded_weight`) and weight_scale_inv
    [ceil(N/128), ceil(K/128)] float32, contiguous on the device; n, k: the layer's own sizes."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    n: int
    k: int


class DeepGemmFp8Gemm(Fp8GemmBackend):
    name: ClassVar[str] = "deepgemm"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        dtypes=frozenset({torch.bfloat16}),  # the sm90 kernel writes bf16 only
        devices=frozenset({"cuda"}),
        min_capability=(9, 0),
        max_capability=(9, 0),
        block_shapes=frozenset({(BLOCK, BLOCK)}),
        cuda_graph=True,  # DeepGEMM decides by shapes alone; warm each M up before capture (its JIT)
        batch_invariant_note="DeepGEMM picks its block sizes by M",
    )
    # The fastest block-FP8 GEMM measured on Hopper (device README); a shootout table overrides this.
    priority: ClassVar[dict[str, int]] = {"sm90": 60}

    def __init__(self, spec: GemmSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.deep_gemm: ModuleType = import_deep_gemm()

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = deepgemm_availability(hardware, super().availability(hardware))
        return triton_availability(hardware) if available else available

    def prepare(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> DeepGemmFp8Weight:
        """weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/128), ceil(K/128)] float32 -> on the device,
        the weight padded as `padded_weight` says, both contiguous."""
        self.check_weight(weight, weight_scale_inv)
        n, k = weight.shape
        return DeepGemmFp8Weight(
            padded_weight(weight.to(self.device)).contiguous(), weight_scale_inv.to(self.device).contiguous(), n, k
        )

    def apply(self, x: torch.Tensor, packed: DeepGemmFp8Weight) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16: x quantized per 1 x 128 group with MN-major, TMA-aligned scales,
        then `fp8_gemm_nt`. x is padded along K (a copy) only when K is not a multiple of 128."""
        from plugserve.plugins.gemm import triton_kernels

        if x.dim() != 2 or x.shape[1] != packed.k or x.dtype != self.spec.dtype:
            raise ValueError(f"x must be [M, {packed.k}] of dtype {self.spec.dtype}, "
                             f"got shape {tuple(x.shape)} of dtype {x.dtype}")
        n_pad, k_pad = packed.weight.shape
        if k_pad != packed.k:
            x = F.pad(x, (0, k_pad - packed.k))
        x_q, x_scales = triton_kernels.per_token_group_quant_fp8(
            x, BLOCK, column_major_scales=True, tma_aligned_scales=True
        )
        out = torch.empty((x.shape[0], n_pad), dtype=torch.bfloat16, device=x.device)
        self.deep_gemm.fp8_gemm_nt((x_q, x_scales), (packed.weight, packed.weight_scale_inv), out)
        return out if n_pad == packed.n else out[:, : packed.n].contiguous()

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32 row-major)."""
        from plugserve.plugins.gemm import triton_kernels

        return triton_kernels.per_token_group_quant_fp8(x, self.spec.block_shape[1])


@hookimpl
def plugserve_backends() -> list[type[Fp8GemmBackend]]:
    return [DeepGemmFp8Gemm]
