"""The torch reference MoE against HF transformers' own DeepSeek-V2/V3 router and MoE modules, and
its FP8 path against block-FP8 GEMMs composed per token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe, DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter

from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import MoEWeights
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import GemmSpec, MoESpec, RouterConfig
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm
from plugserve.plugins.moe.torch_ref import TorchRefMoE, select_experts
from plugserve.registry import Registry

CPU = torch.device("cpu")
HIDDEN, MOE_INTER, NUM_TOKENS = 64, 32, 96


def _v3_config(norm_topk_prob: bool = True) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5, n_shared_experts=1,
    )


def _v2_config(topk_method: str) -> DeepseekV2Config:
    # V2-Lite routes greedily over 64 experts; V2 in 8 groups keeping 3, scaled by 16. Shrunk here.
    grouped = topk_method == "group_limited_greedy"
    return DeepseekV2Config(
        hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, n_routed_experts=16, num_experts_per_tok=4,
        topk_method=topk_method, n_group=4 if grouped else 1, topk_group=2 if grouped else 1,
        routed_scaling_factor=16.0 if grouped else 1.0, norm_topk_prob=False, n_shared_experts=2,
    )


def _router_config(config: DeepseekV2Config | DeepseekV3Config) -> RouterConfig:
    """What a model loader derives from the HF config. HF's V3 router is always sigmoid + noaux_tc;
    its V2 router is always softmax and never normalizes (it ignores norm_topk_prob)."""
    v3 = isinstance(config, DeepseekV3Config)
    return RouterConfig(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        scoring_func="sigmoid" if v3 else "softmax",
        topk_method="noaux_tc" if v3 else config.topk_method,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=bool(config.norm_topk_prob) if v3 else False,
    )


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """HF leaves expert weights uninitialized and the router at zero outside from_pretrained."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            std = 0.3 if name.endswith("gate.weight") else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # Large enough next to sigmoid scores in (0, 1) to change which experts win.
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)


