"""BatchInvariantMode: a row's matmul, last-dim reduction and transcendental results do not depend on the rows beside
it (bit for bit), and stay within rounding of a float64 computation."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from plugserve.core.batch_invariant import active, batch_invariant


def _alone_equals_together(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """fn's row i of x [M, ...] equals fn of x[i:i+1] for every i, and of prefixes x[:m] of every size."""
    with torch.inference_mode(), batch_invariant():
        whole = fn(x)
        alone = all(torch.equal(whole[i], fn(x[i : i + 1])[0]) for i in range(x.shape[0]))
        prefixes = all(torch.equal(whole[:m], fn(x[:m])) for m in range(1, x.shape[0]))
    return alone and prefixes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_rows_do_not_depend_on_the_rows_beside_them(dtype):
    torch.manual_seed(0)
    w, x = torch.randn(96, 200, dtype=dtype), torch.randn(37, 200, dtype=dtype)
    heads = torch.randn(4, 200, 24, dtype=dtype)
    assert _alone_equals_together(lambda t: t @ w.T, x)
    assert _alone_equals_together(lambda t: F.linear(t, w, torch.ones(96, dtype=dtype)), x)
    assert _alone_equals_together(lambda t: torch.einsum("tk,hkd->thd", t, heads), x)
    with torch.inference_mode(), batch_invariant():
        out = F.linear(x, w)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=tol, atol=tol * 20)


@pytest.mark.parametrize("op", [
    lambda t: t.sum(dim=-1), lambda t: t.mean(-1, keepdim=True), lambda t: t.softmax(-1),
    lambda t: F.log_softmax(t, -1), torch.sigmoid, torch.exp, F.silu, lambda t: t.clone().sigmoid_(),
], ids=["sum", "mean", "softmax", "log_softmax", "sigmoid", "exp", "silu", "sigmoid_"])
def test_row_wise_ops_do_not_depend_on_the_rows_beside_them(op):
    torch.manual_seed(0)
    x = torch.randn(37, 6)  # a short last dim: what a router's top-k and an 8-expert gate give
    assert _alone_equals_together(op, x)
    with torch.inference_mode(), batch_invariant():
        out = op(x)
    torch.testing.assert_close(out.double(), op(x.double()), rtol=1e-6, atol=1e-6)


def test_the_mode_is_this_threads_only():
    seen = []
    with batch_invariant():
        assert active()
        thread = threading.Thread(target=lambda: seen.append(active()))
        thread.start()
        thread.join()
    assert seen == [False] and not active()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matmuls_take_the_triton_kernel_and_are_row_invariant_in_bf16(monkeypatch):
    """On CUDA the mode's matmuls run `batch_invariant_matmul`'s kernel (not the row-at-a-time product): a row's
    bits alone, in a batch of 70 and in its prefixes are the same, within bf16 rounding of a float64 product."""
    from plugserve.core import batch_invariant_matmul

    entries = []
    kernel = batch_invariant_matmul.bmm
    monkeypatch.setattr(batch_invariant_matmul, "bmm", lambda a, *args: entries.append(a.shape[0]) or kernel(a, *args))
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, torch.device("cuda")
    w = torch.randn(576, 2048, dtype=dtype, device=device) / 32
    bias = torch.randn(576, dtype=dtype, device=device)
    heads = torch.randn(16, 128, 512, dtype=dtype, device=device) / 8
    x = torch.randn(70, 2048, dtype=dtype, device=device)
    assert _alone_equals_together(lambda t: F.linear(t, w, bias), x)
    assert _alone_equals_together(lambda t: torch.einsum("thd,hdr->thr", t, heads), x[:, :128].unsqueeze(1)
                                  .expand(70, 16, 128).contiguous())
    assert entries, "the Triton kernel did not run"
    with torch.inference_mode(), batch_invariant():
        out = F.linear(x, w, bias)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T + bias.double(), rtol=1.6e-2, atol=3e-2)
