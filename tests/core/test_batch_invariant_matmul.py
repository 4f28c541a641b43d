"""The batch-invariant Triton matmul (`batch_invariant_matmul`): mm / addmm / bmm / baddbmm against a float64
product, unsplit and with K split (forced: the CPU's default is one split), a split product as its splits' float32
sums added in split order, a row's bits alone, in a batch of 70 and in batches of other sizes, the split count from
the weight's shape and the GPU alone, and `BatchInvariantMode` choosing the kernel for CUDA tensors (the row-at-a-time
product for CPU ones).

Without a GPU the kernel runs in Triton's interpreter, in fp16 / fp32 only (the interpreter's bf16 tl.dot is wrong);
bf16 on the GPU is in tests/core/test_batch_invariant.py.
"""

from __future__ import annotations

import inspect
import itertools
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("splits", "k"), [(1, LONG_K), (2, LONG_K), (3, LONG_K), (3, 768), (4, 500)],
                         ids=["1", "2-uneven", "3", "3-even", "4-masked"])
def test_split_products_equal_a_float64_product(kernels: ModuleType, dtype: torch.dtype, splits: int, k: int):
    torch.manual_seed(splits)
    a, b = _randn(70, k, dtype=dtype), _randn(k, N, dtype=dtype, transposed=True)
    exact = a.double() @ b.double()
    bias = torch.randn(N, device=DEVICE).to(dtype)
    _close(kernels.mm(a, b, splits=splits), exact)
    _close(kernels.mm(a, b, bias, beta=0.5, alpha=2.0, splits=splits), 2.0 * exact + 0.5 * bias.double())
    a3 = torch.randn(5, 3, k, device=DEVICE).to(dtype).transpose(0, 1)
    b3 = _randn(3, k, N, dtype=dtype)
    exact3 = a3.double() @ b3.double()
    _close(kernels.bmm(a3, b3, splits=splits), exact3)
    _close(kernels.bmm(a3, b3, bias, beta=-1.0, alpha=0.5, splits=splits), 0.5 * exact3 - bias.double())


@pytest.mark.parametrize(("splits", "k", "bounds"), [(3, LONG_K, (0, 128, 256, LONG_K)), (3, 700, (0, 256, 512, 700)),
                                                     (2, 640, (0, 384, 640))])
def test_a_split_product_is_its_splits_added_in_split_order(kernels: ModuleType, splits: int, k: int,
                                                           bounds: tuple[int, ...]):
    """float32: each split's sum is the one-split product of its K range (whole K steps from 0), stored unrounded;
    the splits' sums added in order 0, 1, ... in float32 are the split product, bit for bit."""
    torch.manual_seed(k)
    a, b = torch.randn(70, k, device=DEVICE), torch.randn(k, N, device=DEVICE)
    expected = torch.zeros(70, N, device=DEVICE)
    for lo, hi in itertools.pairwise(bounds):
        expected += kernels.mm(a[:, lo:hi], b[lo:hi], splits=1)
    assert torch.equal(kernels.mm(a, b, splits=splits), expected)


def test_the_split_count_comes_from_the_weights_shape_and_the_gpu_alone(kernels: ModuleType):
    assert list(inspect.signature(kernels.num_splits).parameters) == ["n", "k", "multiprocessors"]
    # V2-Lite's kv_a (9 column tiles, 16 K steps): 16 splits would fill 132 SMs; 8 keep 2 K steps a split
    assert kernels.num_splits(576, 2048, 132) == 8
    assert kernels.num_splits(576, 8192, 132) == 16  # the fewest whose programs fill the SMs
    assert kernels.num_splits(3072, 1536, 132) == 4  # 48 column tiles: 192 programs
    assert kernels.num_splits(2048, 2048, 132) == 8  # 32 column tiles: 4 splits leave 4 SMs idle
    assert kernels.num_splits(2048, 2048, 16) == 1  # the column tiles alone fill a smaller GPU
    assert kernels.num_splits(102400, 2048, 132) == 1  # an LM head
    assert kernels.num_splits(576, 300, 132) == 1  # too few K steps
    assert kernels.num_splits(576, 512, 132) == 2


def test_long_batches_go_through_in_slices_of_rows(kernels: ModuleType, monkeypatch):
    """A split call's workspace is bounded: rows go in slices (of one row tile here), each row as in one slice."""
    torch.manual_seed(0)
    a, b = torch.randn(70, LONG_K, device=DEVICE), torch.randn(LONG_K, N, device=DEVICE)
    bias = torch.randn(70, N, device=DEVICE)
    whole = kernels.mm(a, b, bias, beta=0.5, splits=3)
    monkeypatch.setattr(kernels, "WORKSPACE_ELEMENTS", 3 * N * kernels.BLOCK_M)
    assert torch.equal(kernels.mm(a, b, bias, beta=0.5, splits=3), whole)
    _close(whole, a.double() @ b.double() + 0.5 * bias.double())


def test_shapes_and_dtypes_it_does_not_take_are_refused(kernels: ModuleType):
    a = torch.randn(2, 4, K, device=DEVICE)
    with pytest.raises(ValueError, match="do not chain"):
        kernels.bmm(a, torch.randn(2, K + 1, N, device=DEVICE))
    with pytest.raises(ValueError, match="one dtype"):
        kernels.bmm(a, torch.randn(2, K, N, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="splits must be at least 1"):
        kernels.bmm(a, torch.randn(2, K, N, device=DEVICE), splits=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# 3 splits of K = 700: 2 K steps each (the last masked), so that a split's sum is not one step's
@pytest.mark.parametrize(("splits", "k"), [(None, LONG_K), (3, 700)], ids=["default", "3-splits"])
def test_a_rows_bits_do_not_depend_on_the_batch(kernels: ModuleType, dtype: torch.dtype, splits: int | None, k: int):
    torch.manual_seed(0)
    x = torch.randn(70, k, device=DEVICE).to(dtype)
    w = torch.randn(N, k, device=DEVICE).to(dtype)  # a linear's weight: b = w.t()
    bias = torch.randn(N, device=DEVICE).to(dtype)
    heads = _randn(2, k, N, dtype=dtype, transposed=True)
    others = torch.randn(130, k, device=DEVICE).to(dtype)
    for run in (lambda t: kernels.mm(t, w.t(), splits=splits), lambda t: kernels.mm(t, w.t(), bias, splits=splits),
                lambda t: kernels.bmm(t.expand(2, *t.shape), heads, splits=splits).transpose(0, 1)):
        whole = run(x)
        # fewer rows split: the interpreter runs each split as a program of its own
        for i in (0, 1, 37, 63, 64, 69) if splits is None else (1, 37, 64):
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
