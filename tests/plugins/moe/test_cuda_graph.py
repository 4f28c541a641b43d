"""`cuda_graph` of the MoE backends against what their `route` / `forward` do: `triton` and `deepgemm` read no
tensor contents on the host (tests/plugins/graph_safety.py; DeepGEMM replaced by tests/plugins/fake_deep_gemm.py
outside the check) and give DeepGEMM an expected_m from the shapes alone; `torch_ref`, which loops over the
experts it finds, declares False and does read them. On a GPU, the available backends are also captured in a
CUDA graph, router included, and replayed on new inputs. Without a GPU the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import MoEBackend, MoEWeights
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import MoESpec, RouterConfig
from plugserve.plugins.moe.configs import GemmConfig, MoEConfig
from plugserve.plugins.moe.deepgemm import DeepGemmMoE
from plugserve.plugins.moe.torch_ref import TorchRefMoE
from plugserve.plugins.moe.triton import TritonMoE
from tests.plugins import fake_deep_gemm
from tests.plugins.graph_safety import HostReadError, assert_replays, no_host_reads, outside_check

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
KERNELS_HERE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
ROUTER = RouterConfig(16, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True)
RSF = 2.5  # routed_scaling_factor
needs_kernels = pytest.mark.skipif(not KERNELS_HERE, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
# The w13 pass's K cut into 4 runs (a decode config's SPLIT_K): a float32 workspace and the shared arrival counts.
SPLIT_K_CONFIG = MoEConfig(16, GemmConfig(32, 128, 1, 4, 3, split_k=4), GemmConfig(64, 128, 1, 4, 3))


def test_declarations() -> None:
    assert TritonMoE.capabilities.cuda_graph and DeepGemmMoE.capabilities.cuda_graph
    assert not TorchRefMoE.capabilities.cuda_graph


def _experts(spec: MoESpec, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(w13, w2) of spec.dtype, or (w13, w2, w13_scale_inv, w2_scale_inv) block-FP8, on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5
    if not spec.is_fp8:
        return w13.to(DEVICE, spec.dtype), w2.to(DEVICE, spec.dtype)
    q13, q2 = [quantize_block_fp8(w) for w in w13], [quantize_block_fp8(w) for w in w2]
    stacked = [torch.stack([q for q, _ in q13]), torch.stack([q for q, _ in q2]),
               torch.stack([s for _, s in q13]), torch.stack([s for _, s in q2])]
    return tuple(t.to(DEVICE) for t in stacked)


def _inputs(spec: MoESpec, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [t, H] of spec.dtype, router logits [t, E] float32, correction bias [E] (noaux_tc)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, spec.hidden_size, generator=g).to(DEVICE, spec.dtype),
            torch.randn(t, spec.num_experts, generator=g).to(DEVICE),
            (torch.randn(spec.num_experts, generator=g) * 0.1).to(DEVICE))


def _route_and_forward(backend: MoEBackend, packed, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor,
                       drop_every: int = 0) -> torch.Tensor:
    weights, ids = backend.route(logits, bias)
    if drop_every:  # ids of another rank's experts: dropped
        ids = torch.where(torch.arange(ids.numel(), device=ids.device).view(ids.shape) % drop_every == 0, -1, ids)
    return backend.forward(x, packed, ids, weights, RSF)


@needs_kernels
@pytest.mark.parametrize(("dtype", "fp8", "shared", "t", "split_k"),
                         [(torch.float32, False, False, 5, False), (torch.float16, True, True, 3, False),
                          (torch.float16, True, False, 1, True)])
def test_triton_reads_no_tensor_contents_on_the_host(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, fp8: bool,
                                                     shared: bool, t: int, split_k: bool) -> None:
    spec = MoESpec(128, 128, dtype, torch.float8_e4m3fn if fp8 else None, router=ROUTER,
                   num_shared_experts=1 if shared else 0)
    backend = TritonMoE(spec, DEVICE)
    if split_k:
        monkeypatch.setattr(backend, "config", lambda num_tokens: SPLIT_K_CONFIG)
    experts = _experts(spec)
    fused = {}
    if shared:
        g = torch.Generator().manual_seed(3)
        w13, w2 = quantize_block_fp8(torch.randn(256, 128, generator=g)), quantize_block_fp8(torch.randn(128, 128))
        fused = {"shared_w13": w13[0].to(DEVICE), "shared_w2": w2[0].to(DEVICE),
                 "shared_w13_scale_inv": w13[1].to(DEVICE), "shared_w2_scale_inv": w2[1].to(DEVICE)}
    packed = backend.prepare(MoEWeights(*experts, **fused))
    x, logits, bias = _inputs(spec, t, seed=t)
    eager = _route_and_forward(backend, packed, x, logits, bias, drop_every=3)
    with no_host_reads():
        out = _route_and_forward(backend, packed, x, logits, bias, drop_every=3)
    assert torch.equal(out, eager)


@pytest.fixture
def deepgemm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fake deep_gemm, its grouped GEMMs run outside the check; returns the expected_m values they get."""
    if not KERNELS_HERE:
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm)
    seen: list[int] = []
    run_masked = fake_deep_gemm.m_grouped_fp8_gemm_nt_masked
    run_contiguous = fake_deep_gemm.m_grouped_fp8_gemm_nt_contiguous

    def masked(a, b, d, masked_m, expected_m):
        seen.append(expected_m)
        run_masked(a, b, d, masked_m, expected_m)

    def contiguous(a, b, d, grouped_layout, *, use_psum_layout, expected_m_for_psum_layout):
        seen.append(expected_m_for_psum_layout)
        run_contiguous(a, b, d, grouped_layout, use_psum_layout=use_psum_layout,
                       expected_m_for_psum_layout=expected_m_for_psum_layout)

    monkeypatch.setattr(fake_deep_gemm, "m_grouped_fp8_gemm_nt_masked", outside_check(masked))
    monkeypatch.setattr(fake_deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", outside_check(contiguous))
    return seen


@pytest.mark.parametrize("contiguous", [False, True])
def test_deepgemm_reads_no_tensor_contents_and_expects_rows_by_shape(deepgemm: list[int], contiguous: bool) -> None:
    spec = MoESpec(256, 128, torch.bfloat16, torch.float8_e4m3fn, router=ROUTER)
    backend = DeepGemmMoE(spec, DEVICE)
    if contiguous:
        backend.masked_max_tokens = 0  # take the contiguous (prefill) path at this small size
    packed = backend.prepare(MoEWeights(*_experts(spec)))
    t, k = 6, ROUTER.top_k
    x, logits, bias = _inputs(spec, t, seed=1)
    eager = _route_and_forward(backend, packed, x, logits, bias, drop_every=5)
    with no_host_reads():
        out = _route_and_forward(backend, packed, x, logits, bias, drop_every=5)
        # Every token on the same k experts: other ids, the same shapes, so the same expected_m.
        same = torch.arange(k, dtype=torch.int32, device=DEVICE).expand(t, k).contiguous()
        backend.forward(x, packed, same, torch.full((t, k), 0.25, device=DEVICE), RSF)
    assert torch.equal(out, eager)
    expected_m = -(-t * k // min(ROUTER.num_experts, t * k))
    assert deepgemm == [expected_m] * 6, "two GEMMs per forward, each told the rows an expert gets on average"


def test_torch_ref_reads_the_experts_on_the_host() -> None:
    """Why the reference declares cuda_graph=False: its forward lists the experts in use on the host."""
    spec = MoESpec(128, 64, torch.float32, None, router=ROUTER)
    backend = TorchRefMoE(spec, DEVICE)
    packed = backend.prepare(MoEWeights(*_experts(spec)))
    x, logits, bias = _inputs(spec, 3, seed=0)
    with no_host_reads():
        weights, ids = backend.route(logits, bias)  # the router alone would be capturable
        with pytest.raises(HostReadError):
            backend.forward(x, packed, ids, weights, RSF)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [1, 40])
@pytest.mark.parametrize("name", ["triton", "deepgemm"])
def test_route_and_forward_replay_in_a_cuda_graph(name: str, t: int) -> None:
    cls = {"triton": TritonMoE, "deepgemm": DeepGemmMoE}[name]
    available = cls.availability(Hardware.detect(DEVICE))
    if not available:
        pytest.skip(f"{name}: {available.reason}")
    spec = MoESpec(256, 128, torch.bfloat16, torch.float8_e4m3fn, router=ROUTER)
    fits = cls.capabilities.check(spec, Phase.DECODE)
    if not fits:
        pytest.skip(f"{name}: {fits.reason}")
    backend = cls(spec, DEVICE)
    packed = backend.prepare(MoEWeights(*_experts(spec)))
    x, logits, bias = _inputs(spec, t, seed=0)
    new_x, new_logits, _ = _inputs(spec, t, seed=1)
    assert_replays(lambda x, logits: _route_and_forward(backend, packed, x, logits, bias), [x, logits],
                   [new_x, new_logits])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [1, 40])
def test_triton_split_k_replays_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch, t: int) -> None:
    spec = MoESpec(256, 128, torch.bfloat16, torch.float8_e4m3fn, router=ROUTER)
    backend = TritonMoE(spec, DEVICE)
    monkeypatch.setattr(backend, "config", lambda num_tokens: SPLIT_K_CONFIG)
    packed = backend.prepare(MoEWeights(*_experts(spec)))
    x, logits, bias = _inputs(spec, t, seed=0)
    new_x, new_logits, _ = _inputs(spec, t, seed=1)
    assert_replays(lambda x, logits: _route_and_forward(backend, packed, x, logits, bias), [x, logits],
                   [new_x, new_logits])
