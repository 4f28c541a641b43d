"""The "torch_scaled_mm" GEMM on the CPU: availability, the padding and scale layouts it hands
torch.nn.functional.scaled_mm, and `apply` end to end with scaled_mm replaced by a float32 emulation
that first makes torch's own argument checks for the 1x128 x 128x128 recipe."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from plugserve.conformance.tolerances import assert_close
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.layers.quant import per_token_group_quant_fp8, quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.plugins.gemm import torch_scaled_mm
from plugserve.plugins.gemm.torch_ref import block_fp8_matmul
from plugserve.plugins.gemm.torch_scaled_mm import (
    TorchScaledMmFp8Gemm,
    pad_activation,
    pad_weight,
    scaled_mm_support,
    trim_output,
    weight_scale_operand,
)
from plugserve.registry import Registry

CPU = torch.device("cpu")
BLOCK = (128, 128)
BLOCKWISE = SimpleNamespace(scaled_mm=lambda *args, **kwargs: None,
                            ScalingType=SimpleNamespace(BlockWise1x128=4, BlockWise128x128=5))


def _gpu(capability: tuple[int, int]) -> Hardware:
    return Hardware("cuda", "Some GPU", capability, 80 << 30, 132)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# -- declaration, registration, availability ----------------------------------------------------------


def test_declared_and_registered() -> None:
    TorchScaledMmFp8Gemm.check_declaration()
    registry = Registry(builtin=("plugserve.plugins.gemm.torch_ref", "plugserve.plugins.gemm.torch_scaled_mm"),
                        entry_points=False)
    assert not registry.broken and registry.get("gemm", "torch_scaled_mm").cls is TorchScaledMmFp8Gemm


def test_availability_names_the_gpu_and_the_build() -> None:
    assert TorchScaledMmFp8Gemm.availability(Hardware.detect(CPU)).reason == "runs on cuda, not cpu"
    for capability, arch in (((8, 0), "sm80"), ((8, 9), "sm89"), ((10, 0), "sm100")):
        reason = TorchScaledMmFp8Gemm.availability(_gpu(capability)).reason
        assert "runs only on sm90 (Hopper)" in reason and reason.endswith(f"this GPU is {arch}")
    hopper = TorchScaledMmFp8Gemm.availability(_gpu((9, 0)))
    if torch.version.cuda is None:  # this machine's CPU build of torch
        assert not hopper and "is built without CUDA" in hopper.reason


def test_scaled_mm_support_says_what_is_missing() -> None:
    for functional in (SimpleNamespace(), SimpleNamespace(scaled_mm=None, ScalingType=SimpleNamespace(RowWise=1))):
        reason = scaled_mm_support(functional, "2.8.0", "12.8").reason
        assert reason.startswith("torch 2.8.0 has no torch.nn.functional.scaled_mm") and "torch 2.10" in reason
    assert scaled_mm_support(BLOCKWISE, "2.11.0", None).reason == "torch 2.11.0 is built without CUDA"
    old_cuda = scaled_mm_support(BLOCKWISE, "2.11.0+cu126", "12.6").reason
    assert "cuBLASLt 12.9 or newer" in old_cuda and "CUDA 12.6" in old_cuda
    assert scaled_mm_support(BLOCKWISE, "2.11.0+cu129", "12.9") and scaled_mm_support(BLOCKWISE, "2.11.0", "13.0")
    assert scaled_mm_support(F, torch.__version__, "13.0"), "this torch has block-wise scaled_mm"


def test_capabilities() -> None:
    check = TorchScaledMmFp8Gemm.capabilities.check
    assert check(GemmSpec(dtype=torch.bfloat16), Phase.DECODE) and check(GemmSpec(dtype=torch.float32), Phase.PREFILL)
    assert check(GemmSpec(dtype=torch.float16), Phase.DECODE).reason == (
        "dtype float16 is not supported (supports bfloat16, float32)"
    )
    assert "weight block shape (64, 64)" in check(GemmSpec(block_shape=(64, 64)), Phase.DECODE).reason


# -- padding and layouts -------------------------------------------------------------------------------


def test_pad_weight() -> None:
    w_q, _ = quantize_block_fp8(torch.randn(200, 320), BLOCK)
    padded = pad_weight(w_q)
    assert padded.shape == (208, 384) and padded.dtype == torch.float8_e4m3fn
    assert torch.equal(padded[:200, :320].float(), w_q.float())
    assert (padded[200:].float() == 0).all() and (padded[:, 320:].float() == 0).all()
    aligned, _ = quantize_block_fp8(torch.randn(256, 512), BLOCK)
    assert pad_weight(aligned) is aligned


@pytest.mark.parametrize("nb,kb,rows", [(3, 5, 8), (2, 4, 4), (1, 1, 4), (17, 56, 56)])
def test_weight_scale_operand(nb: int, kb: int, rows: int) -> None:
    scales = torch.rand(nb, kb) + 0.5
    operand = weight_scale_operand(scales)
    assert operand.shape == (rows, nb) and operand.stride() == (1, rows)  # torch: strides (1, round_up(K/128, 4))
    assert torch.equal(operand[:kb], scales.t()) and (operand[kb:] == 0).all()


def test_pad_activation_and_trim_output() -> None:
    x = torch.randn(5, 320)
    padded = pad_activation(x, 384)
    assert padded.shape == (8, 384) and torch.equal(padded[:5, :320], x)
    assert (padded[5:] == 0).all() and (padded[:, 320:] == 0).all()
    aligned = torch.randn(8, 256)
    assert pad_activation(aligned, 256) is aligned
    out = torch.arange(8 * 208.0).view(8, 208)
    trimmed = trim_output(out, 5, 200)
    assert trimmed.shape == (5, 200) and trimmed.is_contiguous() and torch.equal(trimmed, out[:5, :200])
    assert torch.equal(trim_output(out, 8, 208), out)


# -- apply, with scaled_mm emulated -------------------------------------------------------------------


def _emulated_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, *, output_dtype):
    """torch's argument checks for ScalingType.BlockWise1x128 (a) x BlockWise128x128 (b) on sm90
    (aten/src/ATen/native/cuda/ScaledBlas.cpp), then the product in float32 on the dequantized operands."""
    assert recipe_a == F.ScalingType.BlockWise1x128 and recipe_b == F.ScalingType.BlockWise128x128
    (m, k), n = mat_a.shape, mat_b.shape[1]
    kb, nb = _ceil(k, 128), _ceil(n, 128)
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn and mat_b.shape[0] == k
    assert k % 16 == 0 and n % 16 == 0, "cuBLASLt: K and N multiples of 16"
    assert mat_a.stride(1) == 1 and mat_b.stride(0) == 1, "sm90 runs row-major x column-major only"
    assert scale_a.shape == (m, kb) and scale_a.stride(0) == 1
    assert scale_a.stride(1) == m or (kb == 1 and scale_a.stride(1) == 1), f"scale_a strides {scale_a.stride()}"
    rows = _ceil(kb, 4) * 4
    assert scale_b.shape == (rows, nb) and scale_b.stride(0) == 1
    assert scale_b.stride(1) == rows or (nb == 1 and scale_b.stride(1) == 1), f"scale_b strides {scale_b.stride()}"
    a = mat_a.float() * scale_a.repeat_interleave(128, dim=1)[:, :k]
    b = mat_b.float() * scale_b[:kb].repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    return (a @ b).to(output_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (7, 384, 1024), (33, 200, 320), (64, 2112, 256), (4, 128, 128)])
def test_apply_matches_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    """M of 1 and not a multiple of 4, N not a multiple of 16 (200) or of 128 (2112), K not of 128 (320),
    one K block (128): padding, quantization and layouts end to end against the torch reference."""
    monkeypatch.setattr(torch_scaled_mm.F, "scaled_mm", _emulated_scaled_mm)
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_q, w_s = quantize_block_fp8(torch.randn(n, k, generator=g) / k**0.5, BLOCK)
    backend = TorchScaledMmFp8Gemm(GemmSpec(dtype=dtype), CPU)
    out = backend.apply(x, backend.prepare(w_q, w_s))
    x_q, x_s = per_token_group_quant_fp8(x)
    assert out.dtype == dtype and out.shape == (m, n) and out.is_contiguous()
    assert_close(out, block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, dtype), dtype, f"torch_scaled_mm m{m}-n{n}-k{k}")


def test_apply_validates_and_handles_empty_batches() -> None:
    backend = TorchScaledMmFp8Gemm(GemmSpec(), CPU)
    w_q, w_s = quantize_block_fp8(torch.randn(256, 512), BLOCK)
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        backend.prepare(w_q, w_s[:, :3])
    packed = backend.prepare(w_q, w_s)
    with pytest.raises(ValueError, match=r"x must be \[M, 512\] of dtype torch.bfloat16"):
        backend.apply(torch.randn(3, 512), packed)
    assert backend.apply(torch.randn(0, 512, dtype=torch.bfloat16), packed).shape == (0, 256)
