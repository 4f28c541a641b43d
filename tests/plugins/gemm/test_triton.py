"""The "triton" block-FP8 GEMM on the CPU, in Triton's interpreter: the quantization kernel against the
reference quantizer, its scale layouts, the GEMM against the torch reference, config files and lookup,
availability, and the tuning script's CPU-side parts."""

from __future__ import annotations

import functools
import importlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmarks.tune import tune_fp8_gemm
from plugserve.conformance.tolerances import assert_close
from plugserve.core.config import preset_config
from plugserve.core.distributed import ParallelGroup
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.layers.quant import per_token_group_quant_fp8, quantize_block_fp8
from plugserve.core.models.deepseek import DeepseekForCausalLM
from plugserve.core.specs import GemmSpec
from plugserve.plugins.gemm.torch_ref import block_fp8_matmul
from plugserve.plugins.gemm.triton import (
    BATCH_INVARIANT_CONFIG,
    CONFIG_DIR,
    CONFIG_DIR_ENV,
    CONFIG_KEYS,
    TritonFp8Gemm,
    config_file_name,
    default_config,
    load_configs,
    pick_config,
)
from plugserve.plugins.triton_support import tma_source
from plugserve.registry import Registry

CPU = torch.device("cpu")
BLOCK = (128, 128)
KERNELS = "plugserve.plugins.gemm.triton_kernels"
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> Iterator[ModuleType]:
    """The kernels module, defined under TRITON_INTERPRET=1 (re-imported if something imported it
    before); the variable stays set while this module's tests run, as the backend's availability wants."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield importlib.reload(sys.modules[KERNELS]) if KERNELS in sys.modules else importlib.import_module(KERNELS)


def _random_groups(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian rows whose 128-groups differ in magnitude by up to 10^6, one group all zero."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.randint(-3, 3, (m, -(-k // 128)), generator=g).float()
    x = torch.randn(m, k, generator=g) * magnitudes.repeat_interleave(128, dim=1)[:, :k]
    x[0, :128] = 0
    return x.to(dtype)


# -- quantization kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 128), (5, 300), (3, 1100), (2, 64)])
def test_quant_matches_reference(kernels: ModuleType, dtype: torch.dtype, m: int, k: int) -> None:
    x = _random_groups(m, k, dtype)
    q, scales = kernels.per_token_group_quant_fp8(x)
    ref_q, ref_scales = per_token_group_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and q.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == ref_scales.shape and scales.is_contiguous()
    assert torch.equal(scales, ref_scales)
    # Both divide by the same scale and round to nearest even: not merely one e4m3 step apart, equal.
    assert torch.equal(q.float(), ref_q.float())


def test_quant_rounds_across_powers_of_two(kernels: ModuleType) -> None:
    """Values that round up into the next binade (the interpreter's own cast gets these wrong), ties."""
    x = torch.tensor([[448.0, 124.9, -7.9, 31.6, 0.0095, -0.0019, 1e-5, 239.9, 9.5, 10.5, 0.0048828125] + [0.0] * 117])
    q, scales = kernels.per_token_group_quant_fp8(x)
    ref_q, _ = per_token_group_quant_fp8(x)
    assert scales.item() == 1.0
    assert q.float()[0, :11].tolist() == [448.0, 128.0, -8.0, 32.0, 0.009765625, -0.001953125, 0.0, 240.0, 10.0,
                                          10.0, 0.00390625]
    assert torch.equal(q.float(), ref_q.float())


def test_quant_reads_strided_input(kernels: ModuleType) -> None:
    base = _random_groups(6, 600, torch.float16)
    x = base[::2, 50:450]  # rows 2 apart, starting mid-group
    q, scales = kernels.per_token_group_quant_fp8(x)
    ref_q, ref_scales = per_token_group_quant_fp8(x.contiguous())
    assert torch.equal(scales, ref_scales) and torch.equal(q.float(), ref_q.float())


@pytest.mark.parametrize("m,padded", [(1, 4), (5, 8), (8, 8)])
def test_quant_column_major_and_tma_aligned_scales(kernels: ModuleType, m: int, padded: int) -> None:
    x = _random_groups(m, 300, torch.float32)
    q, scales = kernels.per_token_group_quant_fp8(x)
    q_col, col = kernels.per_token_group_quant_fp8(x, column_major_scales=True)
    q_tma, tma = kernels.per_token_group_quant_fp8(x, column_major_scales=True, tma_aligned_scales=True)
    assert col.shape == tma.shape == (m, 3)
    assert col.stride() == (1, m) and tma.stride() == (1, padded)
    assert tma.data_ptr() % 16 == 0 and (tma.stride(1) * 4) % 16 == 0  # every group's column 16-byte aligned
    for got_q, got_scales in ((q_col, col), (q_tma, tma)):
        assert torch.equal(got_scales, scales) and torch.equal(got_q.float(), q.float())


def test_quant_options_and_empty_input(kernels: ModuleType) -> None:
    with pytest.raises(ValueError, match="column_major_scales=True"):
        kernels.per_token_group_quant_fp8(torch.randn(2, 128), tma_aligned_scales=True)
    with pytest.raises(ValueError, match="2-D"):
        kernels.per_token_group_quant_fp8(torch.randn(128))
    q, scales = kernels.per_token_group_quant_fp8(torch.randn(0, 300), column_major_scales=True)
    assert q.shape == (0, 300) and scales.shape == (0, 3)


# -- GEMM -----------------------------------------------------------------------------------------------


def _operands(m: int, n: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_q, w_s = quantize_block_fp8(torch.randn(n, k, generator=g) / k**0.5, BLOCK)
    return x, w_q, w_s


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (33, 200, 320), (4, 130, 1000), (70, 384, 256)])
def test_apply_matches_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    """N and K not multiples of 128 (K's tail inside the last block), M of 1, several M tiles."""
    x, w_q, w_s = _operands(m, n, k, dtype)
    backend = TritonFp8Gemm(GemmSpec(dtype=dtype), CPU)
    out = backend.apply(x, backend.prepare(w_q, w_s))
    x_q, x_s = per_token_group_quant_fp8(x)
    expected = block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, dtype)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, expected, dtype, f"triton block-FP8 GEMM m{m}-n{n}-k{k}")


