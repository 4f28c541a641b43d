"""How close a backend must come to the kit's oracle (`oracle.py`, float64), per dtype: the one place
these live.

Errors are measured against the oracle's largest magnitude (kernels accumulate in a different
order, so elementwise-relative bounds break on values near zero), plus a cosine-similarity floor
that catches systematic errors (a dropped term, a missing scale) small in every element.

An fp8 (e4m3) KV cache keeps the bounds of the activation dtype. e4m3 keeps 3 mantissa bits: its values are 2^-3
of their binade apart, so storing a latent element moves it by up to half that, 2^-4 of itself (2^-10 absolute
below 2^-6, where it is subnormal). That error is in the inputs: the oracle reads the cache as dequantized (the
stored e4m3 value times the pool's scale, `oracle.stored_kv`), the very values a backend reads, so it never enters
the comparison. What a backend adds is its upcast, exact (every e4m3 value is a float16, bfloat16 and float32
value), and the scale applied in float32 to scores and outputs, one rounding of 2^-24: far below every bound here.
Bounds that admitted e4m3's 2^-4 would hide a kernel that misreads the cache by as much; the cost of the
quantization itself is measured on the model's perplexity instead (docs/kernels.md). A decode that itself computes
in e4m3 (`AttentionBackend.rounds_decode_to_e4m3`) is compared with the oracle over the query rounded as it
declares, and gets its probabilities' rounding as per-element slack (`oracle.mla_e4m3_probability_slack`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float  # times max |reference|
    rtol: float  # times |reference| elementwise
    min_cosine: float
    lse_atol: float  # absolute, on natural-log log-sum-exps


TOLERANCES: dict[torch.dtype, Tolerance] = {
    # float32 admits TF32 tensor-core math (Triton's default for fp32 tl.dot on NVIDIA GPUs).
    torch.float32: Tolerance(atol=2e-3, rtol=2e-3, min_cosine=0.99999, lse_atol=2e-3),
    torch.float16: Tolerance(atol=4e-3, rtol=4e-3, min_cosine=0.9999, lse_atol=5e-3),
    torch.bfloat16: Tolerance(atol=2.5e-2, rtol=2.5e-2, min_cosine=0.999, lse_atol=2e-2),
}


# Block-FP8 MoE (w8a8) quantizes the SiLU-and-mul intermediate, which backend and oracle compute in different
# precisions (float32 against float64): an element within that difference of an e4m3 rounding boundary rounds
# one way in each, one e4m3 step apart (up to 1/8 of it), and at a few hundred tokens some do. Each moves its
# outputs by w2's column times that step, past float32's and float16's bounds. The output bound then admits 1 % of
# max |ref|; the cosine floor still catches a systematic error.
W8A8_MOE_ATOL = 1e-2


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                 atol: float | None = None, slack: torch.Tensor | None = None) -> None:
    """Raise AssertionError naming `what`, the worst element and the cosine when `actual` is off. `atol`:
    at least this times max |reference| (W8A8_MOE_ATOL), where the dtype's own is tighter. `slack` (expected's
    shape): more room per element, the oracle's own (oracle.moe_with_rounding_slack, mla_e4m3_probability_slack);
    the cosine floor then admits an error as large as all of it, sqrt(1 - (|slack| / |reference|)^2), where that
    is lower than the dtype's."""
    tol = TOLERANCES[dtype]
    if atol is not None and atol > tol.atol:
        tol = Tolerance(atol, tol.rtol, tol.min_cosine, tol.lse_atol)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        raise AssertionError(f"{what}: {int((~torch.isfinite(a)).sum())} non-finite values")
    if a.numel() == 0:
        return
    scale = e.abs().max().item()
    err = (a - e).abs()
    bound = tol.atol * scale + tol.rtol * e.abs() + (0.0 if slack is None else slack.double())
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), e.flatten(), dim=0).item() if scale > 0 else 1.0
    floor = tol.min_cosine
    if slack is not None and scale > 0:
        floor = min(floor, math.sqrt(max(0.0, 1 - (slack.double().norm() / e.norm()).item() ** 2)))
    if bool((err > bound).any()) or cosine < floor:
        worst = int(torch.argmax(err - bound))
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
        raise AssertionError(
            f"{what} ({dtype}): max error {err.max().item():.3e} at {index} "
            f"(got {a.flatten()[worst].item():.5g}, reference {e.flatten()[worst].item():.5g}; "
            f"bound {tol.atol:g} x max|ref| {scale:.3g} + {tol.rtol:g} x |ref|"
            + ("" if slack is None else f" + rounding slack {slack.flatten()[worst].item():.3g}")
            + f"), cosine {cosine:.6f} "
            f"(floor {floor:.6g})"
        )


def assert_lse_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Log-sum-exps: equal infinities where no key is visible, absolute error elsewhere."""
    tol = TOLERANCES[dtype]
    if actual.shape != expected.shape or actual.dtype != torch.float32:
        raise AssertionError(f"{what}: got {actual.dtype} {tuple(actual.shape)}, "
                             f"expected float32 {tuple(expected.shape)}")
    finite = torch.isfinite(expected)
    a, e = actual.double(), expected.double()
    if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], e[~finite]):
        raise AssertionError(f"{what}: -inf where no key is visible does not match the reference")
    err = (a[finite] - e[finite]).abs()
    if err.numel() and err.max().item() > tol.lse_atol:
        raise AssertionError(f"{what} ({dtype}): max lse error {err.max().item():.3e} > {tol.lse_atol}")
