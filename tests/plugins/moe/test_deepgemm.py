"""The `deepgemm` MoE backend: declaration, capabilities and availability; the masked and contiguous (psum)
layouts against an independent torch computation and against how DeepGEMM reads them; the row quantizer,
its SiLU-and-mul form and the top-k reduction; and the whole forward on both paths against the torch
reference, with tests/plugins/fake_deep_gemm.py standing in for the library (it poisons every output row
the real kernels leave alone, so a backend reading one fails). Without a GPU the kernels run in Triton's
interpreter (see tests/plugins/moe/test_triton.py for why they may run in a child pytest)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plugserve.conformance.tolerances import assert_close
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import MoEWeights
from plugserve.core.layers.quant import per_token_group_quant_fp8, quantize_block_fp8
from plugserve.core.specs import MoESpec, RouterConfig
from plugserve.plugins import deepgemm_support
from plugserve.plugins.moe.deepgemm import MASKED_MAX_TOKENS, DeepGemmMoE
from plugserve.plugins.moe.torch_ref import fused_experts_reference, select_experts
from plugserve.registry import Registry
from tests.interpreter import interpreter_child, kernels_fixture
from tests.plugins import fake_deep_gemm

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132)
ROUTER = RouterConfig(16, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True)
SPEC = MoESpec(256, 128, torch.bfloat16, torch.float8_e4m3fn, router=ROUTER)
RSF = 2.5  # routed_scaling_factor


kernels = kernels_fixture("plugserve.plugins.moe.deepgemm_kernels")


test_kernels_in_the_interpreter = interpreter_child(__file__, timeout=900)


# -- declaration, capabilities, availability -------------------------------------------------------------


def test_declaration_and_registration() -> None:
    DeepGemmMoE.check_declaration()
    registry = Registry(builtin=("plugserve.plugins.moe.deepgemm",), entry_points=False)
    assert registry.broken == []
    assert registry.get("moe", "deepgemm").cls is DeepGemmMoE


def test_capabilities() -> None:
    caps = DeepGemmMoE.capabilities
    assert caps.check(SPEC, Phase.DECODE) and caps.check(SPEC, Phase.PREFILL)
    assert caps.check(MoESpec(), Phase.DECODE)  # DeepSeek-V3
    unquantized = MoESpec(256, 128, torch.bfloat16, None, router=ROUTER)
    assert caps.check(unquantized, Phase.DECODE).reason.startswith("expert weight format unquantized is not supported")
    fp16 = MoESpec(256, 128, torch.float16, torch.float8_e4m3fn, router=ROUTER)
    assert "dtype float16 is not supported" in caps.check(fp16, Phase.DECODE).reason
    ragged = MoESpec(320, 96, torch.bfloat16, torch.float8_e4m3fn, router=ROUTER)
    reason = caps.check(ragged, Phase.DECODE).reason
    assert reason == "hidden size 320 and intermediate size 96 must be multiples of 128"


def test_availability() -> None:
    assert DeepGemmMoE.availability(Hardware.detect("cpu")).reason == "runs on cuda, not cpu"
    sm100 = Hardware("cuda", "NVIDIA B200", (10, 0), 180 << 30, 148)
    assert "UE8M0" in DeepGemmMoE.availability(sm100).reason


def test_availability_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing():
        raise ImportError("No module named 'deep_gemm'")

    monkeypatch.setattr(deepgemm_support, "import_deep_gemm", missing)
    reason = DeepGemmMoE.availability(H100).reason
    assert reason.startswith("deep_gemm is not installed") and "tools/device/build_deepgemm.sh" in reason


def test_availability_ok_with_the_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm)
    monkeypatch.setenv("DG_JIT_NVCC_COMPILER", str(tmp_path / "nvcc"))
    (tmp_path / "nvcc").write_text("")
    monkeypatch.setattr(deepgemm_support, "libstdcxx_check", lambda: None)
    assert DeepGemmMoE.availability(H100)
    monkeypatch.setattr(deepgemm_support, "libstdcxx_check", lambda: "preload libstdc++")
    assert DeepGemmMoE.availability(H100).reason == "preload libstdc++"


# -- layouts ------------------------------------------------------------------------------------------


def _ids(t: int, k: int, e: int, seed: int = 0, dropped: int = 0) -> torch.Tensor:
    """[t, k] int32, each row k distinct experts; `dropped` slots set to -1 or e (outside [0, e))."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    flat = ids.view(-1)
    for n, slot in enumerate(torch.randperm(flat.numel(), generator=g)[:dropped].tolist()):
        flat[slot] = -1 if n % 2 else e
    return ids


