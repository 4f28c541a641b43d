"""The batch-invariant Triton matmul (`batch_invariant_matmul`): mm / addmm / bmm / baddbmm against a float64
product, a row's bits alone, in a batch of 70 and in batches of other sizes, and `BatchInvariantMode` choosing it for
CUDA tensors (the row-at-a-time product for CPU ones).

Without a GPU the kernel runs in Triton's interpreter, in fp16 / fp32 only (the interpreter's bf16 tl.dot is wrong);
bf16 on the GPU is in tests/core/test_batch_invariant.py.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from plugserve.core import batch_invariant
from plugserve.core.batch_invariant import ROWS, TRITON, matmul_path
from tests.interpreter import interpreter_child, kernels_fixture

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if ON_GPU else [])]
K, N = 96, 80  # K not a whole number of K steps (the masked last step), N not a whole number of column tiles
LONG_K = 300  # two whole K steps and a masked one
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

kernels = kernels_fixture("plugserve.core.batch_invariant_matmul")
test_kernels_in_the_interpreter = interpreter_child(__file__)


def _randn(*shape: int, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
    """A [*shape] tensor; `transposed`: a view of its last two dims' transpose (strides of a weight's `.t()`)."""
    if transposed:
        return torch.randn(*shape[:-2], shape[-1], shape[-2], device=DEVICE).to(dtype).transpose(-1, -2)
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 64, 70])
@pytest.mark.parametrize("transposed", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("k", [K, LONG_K])
def test_mm_and_addmm_equal_a_float64_product(kernels: ModuleType, dtype: torch.dtype, m: int, transposed: bool,
                                              k: int):
    torch.manual_seed(m)
    a, b = _randn(m, k, dtype=dtype, transposed=transposed), _randn(k, N, dtype=dtype, transposed=not transposed)
    exact = a.double() @ b.double()
    out = kernels.mm(a, b)
    assert out.shape == (m, N) and out.dtype == dtype
    _close(out, exact)
    bias, full_bias = torch.randn(N, device=DEVICE).to(dtype), torch.randn(m, N, device=DEVICE).to(dtype)
    _close(kernels.mm(a, b, bias), exact + bias.double())
    _close(kernels.mm(a, b, full_bias, beta=0.5, alpha=2.0), 2.0 * exact + 0.5 * full_bias.double())
    # beta 0 ignores the bias, NaNs included (as torch's addmm)
    _close(kernels.mm(a, b, torch.full_like(bias, float("nan")), beta=0.0), exact)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 70])
def test_bmm_and_baddbmm_equal_a_float64_product(kernels: ModuleType, dtype: torch.dtype, m: int):
    torch.manual_seed(m)
    # a as absorbed MLA passes it: [heads, tokens, K] as a transposed view of [tokens, heads, K]
    a = torch.randn(m, 3, K, device=DEVICE).to(dtype).transpose(0, 1)
    b = _randn(3, K, N, dtype=dtype, transposed=True)
    exact = a.double() @ b.double()
    out = kernels.bmm(a, b)
    assert out.shape == (3, m, N) and out.dtype == dtype
    _close(out, exact)
    bias = torch.randn(m, N, device=DEVICE).to(dtype)  # broadcast over the batch entries
    _close(kernels.bmm(a, b, bias, beta=-1.0, alpha=0.5), 0.5 * exact - bias.double())


def test_shapes_and_dtypes_it_does_not_take_are_refused(kernels: ModuleType):
    a = torch.randn(2, 4, K, device=DEVICE)
    with pytest.raises(ValueError, match="do not chain"):
        kernels.bmm(a, torch.randn(2, K + 1, N, device=DEVICE))
    with pytest.raises(ValueError, match="one dtype"):
        kernels.bmm(a, torch.randn(2, K, N, device=DEVICE, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_bits_do_not_depend_on_the_batch(kernels: ModuleType, dtype: torch.dtype):
    torch.manual_seed(0)
    x = torch.randn(70, LONG_K, device=DEVICE).to(dtype)
    w = torch.randn(N, LONG_K, device=DEVICE).to(dtype)  # a linear's weight: b = w.t()
    bias = torch.randn(N, device=DEVICE).to(dtype)
    heads = _randn(2, LONG_K, N, dtype=dtype, transposed=True)
    others = torch.randn(130, LONG_K, device=DEVICE).to(dtype)
    for run in (lambda t: kernels.mm(t, w.t()), lambda t: kernels.mm(t, w.t(), bias),
                lambda t: kernels.bmm(t.expand(2, *t.shape), heads).transpose(0, 1)):
        whole = run(x)
        for i in (0, 1, 37, 63, 64, 69):
            assert torch.equal(run(x[i : i + 1])[0], whole[i])  # alone
            # at another position of a batch of another size (another row tile, another place in its tile)
            for at, size in ((5, 9), (100, 130)):
                batch = others[:size].clone()
                batch[at] = x[i]
                assert torch.equal(run(batch)[at], whole[i])


def test_the_mode_takes_the_triton_kernel_for_cuda_and_rows_for_the_cpu():
    bf16, f32 = torch.bfloat16, torch.float32
    assert matmul_path(torch.device("cuda", 0), (bf16, bf16)) == TRITON
    assert matmul_path(torch.device("cuda"), (f32, f32, f32)) == TRITON
    assert matmul_path(torch.device("cpu"), (bf16, bf16)) == ROWS
    assert matmul_path(torch.device("cuda"), (bf16, f32)) == ROWS  # mixed: torch's own error on the row path
    assert matmul_path(torch.device("cuda"), (torch.int32, torch.int32)) == ROWS


def test_the_mode_runs_its_matmuls_through_the_kernel_where_the_path_says_so(kernels: ModuleType, monkeypatch):
    """Every matmul the mode sees goes to the kernel (`kernels.bmm`, which `kernels.mm` calls; with addmm's bias,
    beta and alpha) when `matmul_path` says TRITON, as it says on CUDA; here on the CPU, interpreted."""
    entries = []
    kernel = kernels.bmm
    monkeypatch.setattr(kernels, "bmm", lambda a, *args: entries.append(a.shape[0]) or kernel(a, *args))
    monkeypatch.setattr(batch_invariant, "matmul_path", lambda device, dtypes: TRITON)
    torch.manual_seed(0)
    x, w, bias = torch.randn(5, K, device=DEVICE), torch.randn(N, K, device=DEVICE), torch.randn(N, device=DEVICE)
    heads = torch.randn(3, K, N, device=DEVICE)
    with torch.inference_mode(), batch_invariant.batch_invariant():
        linear = F.linear(x, w, bias)
        scaled = torch.addmm(bias, x, w.t(), beta=0.5, alpha=2.0)
        einsum = torch.einsum("tk,hkn->thn", x, heads)
        baddbmm = torch.baddbmm(bias, x.expand(3, 5, K), heads)
    assert entries == [1, 1, 1, 3]  # einsum: one product with the heads folded into its columns
    assert torch.equal(linear, kernels.mm(x, w.t(), bias))
    assert torch.equal(scaled, kernels.mm(x, w.t(), bias, 0.5, 2.0))
    _close(einsum, torch.einsum("tk,hkn->thn", x.double(), heads.double()))
    _close(baddbmm, x.double() @ heads.double() + bias.double())
