"""The loader: Hugging Face safetensors (one file or sharded) into plugserve's fused layout, its errors
(missing, misshapen, unexpected tensors, absent shards), --num-layers, DeepSeek's block-FP8 format,
quantize-on-load, random weights at the presets' real shapes, and the --dtype / --load-format checks."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from plugserve.core.config import ModelConfigError, preset_config
from plugserve.core.layers.linear import Linear, WeightLoadError
from plugserve.core.layers.quant import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from plugserve.core.loader import INDEX_FILE, load_model, read_config, resolve_dtype
from plugserve.core.models.deepseek import DeepseekForCausalLM
from tests.checkpoints import (
    add_mtp_layer,
    random_hf_model,
    save_hf_model,
    tiny_v3_config,
    write_fp8_checkpoint,
    write_nextn_draft,
)
from tests.paged_runner import load_reference_model, reference_backends

CPU = torch.device("cpu")


def _edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the single-file checkpoint `src` whose tensors `edit` changed in place."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Exact comparison of e4m3 tensors (torch.equal has no float8 kernel on every build)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.fixture(scope="module")
def v3_hf():
    return random_hf_model(tiny_v3_config())


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory, v3_hf) -> Path:
    return save_hf_model(v3_hf, tmp_path_factory.mktemp("v3") / "single")


@pytest.fixture(scope="module")
def v3_sharded_dir(tmp_path_factory: pytest.TempPathFactory, v3_hf) -> Path:
    return save_hf_model(v3_hf, tmp_path_factory.mktemp("v3") / "sharded", max_shard_size="50KB")


@pytest.fixture(scope="module")
def v3_model(v3_dir: Path) -> DeepseekForCausalLM:
    return load_reference_model(v3_dir)


# -- safetensors, one file or sharded ---------------------------------------------------------------------


def test_sharded_checkpoint_loads_hf_tensors(v3_hf, v3_sharded_dir: Path) -> None:
    shards = sorted(v3_sharded_dir.glob("*.safetensors"))
    assert len(shards) > 3
    index = json.loads((v3_sharded_dir / INDEX_FILE).read_text())
    assert {p.name for p in shards} == set(index["weight_map"].values())

    model = load_reference_model(v3_sharded_dir)
    hf = dict(v3_hf.named_parameters())
    assert _same(model.embed_tokens.weight, hf["model.embed_tokens.weight"])
    assert _same(model.lm_head.weight, hf["lm_head.weight"])
    assert _same(model.norm.weight, hf["model.norm.weight"])
    layer0, layer1 = model.layers[0], model.layers[1]
    assert _same(layer1.input_layernorm.weight, hf["model.layers.1.input_layernorm.weight"])
    assert _same(layer1.self_attn.q_a_layernorm.weight, hf["model.layers.1.self_attn.q_a_layernorm.weight"])
    for i, layer in enumerate(model.layers):
        a = f"model.layers.{i}.self_attn"
        assert _same(layer.self_attn.fused_qkv_a_proj.weight,
                     torch.cat([hf[f"{a}.q_a_proj.weight"], hf[f"{a}.kv_a_proj_with_mqa.weight"]]))
        assert _same(layer.self_attn.q_b_proj.weight, hf[f"{a}.q_b_proj.weight"])
        assert _same(layer.self_attn.o_proj.weight, hf[f"{a}.o_proj.weight"])
        assert _same(layer.self_attn.kv_b_proj.weight, hf[f"{a}.kv_b_proj.weight"])
    mlp = "model.layers.0.mlp"
    assert _same(layer0.mlp.gate_up_proj.weight,
                 torch.cat([hf[f"{mlp}.gate_proj.weight"], hf[f"{mlp}.up_proj.weight"]]))
    assert _same(layer0.mlp.down_proj.weight, hf[f"{mlp}.down_proj.weight"])
    # W_UK / W_UV are kv_b_proj [H * (nope + v), R] split per head.
    kv_b = hf["model.layers.1.self_attn.kv_b_proj.weight"].view(4, 16 + 16, 32)
    assert _same(layer1.self_attn.w_kc, kv_b[:, :16].contiguous())
    assert _same(layer1.self_attn.w_vc, kv_b[:, 16:].transpose(1, 2).contiguous())


def test_moe_layer_weights(v3_hf, v3_dir: Path, v3_model: DeepseekForCausalLM) -> None:
    """Experts are stacked into the MoE backend's w13 [E, 2I, H] (gate ++ up) and w2 [E, H, I]."""
    saved = load_file(v3_dir / "model.safetensors")
    mlp = v3_model.layers[2].mlp
    p = "model.layers.2.mlp"
    assert _same(mlp.gate, saved[f"{p}.gate.weight"])
    assert _same(mlp.e_score_correction_bias, saved[f"{p}.gate.e_score_correction_bias"])
    w13 = torch.stack([torch.cat([saved[f"{p}.experts.{e}.gate_proj.weight"], saved[f"{p}.experts.{e}.up_proj.weight"]])
                       for e in range(8)])
    w2 = torch.stack([saved[f"{p}.experts.{e}.down_proj.weight"] for e in range(8)])
    assert _same(mlp._packed.w13, w13)
    assert _same(mlp._packed.w2, w2)
    assert mlp._packed.w13_scale_inv is None
    shared = f"{p}.shared_experts"
    assert _same(mlp.shared_experts.gate_up_proj.weight,
                 torch.cat([saved[f"{shared}.gate_proj.weight"], saved[f"{shared}.up_proj.weight"]]))
    assert _same(mlp.shared_experts.down_proj.weight, saved[f"{p}.shared_experts.down_proj.weight"])
    # the HF model's own (fused) expert parameters hold the same numbers
    hf_experts = dict(v3_hf.named_parameters())
    assert torch.equal(hf_experts[f"{p}.experts.down_proj"], w2)


