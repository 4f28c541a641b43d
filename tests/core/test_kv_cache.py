"""The KV pool's fp8 storage: quantization against the nearest e4m3 value found by search over all 256 codes, the
dequantized read, and the token count an fp8 pool holds in a bf16 pool's memory."""

from __future__ import annotations

import pytest
import torch

from plugserve.core.kv_cache import E4M3_MAX, MLAKVPool, dequantize, quantize


def _nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Every value of x (float64) to the nearest finite float8_e4m3fn value, ties to the even code, past +-448 to
    +-448: a search over the 254 finite codes, not a cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    finite = torch.arange(256)[~codes.isnan()]
    values = codes[finite]
    distance = (x[:, None] - values[None, :]).abs()
    best = distance.min(dim=1, keepdim=True).values
    ties = distance == best
    # Among equally near values take the even mantissa (the code's lowest bit 0); +0 / -0 by x's sign.
    even = (finite % 2 == 0)[None, :]
    pick = torch.where((ties & even).any(1, keepdim=True), ties & even, ties).double().argmax(1)
    out = values[pick]
    return torch.where(x.abs() >= E4M3_MAX, x.sign() * E4M3_MAX, out).where(out != 0, 0.0 * x.sign())


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
def test_quantize_rounds_to_the_nearest_e4m3_value_and_saturates(scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 8, torch.randn(500, generator=g) * 300,
                   torch.tensor([0.0, -0.0, 1e-4, -3e-3, 500.0, -1e6, 2.0**-9 * 1.5, 31.65])])
    stored = quantize(x, torch.float8_e4m3fn, scale)
    assert stored.dtype == torch.float8_e4m3fn and not stored.float().isnan().any()
    expected = _nearest_e4m3(x.double() / scale)
    assert torch.equal(stored.double(), expected)
    back = dequantize(stored, scale, torch.float32)
    # Inside the range: within half a step, 2^-4 relative for normals, 2^-10 absolute in the subnormals, times scale.
    inside = (x / scale).abs() <= E4M3_MAX
    error = (back - x)[inside].abs()
    assert bool((error <= torch.maximum(x[inside].abs() * 2.0**-4, torch.tensor(2.0**-10 * scale)) * (1 + 1e-6)).all())


def test_an_fp8_pool_writes_value_over_scale_and_reads_back_value() -> None:
    pool = MLAKVPool(2, 4, 2, 16, 8, torch.float8_e4m3fn, "cpu", scale=0.5)
    slots = torch.tensor([5, 1])
    # Values exact in e4m3 once halved.
    latent, rope = torch.tensor([[1.0] * 16, [-3.0] * 16]), torch.tensor([[0.25] * 8, [104.0] * 8])
    pool.write(1, slots, latent, rope)
    assert pool.gather(1, slots)[0, 0].float() == 2.0  # stored: value / scale
    assert torch.equal(pool.read(1, slots, torch.float32), torch.cat([latent, rope], 1))
    assert pool.buffer(0).float().abs().sum() == 0  # the other layer untouched


def test_an_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_bytes() -> None:
    fp8 = MLAKVPool(3, 2, 4, 512, 64, torch.float8_e4m3fn, "cpu")
    bf16 = MLAKVPool(3, 2, 4, 512, 64, torch.bfloat16, "cpu")
    for layer in range(3):
        assert fp8.buffer(layer).untyped_storage().nbytes() == 8 * 576  # 8 slots of 576 one-byte values
        assert bf16.buffer(layer).untyped_storage().nbytes() == 8 * 576 * 2


def test_a_scale_other_than_one_needs_an_fp8_pool() -> None:
    with pytest.raises(ValueError, match="needs a float8_e4m3fn pool"):
        MLAKVPool(1, 1, 1, 16, 8, torch.bfloat16, "cpu", scale=0.5)
