"""A stand-in for the `deep_gemm` module (v2.6.1, sm90) in torch, for testing the DeepGEMM backends where
the library cannot run. It computes what DeepGEMM's sm90 1D2D kernels compute (float32 accumulation of the
dequantized operands, bf16 output) and asserts what they, or plugserve's promises about them, require:

- operands K-major, outputs N-major, weight scales contiguous, N a multiple of 8 (the library's checks);
- activation scales already MN-major and TMA-aligned, so that the library makes no transposing copy of
  them (plugserve's promise);
- masked groups of a multiple of 128 rows, so that no row tile of one group writes into the next
  (plugserve's promise; the library does not check it).

Output rows the kernels leave alone (past masked_m, between and after the psum groups) become NaN here,
so that a backend reading them fails.
"""

from __future__ import annotations

import torch

__version__ = "2.6.1"
ALIGNMENT = 128
GRAN = 128


def _tma_aligned(m: int) -> int:
    return -(-m // 4) * 4


def _check_activation_scales(sfa: torch.Tensor, rows: int, k: int) -> None:
    """[..., rows, ceil(k/128)] float32 with strides (..., 1, round_up(rows, 4))."""
    aligned = _tma_aligned(rows)
    assert sfa.dtype == torch.float32 and sfa.shape[-2:] == (rows, -(-k // GRAN)), tuple(sfa.shape)
    assert sfa.stride(-2) == 1 or rows == 1, f"activation scales not MN-major: strides {sfa.stride()}"
    assert sfa.stride(-1) == aligned, f"activation scales not TMA-aligned: strides {sfa.stride()}"
    if sfa.dim() == 3:
        assert sfa.stride(0) == aligned * sfa.shape[-1], f"scale groups not packed: strides {sfa.stride()}"


def _check_weight(w: torch.Tensor, sfb: torch.Tensor) -> None:
    assert w.dtype == torch.float8_e4m3fn and w.is_contiguous(), "weights must be contiguous e4m3 (K-major)"
    n, k = w.shape[-2:]
    assert n % 8 == 0, f"N = {n} is not a multiple of 8"
    assert sfb.dtype == torch.float32 and sfb.is_contiguous(), "weight scales must be contiguous float32"
    assert sfb.shape[-2:] == (-(-n // GRAN), -(-k // GRAN)), (tuple(sfb.shape), n, k)


def _dequantize(x: torch.Tensor, scales: torch.Tensor, rows_per_scale: int) -> torch.Tensor:
    """x [..., R, K] e4m3 with scales [..., ceil(R/rows_per_scale), ceil(K/128)] -> float32."""
    expanded = scales.float().repeat_interleave(rows_per_scale, dim=-2).repeat_interleave(GRAN, dim=-1)
    return x.float() * expanded[..., : x.shape[-2], : x.shape[-1]]


def _product(a: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor, sfw: torch.Tensor) -> torch.Tensor:
    return _dequantize(*a, 1) @ _dequantize(w, sfw, GRAN).transpose(-1, -2)


def fp8_gemm_nt(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], d: torch.Tensor) -> None:
    (x, sfa), (w, sfb) = a, b
    assert x.dtype == torch.float8_e4m3fn and x.stride(-1) == 1, "A must be K-major e4m3"
    assert d.dtype == torch.bfloat16 and d.stride(-1) == 1 and d.shape == (x.shape[0], w.shape[0])
    _check_weight(w, sfb)
    _check_activation_scales(sfa, x.shape[0], x.shape[1])
    d.copy_(_product(a, w, sfb))


def m_grouped_fp8_gemm_nt_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
    (x, sfa), (w, sfb) = a, b
    groups, max_m, k = x.shape
    assert x.dtype == torch.float8_e4m3fn and x.is_contiguous() and d.is_contiguous() and d.dtype == torch.bfloat16
    assert max_m % 128 == 0, f"max_m {max_m}: a 128-row tile of one group would write into the next"
    assert masked_m.dtype == torch.int32 and masked_m.shape == (groups,) and isinstance(expected_m, int)
    assert expected_m > 0
    _check_weight(w, sfb)
    _check_activation_scales(sfa, max_m, k)
    d.fill_(float("nan"))
    product = _product(a, w, sfb)
    for g, m in enumerate(masked_m.tolist()):
        d[g, :m] = product[g, :m]


def m_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, grouped_layout: torch.Tensor, *,
                                     use_psum_layout: bool, expected_m_for_psum_layout: int) -> None:
    (x, sfa), (w, sfb) = a, b
    assert use_psum_layout and expected_m_for_psum_layout > 0
    assert x.dtype == torch.float8_e4m3fn and x.is_contiguous() and d.is_contiguous() and d.dtype == torch.bfloat16
    assert grouped_layout.dtype == torch.int32 and grouped_layout.shape == (w.shape[0],)
    _check_weight(w, sfb)
    _check_activation_scales(sfa, x.shape[0], x.shape[1])
    d.fill_(float("nan"))
    end = 0
    for g, psum in enumerate(grouped_layout.tolist()):
        start = -(-end // ALIGNMENT) * ALIGNMENT  # the kernel's group start: the previous end, aligned
        assert start <= psum <= x.shape[0], f"group {g}: psum {psum} before its start {start}"
        if psum > start:
            d[start:psum] = _product((x[start:psum], sfa[start:psum]), w[g], sfb[g])
        end = psum


def get_mk_alignment_for_contiguous_layout() -> int:
    return ALIGNMENT

