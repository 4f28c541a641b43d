"""MoE backends against the oracle: the router and the routed experts (bf16 and block-FP8), slots of expert -1
skipped, the shared experts fused into them and one rank's slice of the experts (expert parallelism) for backends
that declare them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plugserve.conformance import oracle
from plugserve.conformance.cases import MoECase
from plugserve.conformance.plugin import Target, require_available
from plugserve.conformance.tolerances import W8A8_MOE_ATOL, assert_close
from plugserve.core.forward_batch import Phase
from plugserve.core.interfaces import MoEBackend, MoEWeights
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import MoESpec, RouterConfig

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
    _check_routing(backend.route(logits, bias), oracle.route(logits, router_case.router, bias), 1e-5)


# A route_hidden case's hidden size, and how near a tie is for logits summed in float32 over it by the backend.
ROUTE_HIDDEN_SIZE = 1024
ROUTE_HIDDEN_TIE = 1e-4


def test_route_hidden(moe_target: Target, router_case: MoECase, plugserve_hardware, plugserve_device):
    """`route_hidden`: the gate's logits from hidden states (in the model dtype, as the model keeps the gate on a
    GPU), then the selection, against the oracle's routing of the float64 logits."""
    spec = MoESpec(dtype=moe_target.dtype, router=router_case.router)
    backend = _backend(moe_target, spec, plugserve_hardware, plugserve_device)
    e, h = router_case.router.num_experts, ROUTE_HIDDEN_SIZE
    x = torch.randn(router_case.num_tokens, h, device=plugserve_device).to(spec.dtype)
    gate = (torch.randn(e, h, device=plugserve_device) / h**0.5).to(spec.dtype)
    bias = torch.randn(e, device=plugserve_device) * 0.1 if router_case.router.topk_method == "noaux_tc" else None
    expected = oracle.route(x.double() @ gate.double().T, router_case.router, bias, tie=ROUTE_HIDDEN_TIE)
    _check_routing(backend.route_hidden(x, gate, bias), expected, 1e-4)


def _check_routing(routed: tuple[torch.Tensor, torch.Tensor], expected: oracle.Routing, rtol: float) -> None:
    weights, ids = routed
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == expected.ids.shape
    # Any order of the k chosen experts is fine: compare sorted by expert id. Tokens whose choice is a
    # tie closer than float32 resolves may go either way.
    ids_sorted, order = ids.long().sort(dim=1)
    decided = ~expected.near_tie
    assert torch.equal(ids_sorted[decided], expected.ids[decided]), "chosen experts differ from the oracle"
    torch.testing.assert_close(weights.gather(1, order)[decided].double(), expected.weights[decided],
                               rtol=rtol, atol=rtol / 10)


