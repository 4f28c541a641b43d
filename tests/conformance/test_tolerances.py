import pytest
import torch

from plugserve.conformance.tolerances import W8A8_MOE_ATOL, assert_close


def test_w8a8_moe_bound_admits_one_rounding_step_but_not_a_wrong_scale() -> None:
    expected = torch.linspace(-1.8, 1.8, 1000, dtype=torch.float64)
    flipped = expected.clone()
    flipped[453] += 0.0114  # the H200 kit's float32 failure: 0.6 % of max |ref| at one element
    with pytest.raises(AssertionError, match="max error"):
        assert_close(flipped, expected, torch.float32, "fp32 bound")
    assert_close(flipped, expected, torch.float32, "w8a8 bound", W8A8_MOE_ATOL)
    with pytest.raises(AssertionError, match="w8a8 bound"):
        assert_close(expected * 1.02, expected, torch.float32, "w8a8 bound", W8A8_MOE_ATOL)


def test_a_looser_dtype_bound_is_kept() -> None:
    expected = torch.ones(8, dtype=torch.float64)
    assert_close(expected + 0.02, expected, torch.bfloat16, "bf16 bound", W8A8_MOE_ATOL)  # bf16's 2.5e-2 stays


def test_assert_close_adds_the_slack_to_the_bound():
    expected = torch.zeros(4, dtype=torch.float64)
    actual = torch.tensor([0.0, 0.0, 0.5, 0.0])
    slack = torch.tensor([0.0, 0.0, 0.4, 0.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"rounding slack 0\.4"):
        assert_close(actual, expected, torch.float32, "slack", slack=slack)
    assert_close(actual, expected, torch.float32, "slack", slack=slack + 0.1)
