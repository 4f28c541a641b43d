"""The "torch_scaled_mm" block-FP8 GEMM: torch's own block-wise `torch.nn.functional.scaled_mm`
(cuBLASLt's DeepSeek recipe: 1 x 128 activation groups, 128 x 128 weight blocks, float32 scales),
with activations quantized by plugserve's Triton per-token-group kernel. Nothing to install beyond
torch >= 2.10 built with CUDA >= 12.9, on an sm90 GPU: torch refuses the recipe on any other arch
("DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90").

What cuBLASLt asks of the operands, and what this backend does about it:
- weight [N, K] e4m3 with N and K multiples of 16: `prepare` pads N to 16 and K to 128 with zeros (a
  no-op for DeepSeek's shapes), so the scale grid [ceil(N/128), ceil(K/128)] keeps its shape;
- weight scales as a [round_up(K/128, 4), N/128] view whose K-block stride is 1 and N-block stride
  round_up(K/128, 4): `prepare` copies them into that layout once;
- activation scales [M, K/128] M-major (strides (1, M)): the quantizer writes them column-major; M is
  padded to a multiple of 4 (M = 1 is refused outright) and K to the weight's padded K, by a copy of
  x only when M % 4 or K % 128 is not 0; the output is cut back to [M, N].
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, Availability, Fp8GemmBackend, GemmCapabilities
from plugserve.core.layers.quant import ceil_div
from plugserve.plugins.triton_support import triton_availability
from plugserve.registry import hookimpl

BLOCK = 128
# cuBLASLt reads scale columns and fp8 rows in 16-byte units.
SCALE_ALIGN = 4  # float32 elements
ROW_ALIGN = 16  # e4m3 elements: N of the weight (torch checks it)
MIN_CUDA = (12, 9)  # cuBLASLt gained 1x128 / 128x128 block scaling in 12.9


def round_up(x: int, multiple: int) -> int:
    return ceil_div(x, multiple) * multiple


def scaled_mm_support(
    functional: ModuleType = F, torch_version: str = torch.__version__, cuda_version: str | None = torch.version.cuda
) -> Availability:
    """OK when this torch has block-wise `scaled_mm` and a CUDA build whose cuBLASLt runs it."""
    scaling = getattr(functional, "ScalingType", None)
    if not hasattr(functional, "scaled_mm") or not all(
        hasattr(scaling, recipe) for recipe in ("BlockWise1x128", "BlockWise128x128")
    ):
        return Availability.no(f"torch {torch_version} has no torch.nn.functional.scaled_mm with ScalingType."
                               "BlockWise1x128 / BlockWise128x128 (added in torch 2.10): pip install -U torch")
    if cuda_version is None:
        return Availability.no(f"torch {torch_version} is built without CUDA")
    if tuple(int(part) for part in cuda_version.split(".")[:2]) < MIN_CUDA:
        return Availability.no(f"block-wise scaled_mm needs cuBLASLt 12.9 or newer; torch {torch_version} is "
                               f"built with CUDA {cuda_version}")
    return OK


def pad_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [round_up(N, 16), round_up(K, 128)] with zero rows and columns appended
    (the same tensor when nothing is missing). Zero columns add nothing to any dot product; zero rows
    give output columns that are cut off."""
    n, k = weight.shape
    pad_n, pad_k = round_up(n, ROW_ALIGN) - n, round_up(k, BLOCK) - k
    if not pad_n and not pad_k:
        return weight
    padded = torch.zeros((n + pad_n, k + pad_k), dtype=weight.dtype, device=weight.device)
    padded[:n, :k] = weight
    return padded