def _hidden(seed: int = 7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both [T, k] sorted by expert id, since neither router orders its choices."""
    ids_sorted, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids_sorted


def _assert_same_routing(ours, hf, scale: float) -> None:
    weights, ids = _by_id(*ours)
    hf_weights, hf_ids = _by_id(*hf)
    assert torch.equal(ids, hf_ids)
    # HF multiplies routed_scaling_factor into the router's weights; ours leaves it to forward.
    torch.testing.assert_close(weights * scale, hf_weights, rtol=1e-6, atol=1e-7)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


# ----------------------------------------------------------------------------------------------------
# Router


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_v3_router_matches_hf(norm_topk_prob: bool) -> None:
    config = _v3_config(norm_topk_prob)
    gate = DeepseekV3TopkRouter(config)
    _randomize(gate, seed=0)
    router_logits, hf_weights, hf_ids = gate(_hidden())
    bias = gate.e_score_correction_bias

    weights, ids = select_experts(router_logits, _router_config(config), bias)

    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (NUM_TOKENS, 4)
    _assert_same_routing((weights, ids), (hf_weights, hf_ids), config.routed_scaling_factor)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(NUM_TOKENS))
    # The test only means something if the bias and the group limit change some choices.
    _, greedy_ids = torch.topk(router_logits.sigmoid(), 4, dim=-1)
    assert not torch.equal(_by_id(ids, ids)[1], _by_id(greedy_ids, greedy_ids)[1])


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_router_matches_hf(topk_method: str) -> None:
    config = _v2_config(topk_method)
    gate = DeepseekV2TopkRouter(config)
    _randomize(gate, seed=1)
    router_logits, hf_weights, hf_ids = gate(_hidden())

    weights, ids = select_experts(router_logits, _router_config(config))

    _assert_same_routing((weights, ids), (hf_weights, hf_ids), config.routed_scaling_factor)


def test_group_limit_keeps_choices_in_top_groups() -> None:
    router = RouterConfig(num_experts=16, top_k=4, scoring_func="softmax", topk_method="group_limited_greedy",
                          n_group=4, topk_group=2, norm_topk_prob=False)
    logits = torch.randn(NUM_TOKENS, 16, generator=torch.Generator().manual_seed(3))
    _, ids = select_experts(logits, router)
    scores = logits.softmax(-1)
    best_groups = scores.view(NUM_TOKENS, 4, 4).amax(-1).topk(2, dim=-1).indices
    for t in range(NUM_TOKENS):
        assert set((ids[t].long() // 4).tolist()) <= set(best_groups[t].tolist())


def test_router_rejects_misused_bias() -> None:
    logits = torch.randn(4, 16)
    with pytest.raises(ValueError, match="noaux_tc needs correction_bias"):
        select_experts(logits, _router_config(_v3_config()), None)
    with pytest.raises(ValueError, match=r"shape \(16,\), got \(8,\)"):
        select_experts(logits, _router_config(_v3_config()), torch.zeros(8))
    with pytest.raises(ValueError, match="only used by noaux_tc"):
        select_experts(logits, _router_config(_v2_config("greedy")), torch.zeros(16))
    with pytest.raises(ValueError, match=r"\[T, 16\]"):
        select_experts(torch.randn(4, 8), _router_config(_v3_config()), torch.zeros(16))


# ----------------------------------------------------------------------------------------------------
# Routed experts


def _unquantized_spec(router: RouterConfig, dtype: torch.dtype = torch.float32) -> MoESpec:
    return MoESpec(hidden_size=HIDDEN, intermediate_size=MOE_INTER, dtype=dtype, weight_dtype=None, router=router)


def _routed_only(moe: torch.nn.Module) -> None:
    """Zero the shared experts' output projection so the module returns its routed experts alone."""
    with torch.no_grad():
        moe.shared_experts.down_proj.weight.zero_()


@pytest.mark.parametrize(
    "make_config,moe_cls", [(_v3_config, DeepseekV3MoE), (lambda: _v2_config("group_limited_greedy"), DeepseekV2Moe),
                            (lambda: _v2_config("greedy"), DeepseekV2Moe)],
    ids=["v3", "v2", "v2-lite"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_match_hf_moe(make_config, moe_cls, dtype: torch.dtype) -> None:
    config = make_config()
    moe = moe_cls(config)
    _randomize(moe, seed=4)
    _routed_only(moe)
    x = _hidden()
    with torch.no_grad():
        expected = moe(x)

    backend = TorchRefMoE(_unquantized_spec(_router_config(config), dtype), CPU)
    router_logits = F.linear(x, moe.gate.weight)
    bias = getattr(moe.gate, "e_score_correction_bias", None)
    weights, ids = backend.route(router_logits, bias)
    packed = backend.prepare(MoEWeights(moe.experts.gate_up_proj.detach().to(dtype),
                                        moe.experts.down_proj.detach().to(dtype)))
    out = backend.forward(x.to(dtype), packed, ids, weights, config.routed_scaling_factor)

    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        assert _cosine(out, expected) > 0.999


def test_routed_scaling_factor_scales_output() -> None:
    config = _v3_config()
    moe = DeepseekV3MoE(config)
    _randomize(moe, seed=5)
    backend = TorchRefMoE(_unquantized_spec(_router_config(config)), CPU)
    x = _hidden()
    weights, ids = backend.route(F.linear(x, moe.gate.weight), moe.gate.e_score_correction_bias)
    packed = backend.prepare(MoEWeights(moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()))
    unscaled = backend.forward(x, packed, ids, weights, 1.0)
    scaled = backend.forward(x, packed, ids, weights, 2.5)
    assert unscaled.abs().max() > 0
    torch.testing.assert_close(scaled, 2.5 * unscaled)


# FP8: H and I that are not all multiples of 128, so edge blocks and short token groups are exercised.
FP8_H, FP8_I, FP8_E = 256, 192, 8
FP8_ROUTER = RouterConfig(num_experts=FP8_E, top_k=2, scoring_func="sigmoid", topk_method="noaux_tc",
                          n_group=4, topk_group=2, norm_topk_prob=True)


def _fp8_problem(seed: int = 6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, FP8_H, generator=g)
    w13 = torch.randn(FP8_E, 2 * FP8_I, FP8_H, generator=g) / FP8_H**0.5
    w2 = torch.randn(FP8_E, FP8_H, FP8_I, generator=g) / FP8_I**0.5
    logits = torch.randn(40, FP8_E, generator=g)
    bias = torch.randn(FP8_E, generator=g) * 0.1
    weights, ids = select_experts(logits, FP8_ROUTER, bias)
    return x, w13, w2, weights, ids


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize_block_fp8(w_e, (128, 128)) for w_e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_close_to_unquantized(dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _fp8_problem()
    spec = MoESpec(hidden_size=FP8_H, intermediate_size=FP8_I, dtype=dtype, router=FP8_ROUTER)
    fp8 = TorchRefMoE(spec, CPU)
    w13_q, w13_s = _quantize_experts(w13)
    w2_q, w2_s = _quantize_experts(w2)
    packed = fp8.prepare(MoEWeights(w13_q, w2_q, w13_s, w2_s))
    out = fp8.forward(x.to(dtype), packed, ids, weights, 2.5)

    dense = TorchRefMoE(MoESpec(hidden_size=FP8_H, intermediate_size=FP8_I, dtype=torch.float32,
                                weight_dtype=None, router=FP8_ROUTER), CPU)
    reference = dense.forward(x, dense.prepare(MoEWeights(w13, w2)), ids, weights, 2.5)
    assert out.dtype == dtype
    assert _cosine(out, reference) > 0.99


def test_fp8_experts_match_composed_fp8_gemms() -> None:
    """Per token and chosen expert, the w8a8 pipeline built from the GEMM reference backend:
    quantize x, block-FP8 GEMM, silu * up, quantize h, block-FP8 GEMM, weight and scale."""
    x, w13, w2, weights, ids = _fp8_problem(seed=8)
    w13_q, w13_s = _quantize_experts(w13)
    w2_q, w2_s = _quantize_experts(w2)
    spec = MoESpec(hidden_size=FP8_H, intermediate_size=FP8_I, dtype=torch.float32, router=FP8_ROUTER)
    backend = TorchRefMoE(spec, CPU)
    out = backend.forward(x, backend.prepare(MoEWeights(w13_q, w2_q, w13_s, w2_s)), ids, weights, 2.5)

    gemm = TorchRefFp8Gemm(GemmSpec(dtype=torch.float32), CPU)
    up_gemms = [gemm.prepare(w13_q[e], w13_s[e]) for e in range(FP8_E)]
    down_gemms = [gemm.prepare(w2_q[e], w2_s[e]) for e in range(FP8_E)]
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(FP8_ROUTER.top_k):
            e = int(ids[t, j])
            gate_up = gemm.apply(x[t : t + 1], up_gemms[e])
            h = F.silu(gate_up[:, :FP8_I]) * gate_up[:, FP8_I:]
            expected[t] += weights[t, j] * gemm.apply(h, down_gemms[e])[0]
    torch.testing.assert_close(out, 2.5 * expected, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Validation and registration


def test_prepare_rejects_bad_weights() -> None:
    _, w13, w2, _, _ = _fp8_problem()
    w13_q, w13_s = _quantize_experts(w13)
    w2_q, w2_s = _quantize_experts(w2)
    fp8 = TorchRefMoE(MoESpec(hidden_size=FP8_H, intermediate_size=FP8_I, dtype=torch.bfloat16,
                              router=FP8_ROUTER), CPU)
    with pytest.raises(ValueError, match=r"w13 must be .*\(8, 384, 256\), got .*\(8, 256, 256\)"):
        fp8.prepare(MoEWeights(w13_q[:, :256], w2_q, w13_s, w2_s))
    with pytest.raises(ValueError, match=r"w2 must be torch.float8_e4m3fn .*got torch.float32"):
        fp8.prepare(MoEWeights(w13_q, w2, w13_s, w2_s))
    with pytest.raises(ValueError, match="need w13_scale_inv and w2_scale_inv"):
        fp8.prepare(MoEWeights(w13_q, w2_q))
    with pytest.raises(ValueError, match=r"w2_scale_inv must be .*\(8, 2, 2\), got .*\(8, 2, 1\)"):
        fp8.prepare(MoEWeights(w13_q, w2_q, w13_s, w2_s[:, :, :1]))

    dense = TorchRefMoE(MoESpec(hidden_size=FP8_H, intermediate_size=FP8_I, dtype=torch.float32,
                                weight_dtype=None, router=FP8_ROUTER), CPU)
    with pytest.raises(ValueError, match="take no w13_scale_inv"):
        dense.prepare(MoEWeights(w13, w2, w13_s, w2_s))
    with pytest.raises(ValueError, match=r"w13 must be torch.float32 .*got torch.float8_e4m3fn"):
        dense.prepare(MoEWeights(w13_q, w2_q))
    packed = dense.prepare(MoEWeights(w13, w2))
    ids = torch.full((4, 2), -2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 8\) or be -1"):
        dense.forward(torch.randn(4, FP8_H), packed, ids, torch.ones(4, 2), 1.0)
    skipped = dense.forward(torch.randn(4, FP8_H), packed, torch.full((4, 2), -1, dtype=torch.int32),
                            torch.ones(4, 2), 1.0)
    assert torch.equal(skipped, torch.zeros(4, FP8_H))  # expert -1: a slot that adds nothing
    with pytest.raises(ValueError, match=r"x must be \[T, 256\]"):
        dense.forward(torch.randn(4, 128), packed, ids.abs(), torch.ones(4, 2), 1.0)


def test_registered_and_usable_on_cpu() -> None:
    registry = Registry(builtin=("plugserve.plugins.moe.torch_ref",), entry_points=False)
    assert registry.get("moe", "torch_ref").cls is TorchRefMoE
    cpu = Hardware.detect("cpu")
    for spec in (MoESpec(), _unquantized_spec(_router_config(_v2_config("greedy")), torch.bfloat16)):
        for phase in Phase:
            assert registry.select("moe", phase, 8, cpu, spec=spec).backend is TorchRefMoE