def _expert_pairs(ids: torch.Tensor, e: int) -> list[list[int]]:
    """Per expert, its pairs p = t * k + j in increasing order."""
    flat = ids.view(-1).tolist()
    return [[p for p, x in enumerate(flat) if x == expert] for expert in range(e)]


@pytest.mark.parametrize("t,k,e,dropped", [(1, 8, 256, 0), (5, 4, 16, 3), (128, 8, 64, 40), (300, 2, 4, 0)])
def test_masked_layout(kernels, t: int, k: int, e: int, dropped: int) -> None:
    ids = _ids(t, k, e, dropped=dropped)
    max_m = -(-t // 128) * 128
    layout = kernels.masked_layout(ids.to(DEVICE), e, max_m)
    expected = torch.full((t * k,), -1, dtype=torch.int32)
    for expert, pairs in enumerate(_expert_pairs(ids, e)):
        for rank, p in enumerate(pairs):
            expected[p] = expert * max_m + rank
    assert layout.max_m == max_m
    assert torch.equal(layout.dst.cpu(), expected)
    assert layout.masked_m.tolist() == [len(pairs) for pairs in _expert_pairs(ids, e)]


def test_masked_layout_never_writes_past_a_group(kernels) -> None:
    """A token naming one expert twice is not the router's output, but must not spill into the next group."""
    ids = torch.full((40, 4), 3, dtype=torch.int32)
    layout = kernels.masked_layout(ids.to(DEVICE), 8, 128)
    dst = layout.dst.cpu()
    assert dst[:128].tolist() == [3 * 128 + r for r in range(128)] and (dst[128:] == -1).all()
    assert layout.masked_m.tolist() == [0, 0, 0, 128, 0, 0, 0, 0]


@pytest.mark.parametrize("t,k,e,dropped", [(1, 8, 256, 0), (37, 4, 16, 5), (200, 8, 64, 0), (3, 2, 4, 6)])
def test_contiguous_layout(kernels, t: int, k: int, e: int, dropped: int) -> None:
    """Expert e's pairs, in order, in rows [start_e, start_e + count_e), start_e the previous expert's end
    rounded up to 128; psum[e] = start_e + count_e, which is how DeepGEMM finds each expert's rows."""
    ids = _ids(t, k, e, dropped=dropped)
    layout = kernels.contiguous_layout(ids.to(DEVICE), e, 128)
    dst, psum = layout.dst.cpu(), layout.psum.cpu()
    assert dst.dtype == torch.int32 and psum.dtype == torch.int32 and psum.shape == (e,)
    start = 0
    for expert, pairs in enumerate(_expert_pairs(ids, e)):
        assert dst[pairs].tolist() == list(range(start, start + len(pairs)))
        assert psum[expert] == start + len(pairs)
        start = -(-int(psum[expert]) // 128) * 128  # the kernel's start of the next expert
    valid = (ids.view(-1) >= 0) & (ids.view(-1) < e)
    assert (dst[~valid] == -1).all()
    assert layout.num_rows % 128 == 0 and layout.num_rows >= start


# -- row quantizer and reduction --------------------------------------------------------------------------


def _assert_quantized_like_reference(q: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, exact: bool) -> None:
    """q [n, K] e4m3 and scales [n, G] against the reference quantizer of x [n, K] float32."""
    ref_q, ref_scales = per_token_group_quant_fp8(x)
    if exact:
        assert torch.equal(scales, ref_scales) and torch.equal(q.float(), ref_q.float())
        return
    torch.testing.assert_close(scales, ref_scales, rtol=1e-5, atol=0)
    one_step = ref_q.float().abs() * 2.0**-3 + 2.0**-9
    assert ((q.float() - ref_q.float()).abs() <= one_step).all()


def test_quantize_rows_scatters_tokens(kernels) -> None:
    t, k, e, h = 6, 3, 8, 300
    ids = _ids(t, k, e, dropped=2)
    layout = kernels.masked_layout(ids.to(DEVICE), e, 128)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, scales = kernels.quantize_rows(x.to(DEVICE), layout.dst, e, 128, top_k=k)
    groups = -(-h // 128)
    assert q.shape == (e, 128, h) and q.dtype == torch.float8_e4m3fn and scales.shape == (e, 128, groups)
    assert scales.stride() == (groups * 128, 1, 128)  # MN-major, TMA-aligned, groups packed
    dst = layout.dst.cpu()
    pairs = (dst >= 0).nonzero().view(-1)
    rows = dst[pairs].long()
    _assert_quantized_like_reference(q.cpu().view(-1, h)[rows], scales.cpu().reshape(-1, groups)[rows],
                                     x.float()[pairs // k], exact=True)


def test_quantize_rows_silu_mul(kernels) -> None:
    """Row dst[p] of a [rows, 2I] gate-up output -> silu(gate) * up, quantized, in the same row."""
    rows, i = 256, 200
    dst = torch.tensor([5, -1, 0, 130, 77], dtype=torch.int32)
    gate_up = (torch.randn(rows, 2 * i, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    q, scales = kernels.quantize_rows(gate_up.to(DEVICE), dst.to(DEVICE), 1, rows, silu_mul=True)
    assert q.shape == (1, rows, i) and scales.shape == (1, rows, 2) and scales.stride()[1:] == (1, rows)
    used = dst[dst >= 0].long()
    g32 = gate_up.float()[used]
    _assert_quantized_like_reference(q[0].cpu()[used], scales[0].cpu()[used],
                                     F.silu(g32[:, :i]) * g32[:, i:], exact=False)


def test_topk_reduce(kernels) -> None:
    t, k, rows, h = 4, 3, 50, 130
    g = torch.Generator().manual_seed(3)
    y = torch.randn(rows, h, generator=g).to(torch.bfloat16)
    dst = torch.randint(0, rows, (t * k,), generator=g, dtype=torch.int32)
    dst[4] = -1
    weights = torch.rand(t, k, generator=g)
    out = kernels.topk_reduce(y.to(DEVICE), dst.to(DEVICE), weights.to(DEVICE), RSF, torch.bfloat16)
    terms = y.float()[dst.clamp(min=0).long()].view(t, k, h) * weights.unsqueeze(-1)
    terms[1, 1] = 0  # pair 4 = token 1, slot 1 is dropped
    expected = (RSF * terms.sum(1)).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=1e-2, atol=1e-2)


# -- the backend --------------------------------------------------------------------------------------


@pytest.fixture
def backend(kernels, monkeypatch: pytest.MonkeyPatch) -> DeepGemmMoE:
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm)
    return DeepGemmMoE(SPEC, DEVICE)


def _experts(spec: MoESpec, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    quantized13 = [quantize_block_fp8(w) for w in torch.randn(e, 2 * i, h, generator=g) / h**0.5]
    quantized2 = [quantize_block_fp8(w) for w in torch.randn(e, h, i, generator=g) / i**0.5]
    return (torch.stack([q for q, _ in quantized13]), torch.stack([q for q, _ in quantized2]),
            torch.stack([s for _, s in quantized13]), torch.stack([s for _, s in quantized2]))


@pytest.mark.parametrize("t,contiguous", [(1, False), (9, False), (9, True), (40, True)])
def test_forward_matches_reference(backend: DeepGemmMoE, t: int, contiguous: bool) -> None:
    if contiguous:
        backend.masked_max_tokens = 0  # take the contiguous (prefill) path at this small size
    w13, w2, s13, s2 = _experts(SPEC)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, SPEC.hidden_size, generator=g).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(t, ROUTER.num_experts, generator=g), ROUTER,
                                  torch.randn(ROUTER.num_experts, generator=g) * 0.1)
    packed = backend.prepare(MoEWeights(*(w.to(DEVICE) for w in (w13, w2, s13, s2))))
    out = backend.forward(x.to(DEVICE), packed, ids.to(DEVICE), weights.to(DEVICE), RSF)
    expected = fused_experts_reference(x, w13, w2, ids, weights, RSF, s13, s2)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert_close(out.cpu(), expected, torch.bfloat16, f"deepgemm moe t{t} {'contiguous' if contiguous else 'masked'}")


@pytest.mark.parametrize("contiguous", [False, True])
def test_dropped_ids_contribute_nothing(backend: DeepGemmMoE, contiguous: bool) -> None:
    if contiguous:
        backend.masked_max_tokens = 0
    t = 6
    w13, w2, s13, s2 = _experts(SPEC, seed=1)
    x = torch.randn(t, SPEC.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ids = _ids(t, ROUTER.top_k, ROUTER.num_experts, seed=5, dropped=7)
    weights = torch.rand(t, ROUTER.top_k, generator=torch.Generator().manual_seed(6))
    packed = backend.prepare(MoEWeights(*(w.to(DEVICE) for w in (w13, w2, s13, s2))))
    out = backend.forward(x.to(DEVICE), packed, ids.to(DEVICE), weights.to(DEVICE), RSF)
    dropped = (ids < 0) | (ids >= ROUTER.num_experts)
    expected = fused_experts_reference(x, w13, w2, ids.masked_fill(dropped, 0), weights.masked_fill(dropped, 0), RSF,
                                       s13, s2)
    assert_close(out.cpu(), expected, torch.bfloat16, "dropped expert ids")


def test_route_is_the_fused_router(backend: DeepGemmMoE) -> None:
    logits, bias = torch.randn(7, ROUTER.num_experts), torch.randn(ROUTER.num_experts) * 0.1
    weights, ids = backend.route(logits.to(DEVICE), bias.to(DEVICE))
    ref_weights, ref_ids = select_experts(logits, ROUTER, bias)
    assert ids.dtype == torch.int32
    ids_sorted, order = ids.cpu().long().sort(dim=1)
    ref_sorted, ref_order = ref_ids.long().sort(dim=1)
    assert torch.equal(ids_sorted, ref_sorted)
    torch.testing.assert_close(weights.cpu().gather(1, order), ref_weights.gather(1, ref_order))


def test_empty_batch_and_argument_checks(backend: DeepGemmMoE) -> None:
    w13, w2, s13, s2 = _experts(SPEC)
    packed = backend.prepare(MoEWeights(*(w.to(DEVICE) for w in (w13, w2, s13, s2))))
    empty = torch.empty(0, SPEC.hidden_size, dtype=torch.bfloat16, device=DEVICE)
    no_ids = torch.empty(0, ROUTER.top_k, dtype=torch.int32, device=DEVICE)
    assert backend.forward(empty, packed, no_ids, no_ids.float(), RSF).shape == (0, SPEC.hidden_size)
    with pytest.raises(ValueError, match="x must be"):
        backend.forward(empty.float(), packed, no_ids, no_ids.float(), RSF)
    with pytest.raises(ValueError, match="need w13_scale_inv and w2_scale_inv"):
        backend.prepare(MoEWeights(w13, w2))
    with pytest.raises(ValueError, match="w13 must be"):
        backend.prepare(MoEWeights(w13.float(), w2, s13, s2))


def test_layout_follows_the_batch_size(backend: DeepGemmMoE, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to MASKED_MAX_TOKENS tokens the masked GEMMs run, beyond them the contiguous ones."""
    calls: list[str] = []
    for name in ("m_grouped_fp8_gemm_nt_masked", "m_grouped_fp8_gemm_nt_contiguous"):
        monkeypatch.setattr(fake_deep_gemm, name,
                            lambda a, b, d, *args, name=name, **kwargs: (calls.append(name), d.zero_()))
    w13, w2, s13, s2 = _experts(SPEC)
    packed = backend.prepare(MoEWeights(*(w.to(DEVICE) for w in (w13, w2, s13, s2))))
    for t in (MASKED_MAX_TOKENS, MASKED_MAX_TOKENS + 1):
        x = torch.zeros(t, SPEC.hidden_size, dtype=torch.bfloat16, device=DEVICE)
        ids = _ids(t, ROUTER.top_k, ROUTER.num_experts).to(DEVICE)
        backend.forward(x, packed, ids, torch.ones(t, ROUTER.top_k, device=DEVICE), RSF)
    assert calls == ["m_grouped_fp8_gemm_nt_masked"] * 2 + ["m_grouped_fp8_gemm_nt_contiguous"] * 2