def test_batch_invariant_apply_takes_one_config_at_every_m(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Under spec.batch_invariant: BATCH_INVARIANT_CONFIG (no split-K) at every M and never the Gluon kernel, on a
    Hopper GPU too, where the default path splits K at decode sizes and takes Gluon from 256 rows; each row of the
    product is then the same bits alone as in the batch."""
    from plugserve.plugins.gemm import gluon_gemm

    monkeypatch.setattr(gluon_gemm, "gluon_gemm_fits", lambda *args: True)
    monkeypatch.setattr(gluon_gemm, "gluon_block_fp8_matmul", lambda *args: pytest.fail("the Gluon kernel ran"))
    configs = []
    launch = kernels.w8a8_block_fp8_matmul
    monkeypatch.setattr(kernels, "w8a8_block_fp8_matmul", lambda *args: configs.append(args[-1]) or launch(*args))
    backend = TritonFp8Gemm(GemmSpec(dtype=torch.float32, batch_invariant=True), CPU)
    backend.hardware = H100
    x, w_q, w_s = _operands(300, 128, 1024)
    packed = backend.prepare(w_q, w_s)
    whole = backend.apply(x, packed)
    for m in (1, 7, 64):
        assert torch.equal(backend.apply(x[:m], packed), whole[:m]), f"the first {m} rows alone"
    assert configs == [BATCH_INVARIANT_CONFIG] * 4


@pytest.mark.parametrize(
    "block_m,block_n,group_m",
    [(16, 256, 1), (16, 32, 2), (32, 64, 8), (64, 128, 3)],
    ids=["n-tile-spans-two-weight-blocks", "narrow-n-tiles-grouped", "group-beyond-m-tiles", "uneven-group"],
)
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major-scales", "column-major-scales"])
def test_kernel_configs_agree(kernels: ModuleType, block_m: int, block_n: int, group_m: int,
                              column_major: bool) -> None:
    m, n, k = 50, 300, 384
    x, w_q, w_s = _operands(m, n, k)
    x_q, x_s = kernels.per_token_group_quant_fp8(x, column_major_scales=column_major)
    config = {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": block_n, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": group_m,
              "num_warps": 4, "num_stages": 2}
    out = kernels.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.float32, config)
    expected = block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("k", [512, 500], ids=["tma", "k-unaligned-falls-back-to-pointers"])
def test_tma_kernel_matches_reference(kernels: ModuleType, k: int) -> None:
    """TMA boxes zero-fill the M and N edges (50 rows in 32-row tiles, 300 columns in 128-wide ones) and the
    split K runs of a tile; K = 500 has rows TMA cannot address (not 16-byte aligned), read through pointers."""
    m, n = 50, 300
    x, w_q, w_s = _operands(m, n, k)
    x_q, x_s = kernels.per_token_group_quant_fp8(x, column_major_scales=True)
    config = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 2, "num_warps": 4,
              "num_stages": 2, "SPLIT_K": 2, "TMA": 1}
    out = kernels.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.float32, config)
    expected = block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert tma_source(x_q) == (k % 16 == 0) and tma_source(x_q[:, 1:]) is False


@pytest.mark.parametrize("split_k", [2, 3, 6], ids=["even", "last-split-short", "empty-splits"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_split_k_matches_reference(kernels: ModuleType, split_k: int, dtype: torch.dtype) -> None:
    """K of 4 blocks and a tail (500): 3 splits take 2, 2, 0 blocks, 6 splits leave two programs empty."""
    m, n, k = 5, 200, 500
    x, w_q, w_s = _operands(m, n, k, dtype)
    x_q, x_s = kernels.per_token_group_quant_fp8(x, column_major_scales=True)
    config = default_config(m) | {"SPLIT_K": split_k, "num_stages": 2}
    out = kernels.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, dtype, config)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, dtype), dtype, f"split-K {split_k}")
    with pytest.raises(ValueError, match="SPLIT_K must be at least 1"):
        kernels.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, dtype, config | {"SPLIT_K": 0})


def test_split_k_rearms_its_arrival_counts(kernels: ModuleType) -> None:
    """Each tile's last program zeroes the tile's count: launches after the first still find their last program
    and write C (a count left at SPLIT_K would leave C unwritten)."""
    m, n, k = 3, 256, 512
    config = default_config(m) | {"BLOCK_SIZE_N": 64, "SPLIT_K": 4, "num_stages": 2}
    for seed in range(3):
        x, w_q, w_s = _operands(m, n, k, torch.float32, seed=seed)
        x_q, x_s = kernels.per_token_group_quant_fp8(x, column_major_scales=True)
        out = kernels.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.float32, config)
        assert_close(out, block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.float32), torch.float32, f"launch {seed}")
    from plugserve.core import triton_tiles  # with the kernels: it imports triton

    (arrivals,) = triton_tiles._arrivals.values()
    assert not arrivals.any()


def test_kernel_rejects_mismatched_operands(kernels: ModuleType) -> None:
    x, w_q, w_s = _operands(3, 200, 300)
    x_q, x_s = kernels.per_token_group_quant_fp8(x)
    config = default_config(3)
    with pytest.raises(ValueError, match="BLOCK_SIZE_K must be the scale group 128"):
        kernels.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.float32, config | {"BLOCK_SIZE_K": 64})
    with pytest.raises(ValueError, match="do not fit"):
        kernels.w8a8_block_fp8_matmul(x_q, x_s[:, :2], w_q, w_s, BLOCK, torch.float32, config)
    with pytest.raises(ValueError, match="K differs"):
        kernels.w8a8_block_fp8_matmul(x_q, x_s, w_q[:, :256], w_s, BLOCK, torch.float32, config)


def test_prepare_and_apply_validate_inputs() -> None:
    backend = TritonFp8Gemm(GemmSpec(dtype=torch.float16), CPU)
    x, w_q, w_s = _operands(2, 200, 300, torch.float16)
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        backend.prepare(w_q, w_s[:, :2])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        backend.prepare(w_q.half(), w_s)
    packed = backend.prepare(w_q, w_s)
    assert packed.weight.is_contiguous() and packed.configs is None  # no tuned file for the CPU
    with pytest.raises(ValueError, match=r"x must be \[M, 300\] of dtype torch.float16"):
        backend.apply(x.float(), packed)
    assert backend.apply(x[:0], packed).shape == (0, 200)


# -- configs -------------------------------------------------------------------------------------------


def test_config_file_name() -> None:
    assert config_file_name(2112, 7168, "NVIDIA_H100_80GB_HBM3") == (
        "N=2112,K=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128, 128].json"
    )
    assert H100.device_key == "NVIDIA_H100_80GB_HBM3"


def _write(directory: Path, n: int, k: int, device: str, table: dict[int, dict[str, int]]) -> Path:
    path = directory / config_file_name(n, k, device)
    path.write_text(json.dumps({str(m): config for m, config in table.items()}))
    return path


def test_nearest_m_lookup(tmp_path: Path) -> None:
    table = {m: default_config(m) | {"GROUP_SIZE_M": m} for m in (2, 4, 16, 256)}
    _write(tmp_path, 512, 1024, "Test_GPU", table)
    configs = load_configs(512, 1024, "Test_GPU", BLOCK, tmp_path)
    assert list(configs) == [2, 4, 16, 256]
    chosen = {m: pick_config(m, configs)["GROUP_SIZE_M"] for m in (1, 3, 4, 9, 10, 100, 200, 5000)}
    assert chosen == {1: 2, 3: 2, 4: 4, 9: 4, 10: 4, 100: 16, 200: 256, 5000: 256}  # ties go to the smaller M
    assert load_configs(512, 1024, "Other_GPU", BLOCK, tmp_path) is None


def test_default_config_fallback() -> None:
    assert pick_config(1, None) == default_config(1)
    for m in (1, 7, 16, 33, 100, 4096):
        config = default_config(m)
        assert tuple(config) == (*CONFIG_KEYS, "SPLIT_K") and config["BLOCK_SIZE_K"] == 128
        assert config["SPLIT_K"] == 1  # without the weight's shape and the GPU, no split
    assert default_config(1)["BLOCK_SIZE_M"] == 16 and default_config(4096)["BLOCK_SIZE_M"] == 64


def test_default_split_k_fills_the_sms_at_decode_sizes() -> None:
    # V3's fused q_a + kv_a at M = 1 on 132 SMs: 33 output tiles of 64 columns, 56 K blocks -> 8 splits
    # (2 programs per SM, capped by 56 / 4 = 14 blocks' worth); q_b's 384 tiles already fill the GPU.
    assert pick_config(1, None, BLOCK, 2112, 7168, 132)["SPLIT_K"] == 8
    assert default_config(1, BLOCK, 24576, 1536, 132)["SPLIT_K"] == 1
    assert default_config(1, BLOCK, 2112, 512, 132)["SPLIT_K"] == 1  # 4 K blocks: too few to split
    assert default_config(4096, BLOCK, 2112, 7168, 132)["SPLIT_K"] == 1


def test_malformed_config_files_are_refused(tmp_path: Path) -> None:
    _write(tmp_path, 1, 128, "Bad", {1: {"BLOCK_SIZE_M": 16}})
    with pytest.raises(ValueError, match=r"N=1,K=128,device_name=Bad.*BLOCK_SIZE_N"):
        load_configs(1, 128, "Bad", BLOCK, tmp_path)
    _write(tmp_path, 2, 128, "Bad", {1: default_config(1) | {"BLOCK_SIZE_K": 64}})
    with pytest.raises(ValueError, match=r"BLOCK_SIZE_K 128, SPLIT_K >= 1 .*\(wrong for M \[1\]\)"):
        load_configs(2, 128, "Bad", BLOCK, tmp_path)
    _write(tmp_path, 3, 128, "Bad", {1: default_config(1), 8: default_config(8) | {"SPLIT_K": 0}})
    with pytest.raises(ValueError, match=r"wrong for M \[8\]"):
        load_configs(3, 128, "Bad", BLOCK, tmp_path)
    _write(tmp_path, 5, 128, "Bad", {1: default_config(1) | {"TMA": 1}, 8: default_config(8) | {"TMA": 2}})
    with pytest.raises(ValueError, match=r"TMA 0 or 1 where given \(wrong for M \[8\]\)"):
        load_configs(5, 128, "Bad", BLOCK, tmp_path)


def test_launch_flags_load_where_given(tmp_path: Path) -> None:
    configs = {1: default_config(1), 4096: default_config(4096) | {"TMA": 1}}
    _write(tmp_path, 6, 128, "New", configs)
    assert load_configs(6, 128, "New", BLOCK, tmp_path) == configs


def test_config_files_without_split_k_read_as_one(tmp_path: Path) -> None:
    legacy = {key: value for key, value in default_config(1).items() if key != "SPLIT_K"}
    _write(tmp_path, 4, 128, "Old", {1: legacy})
    assert load_configs(4, 128, "Old", BLOCK, tmp_path) == {1: legacy | {"SPLIT_K": 1}}


def test_backend_uses_the_config_dir_and_tuned_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    backend = TritonFp8Gemm(GemmSpec(dtype=torch.float32), CPU)
    tuned = {1: default_config(1) | {"BLOCK_SIZE_N": 32}, 64: default_config(64) | {"GROUP_SIZE_M": 4}}
    _write(tmp_path, 200, 300, backend.hardware.device_key, tuned)
    x, w_q, w_s = _operands(3, 200, 300)
    packed = backend.prepare(w_q, w_s)
    assert packed.configs == tuned
    x_q, x_s = per_token_group_quant_fp8(x)
    assert_close(backend.apply(x, packed), block_fp8_matmul(x_q, x_s, w_q, w_s), torch.float32, "tuned config")


def test_another_h100_takes_the_closest_measured_config_and_logs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    tuned = {1: default_config(1) | {"BLOCK_SIZE_N": 32}}
    _write(tmp_path, 200, 300, H100.device_key, tuned)
    _, w_q, w_s = _operands(3, 200, 300)
    backend = TritonFp8Gemm(GemmSpec(dtype=torch.float32), CPU)
    backend.hardware = Hardware("cuda", "NVIDIA H100 NVL", (9, 0), 94 * 2**30, 132)
    with caplog.at_level("INFO", logger="plugserve.plugins.gemm.triton"):
        assert backend.prepare(w_q, w_s).configs == tuned
    assert ("no tuned config N=200,K=300 for NVIDIA H100 NVL; using NVIDIA_H100_80GB_HBM3, the closest measured "
            "(same sm90 family, H100)") in caplog.text
    backend.hardware = Hardware("cuda", "NVIDIA A10", (8, 6), 24 * 2**30, 72)  # no sm86 GPU measured: defaults
    with caplog.at_level("INFO", logger="plugserve.plugins.gemm.triton"):
        assert backend.prepare(w_q, w_s).configs is None
    assert "nor for another GPU known to share its compute capability (sm86)" in caplog.text
    assert "; default configs" in caplog.text


def test_tensor_parallel_layers_look_up_their_per_rank_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2: q_b_proj's tuned file is the one of its N / 2 rows, o_proj's of its K / 2 columns."""
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    config = preset_config("tiny").quantized_fp8()  # 8 heads of 96 (q) and 64 (v) dims, q LoRA 192, hidden 256
    model = DeepseekForCausalLM(config, torch.float32, CPU, group=ParallelGroup(0, 2))
    attention = model.layers[0].self_attn
    per_rank = {1: default_config(1) | {"GROUP_SIZE_M": 2}}
    whole = {1: default_config(1) | {"GROUP_SIZE_M": 3}}
    for (n, k), table in {(4 * 96, 192): per_rank, (8 * 96, 192): whole, (256, 4 * 64): per_rank,
                          (256, 8 * 64): whole}.items():
        _write(tmp_path, n, k, "cpu", table)
    backend = TritonFp8Gemm(GemmSpec(dtype=torch.float32), CPU)
    for layer in (attention.q_b_proj, attention.o_proj):
        layer.finalize(backend)
        assert layer._packed.configs == per_rank


def test_shipped_config_files_are_valid() -> None:
    pattern = re.compile(r"N=(\d+),K=(\d+),device_name=(\S+),dtype=fp8_w8a8,block_shape=\[128, 128\]\.json")
    for path in CONFIG_DIR.glob("*.json"):
        match = pattern.fullmatch(path.name)
        assert match, f"{path.name} is not named like {config_file_name(0, 0, 'GPU')}"
        assert load_configs(int(match[1]), int(match[2]), match[3], BLOCK, CONFIG_DIR)


# -- availability and registration ---------------------------------------------------------------------


def test_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = Hardware.detect(CPU)
    ampere = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 << 30, 108)
    assert TritonFp8Gemm.availability(cpu)
    assert TritonFp8Gemm.availability(H100)
    assert "needs sm89 or newer, this GPU is sm80" in TritonFp8Gemm.availability(ampere).reason
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET=1" in TritonFp8Gemm.availability(cpu).reason
    assert TritonFp8Gemm.capabilities.check(GemmSpec(block_shape=(64, 64)), Phase.DECODE).reason == (
        "weight block shape (64, 64) is not supported (supports (128, 128))"
    )


