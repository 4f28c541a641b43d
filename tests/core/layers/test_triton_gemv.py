"""The few-row GEMV (`triton_gemv.gemv`) against torch's products in float64, its measured table and the ops that
consult it (`SmallOps.linear` / `absorb` with fused kernels); the model's products through those ops.

Without a GPU the kernel runs in Triton's interpreter (an interpreted child pytest, tests/interpreter.py), fp32 and
fp16 only; bf16 on the GPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from plugserve.core.hardware import Hardware
from plugserve.core.layers import small_ops
from tests.interpreter import interpreter_child, kernels_fixture

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if ON_GPU else [])]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # of max |expected|

gemv_module = kernels_fixture("plugserve.core.layers.triton_gemv")

test_kernels_in_the_interpreter = interpreter_child(__file__)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape
    error = (actual.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * expected.abs().max().item(), error


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_linear_shapes_against_float64(gemv_module: ModuleType, dtype: torch.dtype, rows: int) -> None:
    """A Linear's weight [N, K] (K contiguous), N and K not multiples of the blocks, x a strided row view."""
    g = torch.Generator().manual_seed(rows)
    n, k = 37, 200
    weight = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    x = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dtype)[:, :k]  # rows strided by 2K, as a split leaves
    expected = (x.double() @ weight.double().T)[:, None]
    for config in (gemv_module.GemvConfig(8, 64, 2, 1), gemv_module.GemvConfig(16, 128, 4, 2)):
        _close(gemv_module.gemv(x[:, None], weight[None], config), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_head_products_against_float64(gemv_module: ModuleType, dtype: torch.dtype) -> None:
    """Absorbed MLA's layout: x [T, H, K] strided over heads, weight [H, K, N] read through its transpose."""
    g = torch.Generator().manual_seed(1)
    t, h, k, n = 2, 3, 24, 40
    x = torch.randn(t, h, k + 8, generator=g).to(DEVICE, dtype)[..., :k]  # q_nope: the first columns of q
    weight = torch.randn(h, k, n, generator=g).to(DEVICE, dtype)
    expected = torch.einsum("thk,hkn->thn", x.double(), weight.double())
    _close(gemv_module.gemv(x, weight.transpose(1, 2), gemv_module.GemvConfig(16, 16, 1, 1)), expected, dtype)


def test_gemv_refuses_what_it_does_not_take(gemv_module: ModuleType) -> None:
    config = gemv_module.GemvConfig(8, 64, 1, 1)
    with pytest.raises(ValueError, match="T <= 4"):
        gemv_module.gemv(torch.zeros(5, 1, 8, device=DEVICE), torch.zeros(1, 4, 8, device=DEVICE), config)
    with pytest.raises(ValueError, match="weight \\[B, N, K\\]"):
        gemv_module.gemv(torch.zeros(1, 1, 8, device=DEVICE), torch.zeros(1, 4, 9, device=DEVICE), config)


def _table(tmp_path: Path, device_key: str, shapes: dict) -> Path:
    from plugserve.core.layers import triton_gemv

    (tmp_path / triton_gemv.config_file_name(device_key)).write_text(json.dumps({"shapes": shapes}))
    return tmp_path


H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132)


def test_the_table_names_the_row_counts_that_won(tmp_path: Path) -> None:
    from plugserve.core.layers import triton_gemv

    directory = _table(tmp_path, H100.device_key, {"1,2048,2048": {"1": [16, 256, 4, 3], "4": [8, 256, 4, 1]}})
    table = triton_gemv.GemvTable.read(H100, directory)
    assert table.match.exact
    assert table.config(1, 2048, 2048, 1) == triton_gemv.GemvConfig(16, 256, 4, 3)
    assert table.config(1, 2048, 2048, 2) == triton_gemv.GemvConfig(8, 256, 4, 1)  # the next measured count up
    assert table.config(1, 2048, 2048, 5) is None  # past the kernel's rows
    assert table.config(1, 2048, 4096, 1) is None  # a shape never measured or lost: torch
    h200 = Hardware("cuda", "NVIDIA H200", (9, 0), 141 << 30, 132)
    assert "closest measured" in triton_gemv.GemvTable.read(h200, directory).match.reason
    assert triton_gemv.GemvTable.read(H100, tmp_path / "none").config(1, 2048, 2048, 1) is None


def test_ops_take_the_gemv_only_where_the_table_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_op / absorb_op call `gemv` for tabled shapes at tabled row counts and torch's products elsewhere,
    with the same results."""
    from plugserve.core.layers import triton_gemv

    calls: list[tuple] = []

    def fake_gemv(x: torch.Tensor, weight: torch.Tensor, config: object) -> torch.Tensor:
        calls.append((tuple(x.shape), tuple(weight.shape), config))
        return torch.einsum("tbk,bnk->tbn", x, weight)

    monkeypatch.setattr(triton_gemv, "gemv", fake_gemv)
    directory = _table(tmp_path, H100.device_key, {"1,6,4": {"2": [8, 64, 4, 1]}, "3,5,4": {"1": [8, 64, 4, 1]}})
    table = triton_gemv.GemvTable.read(H100, directory)
    linear, absorb = triton_gemv.linear_op(lambda: table), triton_gemv.absorb_op(lambda: table)
    weight, x = torch.randn(6, 4), torch.randn(2, 4)
    torch.testing.assert_close(linear(x, weight), small_ops.linear(x, weight))
    assert calls == [((2, 1, 4), (1, 6, 4), triton_gemv.GemvConfig(8, 64, 4, 1))]
    torch.testing.assert_close(linear(torch.randn(3, 4), weight).shape, torch.Size([3, 6]))  # 3 rows: torch
    w_heads, q = torch.randn(3, 4, 5), torch.randn(1, 3, 4)
    torch.testing.assert_close(absorb(q, w_heads), small_ops.absorb(q, w_heads))
    assert len(calls) == 2 and calls[1][1] == (3, 5, 4)
    absorb(torch.randn(2, 3, 4), w_heads)  # 2 rows: not tabled
    assert len(calls) == 2


def test_eager_absorb_is_the_per_head_product() -> None:
    x, weight = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(3, 4, 6, dtype=torch.float64)
    torch.testing.assert_close(small_ops.absorb(x, weight), torch.einsum("thk,hkn->thn", x, weight))


def test_compiled_ops_leave_the_products_alone() -> None:
    compiled = small_ops.SmallOps.compiled(8)
    assert compiled.linear is small_ops.linear and compiled.absorb is small_ops.absorb