def test_single_file_and_sharded_give_the_same_model(v3_model: DeepseekForCausalLM, v3_sharded_dir: Path) -> None:
    sharded = load_reference_model(v3_sharded_dir)
    single_params, sharded_params = dict(v3_model.named_parameters()), dict(sharded.named_parameters())
    assert single_params.keys() == sharded_params.keys()
    for name, value in single_params.items():
        assert _same(value, sharded_params[name]), name
    for i in (1, 2):
        a, b = v3_model.layers[i].mlp._packed, sharded.layers[i].mlp._packed
        assert _same(a.w13, b.w13) and _same(a.w2, b.w2)


def test_safetensors_load_format_and_dtype(v3_dir: Path, v3_model: DeepseekForCausalLM) -> None:
    model = load_reference_model(v3_dir, dtype=torch.bfloat16, load_format="safetensors")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    assert model.layers[1].mlp._packed.w13.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens.weight, v3_model.embed_tokens.weight.to(torch.bfloat16))


def test_dummy_format_ignores_the_checkpoint(v3_dir: Path, v3_model: DeepseekForCausalLM) -> None:
    model = load_reference_model(v3_dir, load_format="dummy")
    assert model.embed_tokens.weight.shape == v3_model.embed_tokens.weight.shape
    assert not torch.equal(model.embed_tokens.weight, v3_model.embed_tokens.weight)
    assert torch.all(model.norm.weight == 1)


# -- checkpoint errors ------------------------------------------------------------------------------------


def test_missing_tensor(v3_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    path = _edited_copy(v3_dir, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match="missing") as info:
        load_reference_model(path)
    assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("model.layers.0.self_attn.o_proj.weight", (64, 32), (64, 64)),
        ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", (41, 64), (40, 64)),  # a shard of a fused layer
        ("model.layers.2.mlp.experts.5.up_proj.weight", (32, 63), (32, 64)),
        ("model.layers.0.input_layernorm.weight", (32,), (64,)),
        ("lm_head.weight", (321, 64), (320, 64)),
    ],
)
def test_wrong_shape(v3_dir: Path, tmp_path: Path, name: str, shape: tuple, expected: tuple) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = torch.zeros(shape)

    path = _edited_copy(v3_dir, tmp_path / "ckpt", edit)
    with pytest.raises(WeightLoadError) as info:
        load_reference_model(path)
    message = str(info.value)
    assert name in message
    assert str(shape) in message
    assert str(expected) in message


