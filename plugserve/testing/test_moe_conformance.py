"""MoE backends against the oracle: the router and the routed experts (bf16 and block-FP8)."""

from __future__ import annotations

import pytest
import torch

from plugserve.core.forward_batch import Phase
from plugserve.core.interfaces import MoEBackend, MoESpec
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.testing import oracle
from plugserve.testing.cases import MoECase
from plugserve.testing.plugin import Target, require_available
from plugserve.testing.tolerances import assert_close

ROUTED_SCALING_FACTOR = 2.5  # DeepSeek-V3's; != 1 so that a backend ignoring it fails


def _backend(target: Target, spec: MoESpec, hardware, device) -> MoEBackend:
    require_available(target, hardware)
    fits = target.cls.capabilities.check(spec, Phase.DECODE)
    if not fits:
        pytest.skip(f"{target.entry.name}: {fits.reason}")
    return target.cls(spec, device)  # type: ignore[call-arg]


def test_route(moe_target: Target, router_case: MoECase, plugserve_hardware, plugserve_device):
    spec = MoESpec(dtype=moe_target.dtype, router=router_case.router)
    backend = _backend(moe_target, spec, plugserve_hardware, plugserve_device)
    e = router_case.router.num_experts
    logits = torch.randn(router_case.num_tokens, e, device=plugserve_device)
    bias = torch.randn(e, device=plugserve_device) * 0.1 if router_case.router.topk_method == "noaux_tc" else None
    weights, ids = backend.route(logits, bias)
    expected = oracle.route(logits, router_case.router, bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == expected.ids.shape
    # Any order of the k chosen experts is fine: compare sorted by expert id. Tokens whose choice is a
    # tie closer than float32 resolves may go either way.
    ids_sorted, order = ids.long().sort(dim=1)
    decided = ~expected.near_tie
    assert torch.equal(ids_sorted[decided], expected.ids[decided]), "chosen experts differ from the oracle"
    torch.testing.assert_close(weights.gather(1, order)[decided].double(), expected.weights[decided],
                               rtol=1e-5, atol=1e-6)


def _quantize_experts(w: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> e4m3 [E, N, K] and scale_inv [E, ceil(N/128), ceil(K/128)]."""
    quantized = [quantize_block_fp8(expert, spec.block_shape) for expert in w]
    return torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized])


@pytest.mark.parametrize("weight_format", ["unquantized", "fp8_block"])
def test_forward(moe_target: Target, moe_case: MoECase, weight_format: str, plugserve_hardware, plugserve_device):
    fp8 = weight_format == "fp8_block"
    spec = MoESpec(moe_case.hidden_size, moe_case.intermediate_size, moe_target.dtype,
                   torch.float8_e4m3fn if fp8 else None, router=moe_case.router)
    backend = _backend(moe_target, spec, plugserve_hardware, plugserve_device)
    e, h, i, device = spec.num_experts, spec.hidden_size, spec.intermediate_size, plugserve_device
    w13 = torch.randn(e, 2 * i, h, device=device) / h**0.5
    w2 = torch.randn(e, h, i, device=device) / i**0.5
    if fp8:
        (w13, s13), (w2, s2) = _quantize_experts(w13, spec), _quantize_experts(w2, spec)
    else:
        w13, w2, s13, s2 = w13.to(spec.dtype), w2.to(spec.dtype), None, None
    x = torch.randn(moe_case.num_tokens, h, device=device, dtype=spec.dtype)
    bias = torch.randn(e, device=device) * 0.1 if spec.router.topk_method == "noaux_tc" else None
    routing = oracle.route(torch.randn(moe_case.num_tokens, e, device=device), spec.router, bias)
    ids, weights = routing.ids.to(torch.int32), routing.weights.float()
    out = backend.forward(x, backend.prepare(w13, w2, s13, s2), ids, weights, ROUTED_SCALING_FACTOR)
    expected = oracle.moe(x, w13, w2, ids, weights, ROUTED_SCALING_FACTOR, s13, s2, spec.block_shape)
    assert out.dtype == spec.dtype
    assert_close(out, expected, spec.dtype, f"MoE forward {moe_case} {weight_format}")
