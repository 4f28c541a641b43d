"""The torch reference block-FP8 GEMM: quantizers against e4m3's rounding bounds, the GEMM against
an fp32 matmul and against a blockwise fp8 accumulation the way w8a8 kernels compute it."""

from __future__ import annotations

import pytest
import torch

from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.layers.quant import dequantize_block_fp8, per_token_group_quant_fp8, quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm, block_fp8_matmul
from plugserve.registry import Registry

E4M3 = torch.float8_e4m3fn
CPU = torch.device("cpu")


def _e4m3_error_bound(x_scaled: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest error of e4m3 in units of the scale: half an ulp, i.e. 2^-4 relative for
    normals (3 mantissa bits) and 2^-10 absolute for subnormals (below 2^-6, step 2^-9)."""
    return torch.maximum(x_scaled.abs() * 2.0**-4, torch.full_like(x_scaled, 2.0**-10))


def _random_groups(m: int, k: int, group: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values whose magnitude differs by orders of magnitude from group to group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    magnitudes = 10.0 ** torch.randint(-4, 4, (m, -(-k // group)), generator=g).float()
    return x * magnitudes.repeat_interleave(group, dim=1)[:, :k]


@pytest.mark.parametrize("k", [128, 384, 300, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_group_quant_round_trip(k: int, dtype: torch.dtype) -> None:
    group = 128
    x = _random_groups(16, k, group).to(dtype)
    x_q, scales = per_token_group_quant_fp8(x, group)

    assert x_q.dtype == E4M3 and x_q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (16, -(-k // group))
    x32 = x.float()
    scale_per_elem = scales.repeat_interleave(group, dim=1)[:, :k]
    # The scale maps each group's amax (the last group's too, though shorter) onto e4m3's max, 448.
    padded = torch.nn.functional.pad(x32.abs(), (0, scales.shape[1] * group - k))
    amax = padded.view(16, -1, group).amax(dim=-1)
    torch.testing.assert_close(scales, amax / 448.0, rtol=0, atol=0)
    assert (x_q.float().abs().view(-1) <= 448).all()
    err = (x32 - x_q.float() * scale_per_elem).abs()
    assert (err <= _e4m3_error_bound(x32 / scale_per_elem) * scale_per_elem + 1e-6 * x32.abs()).all()


def test_per_token_group_quant_zero_groups() -> None:
    x = torch.randn(4, 300)
    x[1] = 0.0
    x[2, 128:256] = 0.0
    x[3, 256:] = 0.0  # the short last group
    x_q, scales = per_token_group_quant_fp8(x, 128)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert not torch.isnan(x_q.float()).any()
    assert (x_q[1].float() == 0).all() and (x_q[2, 128:256].float() == 0).all() and (x_q[3, 256:].float() == 0).all()
    torch.testing.assert_close(dequantize_block_fp8(x_q, scales, (1, 128)), x, rtol=2.0**-4, atol=1e-4)


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (1, 129), (130, 7)])
def test_block_quant_dequant_round_trip(n: int, k: int) -> None:
    w = _random_groups(n, k, 128, seed=1) * 0.01
    w_q, scale_inv = quantize_block_fp8(w, (128, 128))
    assert w_q.dtype == E4M3 and w_q.shape == (n, k)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (-(-n // 128), -(-k // 128))

    w_dq = dequantize_block_fp8(w_q, scale_inv, (128, 128))
    assert w_dq.dtype == torch.float32 and w_dq.shape == (n, k)
    scale_per_elem = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    err = (w - w_dq).abs()
    assert (err <= _e4m3_error_bound(w / scale_per_elem) * scale_per_elem + 1e-6 * w.abs()).all()

    # Dequantized values are exactly representable, so quantizing them again changes nothing.
    w_q2, scale_inv2 = quantize_block_fp8(w_dq, (128, 128))
    assert torch.equal(w_q2.float(), w_q.float())
    torch.testing.assert_close(scale_inv2, scale_inv, rtol=1e-6, atol=0)


def test_dequantize_rejects_wrong_scale_grid() -> None:
    w_q, _ = quantize_block_fp8(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        dequantize_block_fp8(w_q, torch.ones(2, 2))


def _blockwise_fp8_matmul(x_q, x_s, w_q, w_s, block_shape) -> torch.Tensor:
    """Independent formulation, the one w8a8 block kernels use: per output tile and K block,
    multiply the e4m3 values, then scale by the activation group's and weight block's scales."""
    bn, bk = block_shape
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.zeros(m, n)
    for j in range(-(-k // bk)):
        ks = slice(j * bk, (j + 1) * bk)
        for i in range(-(-n // bn)):
            ns = slice(i * bn, (i + 1) * bn)
            partial = x_q[:, ks].float() @ w_q[ns, ks].float().T
            out[:, ns] += partial * x_s[:, j : j + 1] * w_s[i, j]
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (17, 200, 300), (64, 384, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_backend_apply(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_q, w_s = quantize_block_fp8(torch.randn(n, k, generator=g) * 0.05)
    backend = TorchRefFp8Gemm(GemmSpec(dtype=dtype), CPU)
    packed = backend.prepare(w_q, w_s)
    y = backend.apply(x, packed)
    assert y.dtype == dtype and y.shape == (m, n)

    w_dq = dequantize_block_fp8(w_q, w_s)
    assert _cosine(y, x.float() @ w_dq.T) > 0.999

    x_q, x_s = backend.quantize_activation(x)
    assert torch.equal(y, block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), dtype))
    torch.testing.assert_close(
        y, _blockwise_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128)).to(dtype),
        rtol=1e-5 if dtype == torch.float32 else None, atol=1e-5 if dtype == torch.float32 else None,
    )


def test_quantize_activation_uses_spec_group() -> None:
    backend = TorchRefFp8Gemm(GemmSpec(dtype=torch.float32, block_shape=(128, 64)), CPU)
    x_q, scales = backend.quantize_activation(torch.randn(3, 200))
    assert x_q.shape == (3, 200) and scales.shape == (3, 4)


def test_prepare_and_apply_reject_bad_inputs() -> None:
    backend = TorchRefFp8Gemm(GemmSpec(dtype=torch.bfloat16), CPU)
    w_q, w_s = quantize_block_fp8(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*got.*shape \(2, 2\)"):
        backend.prepare(w_q, w_s[:, :2])
    with pytest.raises(ValueError, match=r"float32"):
        backend.prepare(w_q, w_s.double())
    with pytest.raises(ValueError, match=r"float8_e4m3fn.*got shape \(200, 300\) of dtype torch.bfloat16"):
        backend.prepare(w_q.to(torch.bfloat16), w_s)
    with pytest.raises(ValueError, match=r"float8_e4m3fn.*got shape \(300,\)"):
        backend.prepare(w_q[0], w_s)
    packed = backend.prepare(w_q, w_s)
    with pytest.raises(ValueError, match=r"\[M, 300\].*got shape \(4, 256\)"):
        backend.apply(torch.randn(4, 256, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match=r"dtype torch.bfloat16.*dtype torch.float32"):
        backend.apply(torch.randn(4, 300), packed)


def test_registered_and_usable_on_cpu() -> None:
    registry = Registry(builtin=("plugserve.plugins.gemm.torch_ref",), entry_points=False)
    assert registry.get("gemm", "torch_ref").cls is TorchRefFp8Gemm
    cpu = Hardware.detect("cpu")
    for phase in Phase:
        assert registry.select("gemm", phase, 8, cpu, spec=GemmSpec()).backend is TorchRefFp8Gemm
    assert not TorchRefFp8Gemm.capabilities.check(GemmSpec(block_shape=(64, 64)), Phase.PREFILL)