def test_unexpected_tensor(v3_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.extra.weight"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = torch.zeros(4, 4)

    with pytest.raises(WeightLoadError, match="does not have") as info:
        load_reference_model(_edited_copy(v3_dir, tmp_path / "ckpt", edit))
    assert name in str(info.value)


def test_unexpected_top_level_tensor(v3_dir: Path, tmp_path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.extra_norm.weight"] = torch.ones(64)

    with pytest.raises(WeightLoadError, match=r"model\.extra_norm\.weight"):
        load_reference_model(_edited_copy(v3_dir, tmp_path / "ckpt", edit))


def test_index_lists_absent_shard(v3_sharded_dir: Path, tmp_path: Path) -> None:
    path = shutil.copytree(v3_sharded_dir, tmp_path / "ckpt")
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match=r"model-00099-of-00099\.safetensors"):
        load_reference_model(path)


def test_index_shard_deleted(v3_sharded_dir: Path, tmp_path: Path) -> None:
    """An incomplete download: the index names a shard that is not there."""
    path = shutil.copytree(v3_sharded_dir, tmp_path / "ckpt")
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightLoadError) as info:
        load_reference_model(path)
    assert shard.name in str(info.value)


def test_directory_without_weights(v3_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(v3_dir / "config.json", path / "config.json")
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors"):
        load_reference_model(path)


# -- --num-layers -----------------------------------------------------------------------------------------


def test_num_layers_skips_later_layers(v3_dir: Path, v3_model: DeepseekForCausalLM) -> None:
    config, checkpoint_layers = read_config(str(v3_dir), None, num_layers=2)
    assert (config.num_hidden_layers, checkpoint_layers) == (2, 3)
    model = load_model(config, reference_backends(config, torch.float32), model_path=str(v3_dir),
                       checkpoint_layers=checkpoint_layers, load_format="auto", dtype=torch.float32, device=CPU)
    assert len(model.layers) == 2
    assert model.num_kv_layers == 2
    assert _same(model.layers[1].self_attn.fused_qkv_a_proj.weight,
                 v3_model.layers[1].self_attn.fused_qkv_a_proj.weight)
    assert _same(model.layers[1].mlp._packed.w13, v3_model.layers[1].mlp._packed.w13)
    assert _same(model.norm.weight, v3_model.norm.weight)
    assert _same(model.lm_head.weight, v3_model.lm_head.weight)


def test_num_layers_out_of_range(v3_dir: Path) -> None:
    with pytest.raises(ValueError, match="--num-layers 4"):
        read_config(str(v3_dir), None, num_layers=4)


# -- DeepSeek's block-FP8 checkpoints ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny V3 whose fused shards start on 32-row block boundaries, and its (32, 32)-block FP8 copy."""
    root = tmp_path_factory.mktemp("fp8")
    model = random_hf_model(tiny_v3_config(q_lora_rank=64, intermediate_size=96, moe_intermediate_size=32), seed=1)
    src = save_hf_model(model, root / "src")
    return src, write_fp8_checkpoint(src, root / "fp8", block=(32, 32))


def test_fp8_checkpoint(fp8_dirs: tuple[Path, Path]) -> None:
    _, path = fp8_dirs
    config, _ = read_config(str(path), None)
    assert config.fp8_block == (32, 32)
    ckpt = load_file(path / "model.safetensors")
    model = load_reference_model(path)

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears
    for linear in linears:
        assert linear.weight.dtype == FP8_DTYPE
        assert linear.weight_scale_inv.dtype == torch.float32
    for i, layer in enumerate(model.layers):
        a = f"model.layers.{i}.self_attn"
        attn = layer.self_attn
        for linear, names in ((attn.fused_qkv_a_proj, ["q_a_proj", "kv_a_proj_with_mqa"]),
                              (attn.q_b_proj, ["q_b_proj"]), (attn.kv_b_proj, ["kv_b_proj"]),
                              (attn.o_proj, ["o_proj"])):
            assert _same(linear.weight, torch.cat([ckpt[f"{a}.{n}.weight"] for n in names]))
            assert _same(linear.weight_scale_inv, torch.cat([ckpt[f"{a}.{n}.weight_scale_inv"] for n in names]))
        # W_UK / W_UV come from the dequantized kv_b_proj
        kv_b = dequantize_block_fp8(ckpt[f"{a}.kv_b_proj.weight"], ckpt[f"{a}.kv_b_proj.weight_scale_inv"], (32, 32))
        torch.testing.assert_close(attn.w_kc, kv_b.view(4, 32, 32)[:, :16], rtol=0, atol=0)
        # the unquantized tensors stay in the model dtype
        assert _same(attn.q_a_layernorm.weight, ckpt[f"{a}.q_a_layernorm.weight"])
    m = "model.layers.0.mlp"
    dense = model.layers[0].mlp
    assert _same(dense.gate_up_proj.weight, torch.cat([ckpt[f"{m}.gate_proj.weight"], ckpt[f"{m}.up_proj.weight"]]))
    assert _same(dense.gate_up_proj.weight_scale_inv,
                 torch.cat([ckpt[f"{m}.gate_proj.weight_scale_inv"], ckpt[f"{m}.up_proj.weight_scale_inv"]]))
    assert _same(dense.down_proj.weight_scale_inv, ckpt[f"{m}.down_proj.weight_scale_inv"])

    m = "model.layers.1.mlp"
    packed = model.layers[1].mlp._packed
    w13 = [torch.cat([ckpt[f"{m}.experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj")]) for e in range(8)]
    s13 = [torch.cat([ckpt[f"{m}.experts.{e}.{n}.weight_scale_inv"] for n in ("gate_proj", "up_proj")])
           for e in range(8)]
    assert _same(packed.w13, torch.stack(w13))
    assert _same(packed.w13_scale_inv, torch.stack(s13))
    assert _same(packed.w2, torch.stack([ckpt[f"{m}.experts.{e}.down_proj.weight"] for e in range(8)]))
    assert _same(packed.w2_scale_inv, torch.stack([ckpt[f"{m}.experts.{e}.down_proj.weight_scale_inv"]
                                                   for e in range(8)]))
    assert _same(model.layers[1].mlp.gate, ckpt[f"{m}.gate.weight"])
    assert _same(model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])

    # the GEMM backend got the weights: o_proj(x) = x W^T up to activation quantization
    o_proj = model.layers[0].self_attn.o_proj
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    w = dequantize_block_fp8(o_proj.weight, o_proj.weight_scale_inv, (32, 32))
    torch.testing.assert_close(o_proj(x), x @ w.T, rtol=0.1, atol=0.02)