def _quantize_experts(w: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> e4m3 [E, N, K] and scale_inv [E, ceil(N/128), ceil(K/128)]."""
    quantized = [quantize_block_fp8(expert, spec.block_shape) for expert in w]
    return torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized])


def _experts(spec: MoESpec, num_experts: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Random experts in the spec's format: w13 [E, 2I, H], w2 [E, H, I] and, FP8, their block scales."""
    h, i = spec.hidden_size, spec.intermediate_size
    w13 = torch.randn(num_experts, 2 * i, h, device=device) / h**0.5
    w2 = torch.randn(num_experts, h, i, device=device) / i**0.5
    if spec.is_fp8:
        (w13, s13), (w2, s2) = _quantize_experts(w13, spec), _quantize_experts(w2, spec)
        return w13, w2, s13, s2
    return w13.to(spec.dtype), w2.to(spec.dtype), None, None


@pytest.mark.parametrize("weight_format", ["unquantized", "fp8_block"])
def test_forward(moe_target: Target, moe_case: MoECase, weight_format: str, plugserve_hardware, plugserve_device):
    fp8 = weight_format == "fp8_block"
    spec = MoESpec(moe_case.hidden_size, moe_case.intermediate_size, moe_target.dtype,
                   torch.float8_e4m3fn if fp8 else None, router=moe_case.router)
    backend = _backend(moe_target, spec, plugserve_hardware, plugserve_device)
    e, h, device = spec.num_experts, spec.hidden_size, plugserve_device
    w13, w2, s13, s2 = _experts(spec, e, device)
    x = torch.randn(moe_case.num_tokens, h, device=device, dtype=spec.dtype)
    bias = torch.randn(e, device=device) * 0.1 if spec.router.topk_method == "noaux_tc" else None
    routing = oracle.route(torch.randn(moe_case.num_tokens, e, device=device), spec.router, bias)
    ids, weights = routing.ids.to(torch.int32), routing.weights.float()
    out = backend.forward(x, backend.prepare(MoEWeights(w13, w2, s13, s2)), ids, weights, ROUTED_SCALING_FACTOR)
    expected, slack = oracle.moe_with_rounding_slack(x, w13, w2, ids, weights, ROUTED_SCALING_FACTOR, s13, s2,
                                                     spec.block_shape)
    assert out.dtype == spec.dtype
    assert_close(out, expected, spec.dtype, f"MoE forward {moe_case} {weight_format}", W8A8_MOE_ATOL if fp8 else None,
                 slack)


@pytest.mark.parametrize("weight_format", ["unquantized", "fp8_block"])
def test_forward_skips_the_slots_of_expert_minus_one(moe_target: Target, moe_case: MoECase, weight_format: str,
                                                     plugserve_hardware, plugserve_device):
    """A slot of expert -1 adds nothing (DP attention marks its padding rows so): every slot of the even tokens and
    the first slot of the others; the oracle weights those slots 0."""
    fp8 = weight_format == "fp8_block"
    spec = MoESpec(moe_case.hidden_size, moe_case.intermediate_size, moe_target.dtype,
                   torch.float8_e4m3fn if fp8 else None, router=moe_case.router)
    backend = _backend(moe_target, spec, plugserve_hardware, plugserve_device)
    e, device = spec.num_experts, plugserve_device
    w13, w2, s13, s2 = _experts(spec, e, device)
    x = torch.randn(moe_case.num_tokens, spec.hidden_size, device=device, dtype=spec.dtype)
    bias = torch.randn(e, device=device) * 0.1 if spec.router.topk_method == "noaux_tc" else None
    routing = oracle.route(torch.randn(moe_case.num_tokens, e, device=device), spec.router, bias)
    ids, weights = routing.ids.to(torch.int32), routing.weights.float()
    skipped = torch.zeros_like(ids, dtype=torch.bool)
    skipped[::2] = True
    skipped[:, 0] = True
    out = backend.forward(x, backend.prepare(MoEWeights(w13, w2, s13, s2)), ids.masked_fill(skipped, -1), weights,
                          ROUTED_SCALING_FACTOR)
    expected, slack = oracle.moe_with_rounding_slack(x, w13, w2, ids, weights.masked_fill(skipped, 0),
                                                     ROUTED_SCALING_FACTOR, s13, s2, spec.block_shape)
    assert out.dtype == spec.dtype
    assert torch.all(out[::2] == 0), "a token whose every slot is expert -1 must get zeros"
    assert_close(out, expected, spec.dtype, f"MoE forward {moe_case} {weight_format}, slots of expert -1",
                 W8A8_MOE_ATOL if fp8 else None, slack)


@pytest.mark.parametrize(("weight_format", "num_shared"), [("unquantized", 2), ("fp8_block", 1), ("fp8_block", 2)])
def test_forward_with_fused_shared_experts(moe_target: Target, moe_case: MoECase, weight_format: str,
                                           num_shared: int, plugserve_hardware, plugserve_device):
    """`MoESpec.num_shared_experts`: route appends the shared experts to every token, forward adds the
    shared MLP (checked as a dense MLP of S x I, apart from the routed experts)."""
    if not moe_target.cls.capabilities.shared_experts_fusion:
        pytest.skip(f"{moe_target.entry.name} does not declare shared_experts_fusion")
    fp8 = weight_format == "fp8_block"
    router = dataclasses.replace(moe_case.router, routed_scaling_factor=ROUTED_SCALING_FACTOR)
    spec = MoESpec(moe_case.hidden_size, moe_case.intermediate_size, moe_target.dtype,
                   torch.float8_e4m3fn if fp8 else None, router=router, num_shared_experts=num_shared)
    e, h, i, k, device = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k, plugserve_device
    if fp8 and num_shared > 1 and i % spec.block_shape[0]:
        pytest.skip(f"{num_shared} FP8 shared experts of {i} rows split the MLP's {spec.block_shape[0]}-row "
                    "scale blocks")
    backend = _backend(moe_target, spec, plugserve_hardware, plugserve_device)
    w13 = torch.randn(e, 2 * i, h, device=device) / h**0.5
    w2 = torch.randn(e, h, i, device=device) / i**0.5
    shared_w13 = torch.randn(1, 2 * num_shared * i, h, device=device) / h**0.5
    shared_w2 = torch.randn(1, h, num_shared * i, device=device) / (num_shared * i) ** 0.5
    if fp8:
        (w13, s13), (w2, s2) = _quantize_experts(w13, spec), _quantize_experts(w2, spec)
        (shared_w13, shared_s13), (shared_w2, shared_s2) = (_quantize_experts(shared_w13, spec),
                                                            _quantize_experts(shared_w2, spec))
    else:
        w13, w2, shared_w13, shared_w2 = (w.to(spec.dtype) for w in (w13, w2, shared_w13, shared_w2))
        s13 = s2 = shared_s13 = shared_s2 = None
    logits = torch.randn(moe_case.num_tokens, e, device=device)
    bias = torch.randn(e, device=device) * 0.1 if router.topk_method == "noaux_tc" else None
    weights, ids = backend.route(logits, bias)
    assert ids.shape == weights.shape == (moe_case.num_tokens, k + num_shared)
    assert torch.equal(ids[:, k:].long().cpu(), torch.arange(e, e + num_shared).expand(moe_case.num_tokens, -1))
    torch.testing.assert_close(weights[:, k:].cpu(), torch.full((moe_case.num_tokens, num_shared),
                                                                1 / ROUTED_SCALING_FACTOR))
    packed = backend.prepare(MoEWeights(w13, w2, s13, s2, shared_w13=shared_w13[0], shared_w2=shared_w2[0],
                                        shared_w13_scale_inv=None if shared_s13 is None else shared_s13[0],
                                        shared_w2_scale_inv=None if shared_s2 is None else shared_s2[0]))
    x = torch.randn(moe_case.num_tokens, h, device=device, dtype=spec.dtype)
    out = backend.forward(x, packed, ids, weights, ROUTED_SCALING_FACTOR)
    routed, routed_slack = oracle.moe_with_rounding_slack(x, w13, w2, ids[:, :k], weights[:, :k],
                                                          ROUTED_SCALING_FACTOR, s13, s2, spec.block_shape)
    one = torch.zeros(moe_case.num_tokens, 1, dtype=torch.int32, device=device)
    shared, shared_slack = oracle.moe_with_rounding_slack(x, shared_w13, shared_w2, one,
                                                          torch.ones(one.shape, device=device), 1.0, shared_s13,
                                                          shared_s2, spec.block_shape)
    assert_close(out, routed + shared, spec.dtype, f"MoE forward {moe_case} {weight_format} + {num_shared} shared",
                 W8A8_MOE_ATOL if fp8 else None, routed_slack + shared_slack)


EP_SIZE, EP_RANK = 4, 2  # a middle rank: ids below and above its experts both occur


@pytest.mark.parametrize("weight_format", ["unquantized", "fp8_block"])
def test_forward_on_one_ranks_experts(moe_target: Target, moe_case: MoECase, weight_format: str,
                                      plugserve_hardware, plugserve_device):
    """`MoESpec.ep_size` / `ep_rank`: prepare takes this rank's E / ep_size experts, forward takes route's
    global ids and adds only the slots of those experts (the oracle of all E with the others weighted 0)."""
    if not moe_target.cls.capabilities.expert_parallel:
        pytest.skip(f"{moe_target.entry.name} does not declare expert_parallel")
    fp8 = weight_format == "fp8_block"
    spec = MoESpec(moe_case.hidden_size, moe_case.intermediate_size, moe_target.dtype,
                   torch.float8_e4m3fn if fp8 else None, router=moe_case.router, ep_size=EP_SIZE, ep_rank=EP_RANK)
    backend = _backend(moe_target, spec, plugserve_hardware, plugserve_device)
    e, device = spec.num_experts, plugserve_device
    w13, w2, s13, s2 = _experts(spec, e, device)
    local = slice(spec.first_expert, spec.first_expert + spec.num_local_experts)
    packed = backend.prepare(MoEWeights(w13[local], w2[local], *(None if s is None else s[local] for s in (s13, s2))))
    x = torch.randn(moe_case.num_tokens, spec.hidden_size, device=device, dtype=spec.dtype)
    bias = torch.randn(e, device=device) * 0.1 if spec.router.topk_method == "noaux_tc" else None
    routing = oracle.route(torch.randn(moe_case.num_tokens, e, device=device), spec.router, bias)
    ids, weights = routing.ids.to(torch.int32), routing.weights.float()
    out = backend.forward(x, packed, ids, weights, ROUTED_SCALING_FACTOR)
    mine = (ids >= local.start) & (ids < local.stop)
    expected, slack = oracle.moe_with_rounding_slack(x, w13, w2, ids, weights.masked_fill(~mine, 0),
                                                     ROUTED_SCALING_FACTOR, s13, s2, spec.block_shape)
    assert out.dtype == spec.dtype
    assert_close(out, expected, spec.dtype, f"MoE forward {moe_case} {weight_format}, rank {EP_RANK} of {EP_SIZE}",
                 W8A8_MOE_ATOL if fp8 else None, slack)


# DeepSeek-V3's router at a small scale (sigmoid, noaux_tc, groups), over more tokens than one kernel tile.
INVARIANCE_ROUTER, INVARIANCE_TOKENS = RouterConfig(num_experts=16, top_k=4, n_group=4, topk_group=2), 37


def test_forward_is_batch_invariant(moe_target: Target, plugserve_hardware, plugserve_device):
    """A backend declaring `batch_invariant`, built for it: route_hidden and forward give each token the same bits
    alone, in a prefix of the tokens, or in the whole batch."""
    if not moe_target.cls.capabilities.batch_invariant:
        pytest.skip(f"{moe_target.entry.name} does not declare batch_invariant")
    spec = MoESpec(256, 128, moe_target.dtype, torch.float8_e4m3fn, router=INVARIANCE_ROUTER, batch_invariant=True)
    backend = _backend(moe_target, spec, plugserve_hardware, plugserve_device)
    e, device = spec.num_experts, plugserve_device
    packed = backend.prepare(MoEWeights(*_experts(spec, e, device)))
    x = torch.randn(INVARIANCE_TOKENS, spec.hidden_size, device=device, dtype=spec.dtype)
    gate = (torch.randn(e, spec.hidden_size, device=device) / spec.hidden_size**0.5).to(spec.dtype)
    bias = torch.randn(e, device=device) * 0.1 if spec.router.topk_method == "noaux_tc" else None

    def run(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights, ids = backend.route_hidden(rows, gate, bias)
        return weights, ids, backend.forward(rows, packed, ids, weights, ROUTED_SCALING_FACTOR)

    whole = run(x)
    for m in (1, 2, 16, INVARIANCE_TOKENS - 1):
        assert all(torch.equal(a, b[:m]) for a, b in zip(run(x[:m]), whole, strict=True)), f"the first {m} tokens"