def test_registered_and_preferred_on_hopper() -> None:
    registry = Registry(builtin=("plugserve.plugins.gemm.torch_ref", "plugserve.plugins.gemm.triton"),
                        entry_points=False)
    assert not registry.broken and registry.get("gemm", "triton").cls is TritonFp8Gemm
    hopper = Hardware("cuda", "Test Hopper", (9, 0), 80 << 30, 132)  # a name with no selection table
    selection = registry.select("gemm", Phase.PREFILL, 64, hopper)
    assert selection.backend is TritonFp8Gemm and "highest priority on sm90 (50)" in selection.reason


# -- tuning script (its CPU-side parts) ------------------------------------------------------------------


def test_tune_script_refuses_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1 is set"):
        tune_fp8_gemm.main(["--quick"])
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SystemExit, match="CUDA GPU and none is visible"):
        tune_fp8_gemm.main(["--quick"])
    # Shapes parse as N,K or NxK (the device recipe turns commas into spaces) before the device check.
    with pytest.raises(SystemExit, match="CUDA GPU and none is visible"):
        tune_fp8_gemm.main(["--shapes", "7168x16384", "2112,7168"])
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        tune_fp8_gemm.main(["--shapes", "7168x"])


def test_tune_search_space() -> None:
    smem = 227 << 10  # an H100's shared memory per block
    small = tune_fp8_gemm.candidates(1, tune_fp8_gemm.FULL_SPACE, smem, 2112, 7168, 132)
    assert {c["BLOCK_SIZE_M"] for c in small} == {16} and {c["GROUP_SIZE_M"] for c in small} == {1}
    # split-K while the tiles do not fill the SMs: 2112 columns in 32-wide tiles are 66 (split), in 256-wide 9
    assert {c["SPLIT_K"] for c in small} == set(tune_fp8_gemm.FULL_SPACE["SPLIT_K"])
    wide = tune_fp8_gemm.candidates(1, tune_fp8_gemm.FULL_SPACE, smem, 24576, 1536, 132)
    assert {c["SPLIT_K"] for c in wide if c["BLOCK_SIZE_N"] == 32} == {1}  # 768 tiles
    assert {c["SPLIT_K"] for c in wide if c["BLOCK_SIZE_N"] == 256} == {1, 2, 3, 4, 6}  # 12 K blocks: <= 6 splits
    large = tune_fp8_gemm.candidates(4096, tune_fp8_gemm.FULL_SPACE, smem, 2112, 7168, 132)
    assert {c["BLOCK_SIZE_M"] for c in large} == {16, 32, 64, 128} and all(c["BLOCK_SIZE_K"] == 128 for c in large)
    assert all(c["num_stages"] * (c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_N"]) * 128 <= smem for c in large)
    assert {c["SPLIT_K"] for c in large} == {1}
    quick = tune_fp8_gemm.candidates(4096, tune_fp8_gemm.QUICK_SPACE, smem, 2112, 7168, 132)
    assert len(large) < 2 * 512 and len(quick) == 64
    assert all(tuple(c)[:7] == (*CONFIG_KEYS, "SPLIT_K") for c in large)
    # The TMA flag appears only where on: each tile config with and without it.
    assert sum("TMA" in c for c in large) * 2 == len(large) and all(c.get("TMA", 1) == 1 for c in large)
    assert all(set(c) == {*CONFIG_KEYS, "SPLIT_K"} for c in quick)
    prefill = tune_fp8_gemm.candidates(4096, tune_fp8_gemm.QUICK_PREFILL_SPACE, smem, 2112, 7168, 132)
    assert len(prefill) == 48 and {c["BLOCK_SIZE_N"] for c in prefill} == {64, 128, 256}


def test_tuner_times_the_files_config_beside_the_candidates(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Under --update a batch size's config in the file is timed too (here made the fastest) and written back, checked
    against the reference like any winner; without it the space's best wins. Interpreted, with the GPU faked."""
    import types

    from benchmarks import gpu_timing

    kept = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
            "num_stages": 2, "SPLIT_K": 1}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        shared_memory_per_block_optin=227 << 10, multi_processor_count=132))
    monkeypatch.setattr(gpu_timing, "time_cold_graph_ms", lambda run, reps: 1.0 if run.args[-1] == kept else 2.0)
    space = {"BLOCK_SIZE_M": (16,), "BLOCK_SIZE_N": (64,), "GROUP_SIZE_M": (1,), "num_warps": (4,), "num_stages": (2,),
             "SPLIT_K": (1,)}
    tune = functools.partial(tune_fp8_gemm.tune_shape, 256, 256, [16], space, torch.float32, 1, CPU)
    assert tune(kept={16: kept}) == {16: kept}
    assert tune() == {16: kept | {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64}}  # the space's one candidate


def test_tune_output_loads_back(tmp_path: Path) -> None:
    best = {4096: default_config(4096), 1: default_config(1), 64: default_config(64)}
    path = tune_fp8_gemm.write_configs(best, 7168, 2048, "NVIDIA_H100_80GB_HBM3", tmp_path / "out")
    assert path.name == config_file_name(7168, 2048, "NVIDIA_H100_80GB_HBM3")
    assert list(json.loads(path.read_text())) == ["1", "64", "4096"]
    assert load_configs(7168, 2048, "NVIDIA_H100_80GB_HBM3", BLOCK, tmp_path / "out") == dict(sorted(best.items()))
    # --update keeps the other batch sizes of the file and replaces the re-tuned ones.
    retuned = {64: default_config(1)}
    tune_fp8_gemm.write_configs(retuned, 7168, 2048, "NVIDIA_H100_80GB_HBM3", tmp_path / "out", update=True)
    assert load_configs.__wrapped__(7168, 2048, "NVIDIA_H100_80GB_HBM3", BLOCK, tmp_path / "out") == dict(
        sorted((best | retuned).items()))