def test_fp8_checkpoint_with_quantization_flag_keeps_its_block(fp8_dirs: tuple[Path, Path]) -> None:
    config, _ = read_config(str(fp8_dirs[1]), None, quantization="fp8")
    assert config.fp8_block == (32, 32)


def test_fp8_shards_sharing_scale_blocks(v3_dir: Path, tmp_path: Path) -> None:
    """q_lora_rank 48 with 32-row blocks: kv_a_proj_with_mqa starts mid-block in the fused q/kv-a GEMM, so the
    two shards' scales cannot be kept; the layer is dequantized and re-quantized whole."""
    path = write_fp8_checkpoint(v3_dir, tmp_path / "fp8", block=(32, 32))
    ckpt = load_file(path / "model.safetensors")
    model = load_reference_model(path)
    a = "model.layers.0.self_attn"
    floats = torch.cat([dequantize_block_fp8(ckpt[f"{a}.{n}.weight"], ckpt[f"{a}.{n}.weight_scale_inv"], (32, 32))
                        for n in ("q_a_proj", "kv_a_proj_with_mqa")])
    weight, scale = quantize_block_fp8(floats, (32, 32))
    fused = model.layers[0].self_attn.fused_qkv_a_proj
    assert fused.weight.shape == (48 + 40, 64) and fused.weight_scale_inv.shape == (3, 2)
    assert _same(fused.weight, weight)
    assert _same(fused.weight_scale_inv, scale)
    torch.testing.assert_close(dequantize_block_fp8(fused.weight, fused.weight_scale_inv, (32, 32)), floats,
                               rtol=0.07, atol=1e-3)
    # aligned layers keep the checkpoint's own scales
    assert _same(model.layers[0].self_attn.o_proj.weight_scale_inv, ckpt[f"{a}.o_proj.weight_scale_inv"])