def weight_scale_operand(weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """[Nb, Kb] float32 -> the [round_up(Kb, 4), Nb] view cuBLASLt reads for 128 x 128 blocks (strides
    (1, round_up(Kb, 4))): each weight block row's Kb scales, padded with zeros to 16 bytes."""
    nb, kb = weight_scale_inv.shape
    padded = torch.zeros((nb, round_up(kb, SCALE_ALIGN)), dtype=torch.float32, device=weight_scale_inv.device)
    padded[:, :kb] = weight_scale_inv
    return padded.t()


def pad_activation(x: torch.Tensor, k_padded: int) -> torch.Tensor:
    """x [M, K] -> [round_up(M, 4), k_padded], zeros appended (x itself when nothing is missing). Zero
    columns leave every group's amax, so its scale, as it is."""
    m, k = x.shape
    pad_m, pad_k = round_up(m, SCALE_ALIGN) - m, k_padded - k
    return F.pad(x, (0, pad_k, 0, pad_m)) if pad_m or pad_k else x


def trim_output(out: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """out [M', N'] of the padded problem -> [m, n], contiguous (a copy only when N was padded)."""
    out = out[:m]
    return out[:, :n].contiguous() if out.shape[1] != n else out


@dataclass(frozen=True)
class TorchScaledMmWeight:
    """weight [round_up(N, 16), round_up(K, 128)] e4m3 contiguous; weight_scale the [round_up(Kb, 4), Nb]
    float32 view `scaled_mm` reads (see weight_scale_operand); n, k: the unpadded shape."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    n: int
    k: int


class TorchScaledMmFp8Gemm(Fp8GemmBackend):
    name: ClassVar[str] = "torch_scaled_mm"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        dtypes=frozenset({torch.bfloat16, torch.float32}),  # the outputs torch's sm90 block-wise tests cover
        devices=frozenset({"cuda"}),
        min_capability=(9, 0),
        max_capability=(9, 0),
        block_shapes=frozenset({(BLOCK, BLOCK)}),
        cuda_graph=True,  # padding decided by shapes; cuBLASLt's workspace is torch's
        batch_invariant_note="cuBLASLt picks its kernel (and split-K) by M",
    )
    priority: ClassVar[dict[str, int]] = {"sm90": 40}  # below Triton's 50 until a shootout table ranks them

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        if hardware.is_cuda and hardware.capability != (9, 0):
            return Availability.no("torch's block-wise scaled_mm (1x128 x 128x128 scales) runs only on sm90 "
                                   f"(Hopper); this GPU is {hardware.arch}")
        available = super().availability(hardware)
        if not available:
            return available
        supported = scaled_mm_support()
        return triton_availability(hardware) if supported else supported

    def prepare(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> TorchScaledMmWeight:
        """weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/128), ceil(K/128)] float32 -> padded weight
        and the scale layout cuBLASLt reads, on this backend's device."""
        self.check_weight(weight, weight_scale_inv)
        n, k = weight.shape
        return TorchScaledMmWeight(
            pad_weight(weight.to(self.device)).contiguous(),
            weight_scale_operand(weight_scale_inv.to(self.device)),
            n,
            k,
        )

    def apply(self, x: torch.Tensor, packed: TorchScaledMmWeight) -> torch.Tensor:
        """x [M, K] of spec.dtype -> [M, N] of spec.dtype."""
        from plugserve.plugins.gemm import triton_kernels

        if x.dim() != 2 or x.shape[1] != packed.k or x.dtype != self.spec.dtype:
            raise ValueError(f"x must be [M, {packed.k}] of dtype {self.spec.dtype}, "
                             f"got shape {tuple(x.shape)} of dtype {x.dtype}")
        m = x.shape[0]
        if m == 0:
            return x.new_empty((0, packed.n))
        x_q, x_scales = triton_kernels.per_token_group_quant_fp8(
            pad_activation(x, packed.weight.shape[1]), BLOCK, column_major_scales=True
        )
        out = F.scaled_mm(
            x_q, packed.weight.t(),
            x_scales, F.ScalingType.BlockWise1x128,
            packed.weight_scale, F.ScalingType.BlockWise128x128,
            output_dtype=self.spec.dtype,
        )
        return trim_output(out, m, packed.n)

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32 row-major)."""
        from plugserve.plugins.gemm import triton_kernels

        return triton_kernels.per_token_group_quant_fp8(x, self.spec.block_shape[1])


@hookimpl
def plugserve_backends() -> list[type[Fp8GemmBackend]]:
    return [TorchScaledMmFp8Gemm]
