"""GEMM and MoE by row buckets: each call runs the backend of its row count's bucket on that backend's own pack,
and the bytes the extra packs add are counted."""

from __future__ import annotations

import pytest
import torch

from plugserve.conformance import oracle
from plugserve.core.interfaces import MoEWeights
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import GemmSpec, MoESpec, RouterConfig
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm
from plugserve.plugins.gemm.triton import TritonFp8Gemm
from plugserve.plugins.moe.torch_ref import TorchRefMoE
from plugserve.plugins.moe.triton import TritonMoE
from plugserve.runtime.row_buckets import Bucket, ByRows, GemmByRows, MoEByRows, in_bucket, merged

CPU = torch.device("cpu")
ROUTER = RouterConfig(16, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True)


def _spied(backend, method: str, calls: list[tuple[str, int]], monkeypatch) -> None:
    real = getattr(backend, method)
    monkeypatch.setattr(backend, method, lambda x, *args: calls.append((backend.name, x.shape[0])) or real(x, *args))


def test_merged_buckets_and_lookup():
    a, b = object(), object()
    buckets = merged([Bucket(1, a), Bucket(8, a), Bucket(64, b), Bucket(512, a)])
    assert [(x.max_size, x.backend) for x in buckets] == [(8, a), (64, b), (512, a)]
    assert [in_bucket(buckets, n) for n in (1, 8, 9, 64, 65, 4096)] == [a, a, b, b, a, a]


def test_gemm_runs_each_row_count_on_its_buckets_backend(monkeypatch):
    spec = GemmSpec(dtype=torch.float16)
    triton, ref = TritonFp8Gemm(spec, CPU), TorchRefFp8Gemm(spec, CPU)
    gemm = GemmByRows([Bucket(2, triton), Bucket(8, triton), Bucket(64, ref)])
    assert gemm.name == "triton+torch_ref" and gemm.rows.describe() == "triton up to 8 rows, torch_ref above"
    weight, scale = quantize_block_fp8(torch.randn(256, 128, generator=torch.Generator().manual_seed(0)), (128, 128))
    packed = gemm.prepare(weight, scale)
    # triton reads the checkpoint's tensors as they are; the reference keeps a dequantized float32 copy.
    assert packed["triton"].weight.data_ptr() == weight.data_ptr()
    assert gemm.rows.extra_bytes == 256 * 128 * 4
    calls: list[tuple[str, int]] = []
    for backend in (triton, ref):
        _spied(backend, "apply", calls, monkeypatch)
    for m in (1, 8, 9, 100):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).half()
        out = gemm.apply(x, packed)
        expected = oracle.fp8_gemm(x.double(), weight, scale, (128, 128))
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    assert calls == [("triton", 1), ("triton", 8), ("torch_ref", 9), ("torch_ref", 100)]


def test_moe_routes_and_runs_a_calls_tokens_on_one_backend(monkeypatch):
    spec = MoESpec(64, 32, torch.float16, None, router=ROUTER)
    triton, ref = TritonMoE(spec, CPU), TorchRefMoE(spec, CPU)
    moe = MoEByRows([Bucket(4, ref), Bucket(256, triton)])
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(16, 64, 64, generator=g) / 8, torch.randn(16, 64, 32, generator=g) / 6
    weights = MoEWeights(w13.half(), w2.half())
    packed = moe.prepare(weights)
    calls: list[tuple[str, int]] = []
    for backend in (triton, ref):
        _spied(backend, "route_hidden", calls, monkeypatch)
        _spied(backend, "forward", calls, monkeypatch)
    gate, bias = torch.randn(16, 64, generator=g).half(), torch.randn(16, generator=g) * 0.1
    for t in (3, 5):
        x = torch.randn(t, 64, generator=g).half()
        topk_weights, topk_ids = moe.route_hidden(x, gate, bias)
        out = moe.forward(x, packed, topk_ids, topk_weights, 2.5)
        expected = oracle.moe(x.double(), weights.w13.double(), weights.w2.double(), topk_ids, topk_weights, 2.5)
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    assert calls == [("torch_ref", 3)] * 2 + [("triton", 5)] * 2


def test_buckets_need_two_backends_of_one_spec():
    ref = TorchRefFp8Gemm(GemmSpec(dtype=torch.float16), CPU)
    with pytest.raises(ValueError, match="two backends"):
        ByRows([Bucket(8, ref), Bucket(64, ref)])
    other = TritonFp8Gemm(GemmSpec(dtype=torch.float32), CPU)
    with pytest.raises(ValueError, match="one spec"):
        ByRows([Bucket(8, ref), Bucket(64, other)])