def test_fp8_tensor_without_scale(fp8_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    path = _edited_copy(fp8_dirs[1], tmp_path / "ckpt", lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(WeightLoadError, match="_scale_inv") as info:
        load_reference_model(path)
    assert name in str(info.value)


def test_fp8_scale_of_wrong_shape(fp8_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = torch.ones(1, 2)

    with pytest.raises(WeightLoadError) as info:
        load_reference_model(_edited_copy(fp8_dirs[1], tmp_path / "ckpt", edit))
    assert name in str(info.value) and "(1, 2)" in str(info.value) and "(2, 2)" in str(info.value)


def test_fp8_tensor_without_quantization_config(fp8_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    path = shutil.copytree(fp8_dirs[1], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match="quantization_config"):
        load_reference_model(path)


# -- quantize-on-load --------------------------------------------------------------------------------------


def test_quantize_onload_reference_model(fp8_dirs: tuple[Path, Path]) -> None:
    src, _ = fp8_dirs
    config, _ = read_config(str(src), None, quantization="fp8")
    assert config.fp8_block == (128, 128)
    saved = load_file(src / "model.safetensors")
    model = load_reference_model(src, quantization="fp8")
    for linear in (m for m in model.modules() if isinstance(m, Linear)):
        assert linear.weight.dtype == FP8_DTYPE
    a = "model.layers.1.self_attn"
    fused = model.layers[1].self_attn.fused_qkv_a_proj
    # the whole fused layer is quantized at once (its shards may share blocks)
    weight, scale = quantize_block_fp8(torch.cat([saved[f"{a}.q_a_proj.weight"],
                                                  saved[f"{a}.kv_a_proj_with_mqa.weight"]]), (128, 128))
    assert _same(fused.weight, weight)
    assert _same(fused.weight_scale_inv, scale)
    dequantized = dequantize_block_fp8(fused.weight, fused.weight_scale_inv, (128, 128))
    torch.testing.assert_close(dequantized[:64], saved[f"{a}.q_a_proj.weight"], rtol=0.07, atol=1e-3)
    packed = model.layers[1].mlp._packed
    assert packed.w13.dtype == FP8_DTYPE and packed.w13.shape == (8, 64, 64)
    assert packed.w13_scale_inv.shape == (8, 1, 1)
    assert model.embed_tokens.weight.dtype == torch.float32


def test_unsupported_quantization(v3_dir: Path) -> None:
    with pytest.raises(ValueError, match="int4") as info:
        read_config(str(v3_dir), None, quantization="int4")
    assert "fp8" in str(info.value)


# -- dummy weights at the presets' real shapes -------------------------------------------------------------


def _finite(t: torch.Tensor, rows: int = 64) -> bool:
    return bool(torch.isfinite(t[:rows].float()).all())


def test_dummy_deepseek_v3() -> None:
    dtype = torch.bfloat16
    config, checkpoint_layers = read_config(None, "deepseek-v3", num_layers=1)  # a second repeats its shapes
    assert config.vocab_size == 129280
    config = dataclasses.replace(config, vocab_size=1024)  # the vocabulary's rows take most of the time to draw
    model = load_model(config, reference_backends(config, dtype), model_path=None, checkpoint_layers=checkpoint_layers,
                       load_format="dummy", dtype=dtype, device=CPU)
    assert len(model.layers) == 1 and model.nextn is None
    attn = model.layers[0].self_attn
    assert attn.fused_qkv_a_proj.weight.shape == (1536 + 576, 7168)
    assert attn.fused_qkv_a_proj.weight.dtype == FP8_DTYPE
    assert attn.fused_qkv_a_proj.weight_scale_inv.shape == (17, 56)
    assert attn.q_b_proj.weight.shape == (128 * 192, 1536)
    assert attn.kv_b_proj.weight.shape == (128 * 256, 512)
    assert attn.o_proj.weight.shape == (7168, 128 * 128)
    assert attn.w_kc.shape == (128, 128, 512) and attn.w_kc.dtype == dtype
    assert attn.w_vc.shape == (128, 512, 128)
    mlp = model.layers[0].mlp  # first_k_dense_replace = 3: dense
    assert mlp.gate_up_proj.weight.shape == (2 * 18432, 7168) and mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    assert mlp.down_proj.weight.shape == (7168, 18432)
    assert model.embed_tokens.weight.shape == (1024, 7168) and model.embed_tokens.weight.dtype == dtype
    assert model.lm_head.weight.shape == (1024, 7168)
    for t in (attn.fused_qkv_a_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
              model.embed_tokens.weight, model.lm_head.weight, attn.w_kc, attn.fused_qkv_a_proj.weight_scale_inv):
        assert _finite(t)
    assert _finite(model.embed_tokens.weight[-64:]) and _finite(mlp.gate_up_proj.weight[-64:])
    # the random weights are not all zero, and dequantize to about N(0, 0.02)
    w = dequantize_block_fp8(attn.o_proj.weight[:256], attn.o_proj.weight_scale_inv[:2], (128, 128))
    assert 0.01 < w.std().item() < 0.04
    assert 0.01 < model.embed_tokens.weight[:256].float().std().item() < 0.04


def test_dummy_weights_build_a_declared_nextn_layer_for_speculative_decoding() -> None:
    with_layer = dataclasses.replace(preset_config("tiny"), num_nextn_predict_layers=1)

    def load(config, **kwargs) -> DeepseekForCausalLM:
        return load_model(config, reference_backends(config, torch.float32), model_path=None, checkpoint_layers=4,
                          load_format="dummy", dtype=torch.float32, device=CPU, **kwargs)

    assert load(with_layer).nextn is None  # without speculation, no memory spent on it
    nextn = load(with_layer, dummy_nextn=True).nextn
    assert nextn is not None and 0.01 < nextn.eh_proj.weight.std().item() < 0.04  # random like the other layers
    assert load(preset_config("tiny"), dummy_nextn=True).nextn is None  # the config declares none


def test_dummy_deepseek_v2_lite() -> None:
    dtype = torch.bfloat16
    config, checkpoint_layers = read_config(None, "deepseek-v2-lite", num_layers=2)
    assert config.fp8_block is None and config.vocab_size == 102400
    config = dataclasses.replace(config, vocab_size=1024)  # the vocabulary's rows take much of the time to draw
    model = load_model(config, reference_backends(config, dtype), model_path=None, checkpoint_layers=checkpoint_layers,
                       load_format="dummy", dtype=dtype, device=CPU)
    attn = model.layers[0].self_attn
    # q_proj (16 heads x 192) and kv_a_proj_with_mqa (576) in one GEMM
    assert attn.fused_qkv_a_proj.weight.shape == (16 * 192 + 576, 2048)
    assert attn.fused_qkv_a_proj.weight.dtype == dtype
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 10944, 2048)
    moe = model.layers[1].mlp
    assert moe.gate.shape == (64, 2048)
    assert moe.e_score_correction_bias is None  # greedy routing has none
    assert moe._packed.w13.shape == (64, 2 * 1408, 2048) and moe._packed.w13.dtype == dtype
    assert moe._packed.w2.shape == (64, 2048, 1408)
    assert moe.shared_experts.gate_up_proj.weight.shape == (2 * 2 * 1408, 2048)
    assert len(moe.experts) == 0  # the per-expert copies are dropped once packed
    assert _finite(moe._packed.w13[0]) and _finite(moe._packed.w13[-1]) and _finite(moe.gate)
    assert moe._packed.w13[:4].float().std().item() > 0.01


# -- --dtype and --load-format ------------------------------------------------------------------------------


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16
    assert resolve_dtype("float32", CPU) == torch.float32
    with pytest.raises(ValueError, match="'fp8'") as info:
        resolve_dtype("fp8", CPU)
    for choice in ("auto", "bfloat16", "float16", "float32"):
        assert choice in str(info.value)


def test_unknown_load_format(v3_dir: Path) -> None:
    config, checkpoint_layers = read_config(str(v3_dir), None)
    with pytest.raises(ValueError, match="'gguf'") as info:
        load_model(config, reference_backends(config, torch.float32), model_path=str(v3_dir),
                   checkpoint_layers=checkpoint_layers, load_format="gguf", dtype=torch.float32, device=CPU)
    for choice in ("auto", "safetensors", "dummy"):
        assert choice in str(info.value)


def test_a_layer_the_checkpoint_cannot_have_is_reported(tmp_path):
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path / "ckpt")
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.99.mlp.foo.weight"] = torch.zeros(2)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"model\.layers\.99\.mlp\.foo\.weight"):
        load_reference_model(directory)


def test_a_float_weight_with_a_scale_is_refused():
    layer = Linear(64, [32], torch.float32, "cpu", fp8_block=(128, 128))
    with pytest.raises(WeightLoadError, match="also has w_scale_inv"):
        layer.load_shard(0, "w", torch.zeros(32, 64), torch.ones(1, 1))


# -- a separate draft checkpoint's NextN layer (--speculative-draft-model-path) ---------------------------------


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory, v3_dir: Path) -> Path:
    """v3_dir with DeepSeek-V3's MTP layer after its three decoder layers."""
    directory = tmp_path_factory.mktemp("v3-mtp") / "single"
    shutil.copytree(v3_dir, directory)
    add_mtp_layer(directory, num_layers=3)
    return directory


def _nextn_state(model: DeepseekForCausalLM) -> dict[str, torch.Tensor]:
    assert model.nextn is not None
    return model.nextn.state_dict()


@pytest.mark.parametrize("draft", ["nextn-only", "nextn-only-without-shared-copies", "whole-checkpoint"])
def test_a_draft_checkpoint_gives_the_nextn_layer_the_targets_own_would(v3_dir: Path, mtp_dir: Path, tmp_path: Path,
                                                                         draft: str) -> None:
    """A target without a NextN layer takes it from a NextN-only export (`model.layers.0`, SGLang's format) or from
    a whole checkpoint with one (`model.layers.3`): the same layer as the checkpoint that has it."""
    own = load_reference_model(mtp_dir)
    path = mtp_dir if draft == "whole-checkpoint" else write_nextn_draft(
        mtp_dir, tmp_path / "draft", num_layers=3, shared_copies=draft == "nextn-only")
    drafted = load_reference_model(v3_dir, draft_model_path=str(path))
    assert load_reference_model(v3_dir).nextn is None and drafted.num_kv_layers == 4
    expected, got = _nextn_state(own), _nextn_state(drafted)
    assert expected.keys() == got.keys() and all(_same(expected[k], got[k]) for k in expected)
    assert _same(drafted.layers[2].mlp.gate, own.layers[2].mlp.gate)  # the trunk is the target's


def test_a_draft_replaces_the_targets_own_nextn_layer(mtp_dir: Path, tmp_path: Path) -> None:
    draft = write_nextn_draft(mtp_dir, tmp_path / "draft", num_layers=3)
    _edited_copy(draft, tmp_path / "doubled", lambda t: t["model.layers.0.eh_proj.weight"].mul_(2))
    own = load_reference_model(mtp_dir)
    drafted = load_reference_model(mtp_dir, draft_model_path=str(tmp_path / "doubled"))
    assert torch.equal(drafted.nextn.eh_proj.weight, 2 * own.nextn.eh_proj.weight)
    assert _same(drafted.nextn.enorm.weight, own.nextn.enorm.weight)


def _draft_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | changes))
    return dst


