"""Every FP8 GEMM backend declares `cuda_graph`, and its `apply` / `quantize_activation` read no tensor
contents on the host (tests/plugins/graph_safety.py), the libraries that cannot run here replaced by
stand-ins outside the check: DeepGEMM by tests/plugins/fake_deep_gemm.py, the CUTLASS extension and torch's
scaled_mm by a float32 product. On a GPU, each backend available there is also captured in a CUDA graph and
replayed on new inputs. Without a GPU the Triton quantizer runs in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 before Triton is imported)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import Fp8GemmBackend
from plugserve.core.layers.quant import dequantize_block_fp8, quantize_block_fp8
from plugserve.core.specs import GemmSpec
from plugserve.plugins.gemm.triton import TritonFp8Gemm, default_config
from plugserve.registry import Registry
from tests.plugins import fake_deep_gemm
from tests.plugins.graph_safety import assert_replays, no_host_reads, outside_check

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
KERNELS_HERE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ("torch_ref", "triton", "deepgemm", "cutlass", "torch_scaled_mm")
N, K = 256, 384


def _registry() -> Registry:
    return Registry(builtin=tuple(f"plugserve.plugins.gemm.{name}" for name in BACKENDS), entry_points=False)


def test_every_backend_declares_cuda_graph() -> None:
    registry = _registry()
    assert not registry.broken
    for name in BACKENDS:
        assert registry.get("gemm", name).cls.capabilities.cuda_graph, name


def _float32_product(x_q: torch.Tensor, x_scales: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor
                     ) -> torch.Tensor:
    """x_q [M, K] e4m3 with scales [M, K/128], w_q [N, K] e4m3 with [N/128, K/128] -> [M, N] float32."""
    return dequantize_block_fp8(x_q, x_scales, (1, 128)) @ dequantize_block_fp8(w_q, w_scales).T


@pytest.fixture
def make_backend(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Fp8GemmBackend]:
    """name -> a bfloat16 backend on DEVICE, with stand-ins for the libraries (outside the check)."""
    if not KERNELS_HERE:
        pytest.skip("the Triton quantizer needs a GPU or TRITON_INTERPRET=1")
    registry = _registry()
    spec = GemmSpec(torch.bfloat16)

    def make(name: str) -> Fp8GemmBackend:
        cls = registry.get("gemm", name).cls
        if name == "deepgemm":
            monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm)
            monkeypatch.setattr(fake_deep_gemm, "fp8_gemm_nt", outside_check(fake_deep_gemm.fp8_gemm_nt))
        if name == "torch_scaled_mm":
            def scaled_mm(x_q, w_t, x_scales, _recipe_a, w_scales, _recipe_b, *, output_dtype):
                kb = x_scales.shape[1]
                return _float32_product(x_q, x_scales, w_t.t(), w_scales[:kb].t()).to(output_dtype)

            monkeypatch.setattr(sys.modules[cls.__module__].F, "scaled_mm", outside_check(scaled_mm))
        if name == "cutlass":  # its constructor builds the extension: put the stand-in in its place
            backend = object.__new__(cls)
            Fp8GemmBackend.__init__(backend, spec, DEVICE)

            def gemm(x_q, x_scales, w_q, w_scales, out):
                out.copy_(_float32_product(x_q, x_scales, w_q, w_scales))

            backend.kernels = SimpleNamespace(gemm_64x128=outside_check(gemm), gemm_128x128=outside_check(gemm))
            return backend
        return cls(spec, DEVICE)

    return make


def _weight(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quantize_block_fp8(torch.randn(N, K, generator=g) / K**0.5)


@pytest.mark.parametrize("m", [1, 70])  # 70: past cutlass's 64-row tiles, M not a multiple of 4
@pytest.mark.parametrize("name", BACKENDS)
def test_apply_reads_no_tensor_contents_on_the_host(make_backend, name: str, m: int) -> None:
    backend = make_backend(name)
    packed = backend.prepare(*(t.to(DEVICE) for t in _weight()))
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    eager = backend.apply(x, packed)
    with no_host_reads():
        out = backend.apply(x, packed)
        x_q, scales = backend.quantize_activation(x)
    assert out.shape == (m, N) and torch.equal(out, eager)
    assert x_q.shape == (m, K) and scales.shape == (m, K // 128)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("m", [1, 70])
@pytest.mark.parametrize("name", BACKENDS)
def test_apply_replays_in_a_cuda_graph(name: str, m: int) -> None:
    cls = _registry().get("gemm", name).cls
    available = cls.availability(Hardware.detect(DEVICE))
    if not available:
        pytest.skip(f"{name}: {available.reason}")
    backend = cls(GemmSpec(torch.bfloat16), DEVICE)
    packed = backend.prepare(*(t.to(DEVICE) for t in _weight()))
    g = torch.Generator().manual_seed(m)
    x, new_x = (torch.randn(m, K, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    assert_replays(lambda x: backend.apply(x, packed), [x], [new_x])
    assert_replays(backend.quantize_activation, [x], [new_x])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_triton_split_k_rearms_across_replays() -> None:
    """Split-K's per-tile arrival counts are zeroed again inside every replay: each of several replays on new
    inputs finds its tiles' last programs and matches the eager product."""
    backend = TritonFp8Gemm(GemmSpec(torch.bfloat16), DEVICE)
    packed = backend.prepare(*(t.to(DEVICE) for t in _weight()))
    packed = dataclasses.replace(packed, configs={1: default_config(1) | {"BLOCK_SIZE_N": 64, "SPLIT_K": 3}})
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, K, generator=g).to(DEVICE, torch.bfloat16) for _ in range(4)]
    static = inputs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.apply(static, packed)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = backend.apply(static, packed)
    for x in inputs[1:]:
        static.copy_(x)
        graph.replay()
        torch.testing.assert_close(captured, backend.apply(x, packed), rtol=0, atol=0)
