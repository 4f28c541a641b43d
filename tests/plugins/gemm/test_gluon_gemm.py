"""The Gluon block-FP8 GEMM, the Triton backend's GEMM on sm90 from GLUON_MIN_M rows: where it fits (on the CPU),
and against the torch reference on a Hopper GPU (Gluon kernels do not run in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from plugserve.conformance.tolerances import assert_close
from plugserve.core.layers.quant import per_token_group_quant_fp8, quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.plugins.gemm import gluon_gemm
from plugserve.plugins.gemm.torch_ref import block_fp8_matmul
from plugserve.plugins.gemm.triton import TritonFp8Gemm

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
SM90, E4M3 = (9, 0), torch.float8_e4m3fn


def test_where_the_gluon_kernel_fits():
    a, b = torch.zeros(256, 4224).to(E4M3), torch.zeros(384, 4224).to(E4M3)
    fits = gluon_gemm.gluon_gemm_fits
    assert fits(a, b, (128, 128), SM90, 132)
    assert not fits(a, b, (128, 128), None, 132)  # the interpreter runs no Gluon
    assert not fits(a, b, (128, 128), (10, 0), 132)  # Blackwell has no wgmma
    assert not fits(a[:255], b, (128, 128), SM90, 132)  # fewer rows than GLUON_MIN_M: the Triton kernel's
    assert not fits(a, b, (64, 128), SM90, 132)
    assert not fits(a[:, :4100], b[:, :4100], (128, 128), SM90, 132)  # K not a multiple of 128
    assert not fits(a[:, :384], b[:, :384], (128, 128), SM90, 132)  # under GLUON_MIN_K deep: the Triton kernel's
    assert not fits(a.to(torch.bfloat16), b.to(torch.bfloat16), (128, 128), SM90, 132)
    assert not fits(a.t().contiguous().t(), b, (128, 128), SM90, 132)  # K must be contiguous (TMA rows)
    assert fits(a[:, :4096], b[:, :4096], (128, 128), SM90, 132)  # rows strided by 4224
    assert not fits(a, b[:380], (128, 128), SM90, 132)  # the output's 16-bit rows must be 16-byte aligned (TMA store)


def test_the_gluon_kernel_leaves_badly_filled_waves_to_triton():
    """n2112 (17 tile columns) on 132 SMs: 512 rows are 68 tiles, one wave; 1024 rows 136 tiles, two waves filled
    to 0.52; 2048 rows 272 tiles, three waves filled to 0.69; on 136 SMs 1024 rows are one wave again."""
    a, b = torch.zeros(2048, 512).to(E4M3), torch.zeros(2112, 512).to(E4M3)
    fits = gluon_gemm.gluon_gemm_fits
    assert [fits(a[:rows], b, (128, 128), SM90, 132) for rows in (512, 1024, 2048)] == [True, False, True]
    assert fits(a[:1024], b, (128, 128), SM90, 136)


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).cuda().to(torch.bfloat16)
    w_q, w_s = (t.cuda() for t in quantize_block_fp8(torch.randn(n, k, generator=g) / k**0.5, (128, 128)))
    x_q, x_s = per_token_group_quant_fp8(x, 128)
    return x, x_q, x_s, w_q, w_s


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel needs a Hopper GPU")
@pytest.mark.parametrize("m,n,k,out_dtype", [
    (256, 256, 512, torch.bfloat16), (300, 2112, 7168, torch.bfloat16), (1000, 384, 1024, torch.float16),
    (4096, 4096, 1024, torch.bfloat16), (2050, 7168, 2048, torch.bfloat16),
    # float32 tiles take twice the shared memory on their way out: one ring stage fewer
    (300, 2112, 7168, torch.float32), (1000, 384, 1024, torch.float32)])
def test_matches_the_reference(m: int, n: int, k: int, out_dtype: torch.dtype):
    _, x_q, x_s, w_q, w_s = _operands(m, n, k, m + n)
    # Column-major scales with a padded leading stride, as the quantization kernel's TMA-aligned ones are.
    padded = torch.empty(k // 128, m + 5, device="cuda")[:, :m].t()
    padded.copy_(x_s)
    out = gluon_gemm.gluon_block_fp8_matmul(x_q, padded, w_q, w_s, out_dtype,
                                            torch.cuda.get_device_properties(0).multi_processor_count)
    assert out.dtype == out_dtype
    assert_close(out, block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), out_dtype), out_dtype,
                 f"gluon GEMM {m}x{n}x{k} {out_dtype}")


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel needs a Hopper GPU")
def test_the_backend_takes_it_from_gluon_min_m(monkeypatch: pytest.MonkeyPatch):
    calls = []
    gluon = gluon_gemm.gluon_block_fp8_matmul
    monkeypatch.setattr(gluon_gemm, "gluon_block_fp8_matmul", lambda *args: calls.append(args[0].shape) or gluon(*args))
    backend = TritonFp8Gemm(GemmSpec(dtype=torch.bfloat16), torch.device("cuda"))
    x, _, _, w_q, w_s = _operands(gluon_gemm.GLUON_MIN_M + 3, 640, gluon_gemm.GLUON_MIN_K, 7)
    packed = backend.prepare(w_q, w_s)
    for rows in (gluon_gemm.GLUON_MIN_M - 1, gluon_gemm.GLUON_MIN_M + 3):
        x_q, x_s = per_token_group_quant_fp8(x[:rows], 128)
        expected = block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.bfloat16)
        assert_close(backend.apply(x[:rows], packed), expected, torch.bfloat16, f"{rows} rows")
    assert calls == [(gluon_gemm.GLUON_MIN_M + 3, gluon_gemm.GLUON_MIN_K)]


def test_refuses_row_major_activation_scales():
    a = torch.zeros(256, 256).to(E4M3)
    with pytest.raises(ValueError, match="column-major"):
        gluon_gemm.gluon_block_fp8_matmul(a, torch.ones(256, 2), a, torch.ones(2, 2), torch.bfloat16, 132)