def test_a_draft_of_other_shapes_is_refused_naming_the_flag_and_fields(v3_dir: Path, mtp_dir: Path,
                                                                       tmp_path: Path) -> None:
    wide = _draft_config(mtp_dir, tmp_path / "wide", hidden_size=128, n_routed_experts=16)
    with pytest.raises(ModelConfigError, match=rf"--speculative-draft-model-path {wide}: its NextN layer does not fit "
                       r"the target: hidden_size 128 \(the target's: 64\), n_routed_experts 16 \(the target's: 8\)"):
        load_reference_model(v3_dir, draft_model_path=str(wide))
    none = _draft_config(mtp_dir, tmp_path / "none", num_nextn_predict_layers=0)
    with pytest.raises(ModelConfigError, match=r"draft-model-path .*none: its config.json declares no NextN layer"):
        load_reference_model(v3_dir, draft_model_path=str(none))


def test_a_draft_missing_or_adding_nextn_tensors_is_refused(v3_dir: Path, mtp_dir: Path, tmp_path: Path) -> None:
    draft = write_nextn_draft(mtp_dir, tmp_path / "draft", num_layers=3)
    missing = _edited_copy(draft, tmp_path / "missing", lambda t: t.pop("model.layers.0.hnorm.weight"))
    with pytest.raises(WeightLoadError, match=r"draft-model-path .*missing: 1 tensors the model needs are missing: "
                       r"model.layers.0.hnorm.weight"):
        load_reference_model(v3_dir, draft_model_path=str(missing))
    extra = _edited_copy(draft, tmp_path / "extra", lambda t: t.update({"model.layers.0.bogus.weight": torch.ones(2)}))
    with pytest.raises(WeightLoadError, match=r"extra: 1 tensors of its NextN layer \(model.layers.0\) the model "
                       r"does not have: model.layers.0.bogus.weight"):
        load_reference_model(v3_dir, draft_model_path=str(extra))
