"""Block-FP8 GEMM backends against the oracle: activation quantizer and GEMM."""

from __future__ import annotations

import pytest
import torch

from plugserve.conformance import oracle
from plugserve.conformance.cases import GemmCase
from plugserve.conformance.plugin import Target, require_available
from plugserve.conformance.tolerances import assert_close
from plugserve.core.forward_batch import Phase
from plugserve.core.interfaces import Fp8GemmBackend
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import GemmSpec

E4M3_MANTISSA_BITS = 3


def _backend(target: Target, hardware, device) -> Fp8GemmBackend:
    require_available(target, hardware)
    spec = GemmSpec(dtype=target.dtype)
    fits = target.cls.capabilities.check(spec, Phase.DECODE)
    if not fits:
        pytest.skip(f"{target.entry.name}: {fits.reason}")
    return target.cls(spec, device)  # type: ignore[call-arg]


def test_quantize_activation(gemm_target: Target, gemm_case: GemmCase, plugserve_hardware, plugserve_device):
    backend = _backend(gemm_target, plugserve_hardware, plugserve_device)
    x = torch.randn(gemm_case.m, gemm_case.k, device=plugserve_device, dtype=gemm_target.dtype)
    x[0, :64] = 0  # an all-zero half group must not divide by zero
    q, scales = backend.quantize_activation(x)
    ref_q, ref_scales = oracle.quantize_per_token_group(x, backend.spec.block_shape[1])
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == ref_scales.shape, (
        f"scales {tuple(scales.shape)} != oracle {tuple(ref_scales.shape)}"
    )
    torch.testing.assert_close(scales, ref_scales, rtol=1e-5, atol=0, msg="per-token-group scales")
    # A kernel may round x / scale or x * (1 / scale): values may sit one e4m3 step apart.
    q32, ref32 = q.float(), ref_q.float()
    one_step = ref32.abs() * 2.0**-E4M3_MANTISSA_BITS + 2.0**-9  # 2^-9: e4m3's smallest subnormal
    assert ((q32 - ref32).abs() <= one_step).all(), "quantized values differ by more than one e4m3 step"


def test_apply(gemm_target: Target, gemm_case: GemmCase, plugserve_hardware, plugserve_device):
    backend = _backend(gemm_target, plugserve_hardware, plugserve_device)
    block = backend.spec.block_shape
    w = torch.randn(gemm_case.n, gemm_case.k, device=plugserve_device) / gemm_case.k**0.5
    w_q, w_scale_inv = quantize_block_fp8(w, block)
    x = torch.randn(gemm_case.m, gemm_case.k, device=plugserve_device, dtype=gemm_target.dtype)
    out = backend.apply(x, backend.prepare(w_q, w_scale_inv))
    expected = oracle.fp8_gemm(x, w_q, w_scale_inv, block)
    assert out.dtype == gemm_target.dtype
    assert_close(out, expected, gemm_target.dtype, f"block-FP8 GEMM {gemm_case}")


# Rows of the batch-invariance case: more than one tile of any kernel's M, so that tails and splits show.
INVARIANCE_ROWS = 37


def test_apply_is_batch_invariant(gemm_target: Target, plugserve_hardware, plugserve_device):
    """A backend declaring `batch_invariant`, built for it: each row of x is the same bits alone, in a prefix of the
    rows, or in the whole batch."""
    if not gemm_target.cls.capabilities.batch_invariant:
        pytest.skip(f"{gemm_target.entry.name} does not declare batch_invariant")
    require_available(gemm_target, plugserve_hardware)
    spec = GemmSpec(dtype=gemm_target.dtype, batch_invariant=True)
    backend = gemm_target.cls(spec, plugserve_device)  # type: ignore[call-arg]
    w_q, w_scale_inv = quantize_block_fp8(torch.randn(256, 384, device=plugserve_device) / 384**0.5, spec.block_shape)
    packed = backend.prepare(w_q, w_scale_inv)
    x = torch.randn(INVARIANCE_ROWS, 384, device=plugserve_device, dtype=spec.dtype)
    whole = backend.apply(x, packed)
    for m in (1, 2, 5, 16, INVARIANCE_ROWS - 1):
        assert torch.equal(backend.apply(x[:m], packed), whole[:m]), f"the first {m} rows alone"
    assert torch.equal(backend.apply(x[-1:], packed), whole[-1:]), "the last row alone"
