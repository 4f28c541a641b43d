"""ModelConfig: read from saved transformers configs and hand-written published-style config.json files,
validated with errors that name the field and the value; with_layers, quantized_fp8 and the presets."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from plugserve.core.config import PRESETS, ModelConfig, ModelConfigError, RopeScaling, preset_config
from tests.checkpoints import tiny_v2_lite_config, tiny_v3_config


def _save(hf_config, directory: Path) -> Path:
    hf_config.save_pretrained(directory)
    return directory


def _write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _published_v3() -> dict:
    """DeepSeek-V3's released config.json layout: rope_scaling and rope_theta at top level."""
    config = copy.deepcopy(PRESETS["deepseek-v3"])
    config |= {
        "architectures": ["DeepseekV3ForCausalLM"],
        # the release ships remote code; plugserve reads it with transformers' own class (no trust_remote_code)
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "torch_dtype": "bfloat16", "aux_loss_alpha": 0.001, "ep_size": 1, "seq_aux": True, "moe_layer_freq": 1,
    }
    return config


def _yarn_mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0


# -- saved transformers configs ----------------------------------------------------------------------


def test_tiny_v3_fields(tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(_save(tiny_v3_config(), tmp_path))
    assert config.model_type == "deepseek_v3"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (320, 64, 96)
    assert (config.num_hidden_layers, config.num_attention_heads) == (3, 4)
    assert config.q_lora_rank == 48
    assert (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (32, 16, 8, 16)
    assert config.qk_head_dim == 24
    assert config.rope_theta == 10000.0
    assert config.rope_scaling == RopeScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                                              beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 3, 32)
    assert (config.n_shared_experts, config.n_group, config.topk_group) == (1, 4, 2)
    assert config.norm_topk_prob is True
    assert config.routed_scaling_factor == 2.5
    assert config.fp8_block is None
    assert config.eos_token_ids == (1,)
    # V3 configs carry no topk_method / scoring_func: DeepSeek-V3's own are the defaults.
    assert (config.topk_method, config.scoring_func) == ("noaux_tc", "sigmoid")
    router = config.router()
    assert (router.num_experts, router.top_k, router.topk_method, router.scoring_func) == (8, 3, "noaux_tc", "sigmoid")
    assert (router.n_group, router.topk_group, router.norm_topk_prob) == (4, 2, True)
    # first_k_dense_replace = 1
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert config.softmax_scale == pytest.approx(24**-0.5 * _yarn_mscale(4.0, 1.0) ** 2, rel=1e-12)


def test_tiny_v3_from_saved_model(tmp_path: Path) -> None:
    """A model's save_pretrained writes the same config as the config's own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_v3_config(num_hidden_layers=1, first_k_dense_replace=1))
    model.save_pretrained(tmp_path / "model")
    config = ModelConfig.from_pretrained(tmp_path / "model")
    assert config == ModelConfig.from_pretrained(_save(tiny_v3_config(num_hidden_layers=1), tmp_path / "config"))


def test_softmax_scale_yarn_mscale_all_dim(tmp_path: Path) -> None:
    """The softmax scale is multiplied by mscale(factor, mscale_all_dim)^2 (not by mscale's)."""
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.5, "mscale_all_dim": 0.707}
    config = ModelConfig.from_pretrained(_save(tiny_v3_config(rope_scaling=yarn), tmp_path))
    assert config.rope_scaling == RopeScaling(40.0, 64, 32.0, 1.0, 0.5, 0.707)
    expected = (16 + 8) ** -0.5 * (0.1 * 0.707 * math.log(40.0) + 1.0) ** 2
    assert config.softmax_scale == pytest.approx(expected, rel=1e-12)
    assert config.attention_spec(torch.float32).sm_scale == pytest.approx(expected, rel=1e-12)


def test_tiny_v2_lite_fields(tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(_save(tiny_v2_lite_config(), tmp_path))
    assert config.model_type == "deepseek_v2"
    assert config.q_lora_rank is None
    assert config.rope_scaling is None
    assert config.softmax_scale == pytest.approx(24**-0.5, rel=1e-12)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (8, 2, 2)
    assert (config.topk_method, config.scoring_func) == ("greedy", "softmax")
    router = config.router()
    assert (router.topk_method, router.scoring_func, router.n_group, router.topk_group) == ("greedy", "softmax", 1, 1)
    assert router.norm_topk_prob is False
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert config.fp8_block is None
    assert config.moe_spec(torch.float32).weight_dtype is None


def test_v2_scoring_defaults_and_explicit_values(tmp_path: Path) -> None:
    """A V2 config naming group_limited_greedy keeps it; scoring_func defaults to softmax."""
    hf = tiny_v2_lite_config(topk_method="group_limited_greedy", n_group=4, topk_group=2)
    config = ModelConfig.from_pretrained(_save(hf, tmp_path))
    assert (config.topk_method, config.scoring_func, config.n_group, config.topk_group) == (
        "group_limited_greedy", "softmax", 4, 2)


def test_v2_yarn(tmp_path: Path) -> None:
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 0.707}
    config = ModelConfig.from_pretrained(_save(tiny_v2_lite_config(rope_scaling=yarn), tmp_path))
    assert config.rope_scaling == RopeScaling(40.0, 64, 32.0, 1.0, 0.707, 0.707)
    assert config.softmax_scale == pytest.approx(24**-0.5 * _yarn_mscale(40.0, 0.707) ** 2, rel=1e-12)


def test_moe_layer_freq(tmp_path: Path) -> None:
    """DeepSeek's rule: MoE when layer_id >= first_k_dense_replace and layer_id % moe_layer_freq == 0."""
    hf = tiny_v2_lite_config(num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2)
    config = ModelConfig.from_pretrained(_save(hf, tmp_path))
    assert config.moe_layer_freq == 2
    assert [config.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    hf = tiny_v3_config(num_hidden_layers=5, first_k_dense_replace=3)
    config = ModelConfig.from_pretrained(_save(hf, tmp_path / "v3"))
    assert [config.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]


def test_dense_model_has_no_moe_layers() -> None:
    config = ModelConfig.from_hf(SimpleNamespace(**(PRESETS["tiny"] | {"n_routed_experts": None})))
    assert config.n_routed_experts is None
    assert not any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


# -- published config.json -----------------------------------------------------------------------------


def test_published_v3_config_json(tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(_write_config(tmp_path, _published_v3()))
    preset = PRESETS["deepseek-v3"]
    assert config.model_type == "deepseek_v3"
    assert config.rope_theta == 10000.0
    assert config.rope_scaling == RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                              beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert config.fp8_block == (128, 128)
    assert config.q_lora_rank == 1536
    assert (config.n_routed_experts, config.n_group, config.topk_group) == (256, 8, 4)
    assert (config.topk_method, config.scoring_func) == ("noaux_tc", "sigmoid")
    assert config.num_nextn_predict_layers == 1
    assert config.max_position_embeddings == preset["max_position_embeddings"]
    assert [config.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert config.softmax_scale == pytest.approx(192**-0.5 * _yarn_mscale(40.0, 1.0) ** 2, rel=1e-12)
    assert config.moe_spec(torch.bfloat16).weight_dtype == torch.float8_e4m3fn
    assert config.gemm_spec(torch.bfloat16).block_shape == (128, 128)
    assert config == preset_config("deepseek-v3")


def test_published_rope_theta_is_read_from_top_level(tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(_write_config(tmp_path, _published_v3() | {"rope_theta": 50000.0}))
    assert config.rope_theta == 50000.0
    assert config.rope_scaling is not None and config.rope_scaling.factor == 40.0


def test_published_fp8_block_other_shape(tmp_path: Path) -> None:
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 32]}
    config = ModelConfig.from_pretrained(_write_config(tmp_path, _published_v3() | {"quantization_config": qc}))
    assert config.fp8_block == (64, 32)


# -- errors --------------------------------------------------------------------------------------------


def _llama() -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128}


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        pytest.param(_llama(), ["model_type", "'llama'"], id="llama"),
        pytest.param(_published_v3() | {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
                     ["rope type", "'dynamic'"], id="rope-dynamic"),
        pytest.param(_published_v3() | {"quantization_config": {"quant_method": "awq", "bits": 4}},
                     ["quantization_config", "awq"], id="awq"),
        pytest.param(_published_v3() | {"hidden_act": "gelu"}, ["hidden_act", "'gelu'"], id="gelu"),
        pytest.param(_published_v3() | {"n_group": 3}, ["n_routed_experts 256", "n_group 3"], id="n-group"),
    ],
)
def test_unsupported_config_json(tmp_path: Path, config: dict, needles: list[str]) -> None:
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.from_pretrained(_write_config(tmp_path, config))
    for needle in needles:
        assert needle in str(info.value)


def test_unsupported_values_from_saved_tiny_configs(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"n_routed_experts 8 is not divisible by n_group 3"):
        ModelConfig.from_pretrained(_save(tiny_v3_config(n_group=3, topk_group=1), tmp_path / "a"))
    with pytest.raises(ModelConfigError, match=r"hidden_act 'gelu'"):
        ModelConfig.from_pretrained(_save(tiny_v2_lite_config(hidden_act="gelu"), tmp_path / "b"))


def test_missing_config_json(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    with pytest.raises(ModelConfigError, match=r"no config\.json") as info:
        ModelConfig.from_pretrained(tmp_path / "weights")
    assert str(tmp_path / "weights") in str(info.value)


# -- with_layers, quantized_fp8 --------------------------------------------------------------------------


def test_with_layers() -> None:
    config = ModelConfig.from_hf(tiny_v3_config())
    two = config.with_layers(2)
    assert two.num_hidden_layers == 2
    assert two == config.__class__(**{**config.__dict__, "num_hidden_layers": 2})
    assert config.with_layers(3) == config
    for bad in (0, 4, -1):
        with pytest.raises(ModelConfigError, match="--num-layers") as info:
            config.with_layers(bad)
        assert str(bad) in str(info.value)


def test_quantized_fp8() -> None:
    config = ModelConfig.from_hf(tiny_v3_config())
    assert config.fp8_block is None
    assert config.moe_spec(torch.float32).weight_dtype is None
    fp8 = config.quantized_fp8()
    assert fp8.fp8_block == (128, 128)
    assert fp8.moe_spec(torch.float32).weight_dtype == torch.float8_e4m3fn
    assert fp8.gemm_spec(torch.float32).block_shape == (128, 128)
    assert config.quantized_fp8((32, 64)).fp8_block == (32, 64)
    assert config.quantized_fp8((32, 64)).moe_spec(torch.float32).block_shape == (32, 64)
    assert fp8 == config.__class__(**{**config.__dict__, "fp8_block": (128, 128)})


# -- presets -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds(name: str) -> None:
    config = preset_config(name)
    preset = PRESETS[name]
    assert config.model_type == preset["model_type"]
    assert config.hidden_size == preset["hidden_size"]
    assert config.num_hidden_layers == preset["num_hidden_layers"]
    assert config.n_routed_experts == preset["n_routed_experts"]
    assert config.q_lora_rank == preset["q_lora_rank"]
    assert config.router().topk_method == preset["topk_method"]
    assert config.softmax_scale > 0
    if "quantization_config" in preset:
        assert config.fp8_block == tuple(preset["quantization_config"]["weight_block_size"])
    else:
        assert config.fp8_block is None


def test_preset_values() -> None:
    v2 = preset_config("deepseek-v2-lite")
    assert v2.q_lora_rank is None
    assert v2.rope_scaling == RopeScaling(40.0, 4096, 32.0, 1.0, 0.707, 0.707)
    assert v2.softmax_scale == pytest.approx(192**-0.5 * _yarn_mscale(40.0, 0.707) ** 2, rel=1e-12)
    assert [v2.is_moe_layer(i) for i in range(3)] == [False, True, True]
    tiny = preset_config("tiny")
    assert tiny.rope_scaling is None
    assert tiny.softmax_scale == pytest.approx(96**-0.5, rel=1e-12)


def test_unknown_preset_lists_choices() -> None:
    with pytest.raises(ModelConfigError) as info:
        preset_config("nope")
    message = str(info.value)
    assert "'nope'" in message
    for name in PRESETS:
        assert name in message


def test_moe_spec_per_rank_under_tensor_and_expert_parallelism() -> None:
    config = preset_config("deepseek-v3")  # 256 experts of width 2048
    tp = config.moe_spec(torch.bfloat16, tp_size=8)
    assert (tp.intermediate_size, tp.num_local_experts, tp.first_expert) == (256, 256, 0)
    ep = config.moe_spec(torch.bfloat16, tp_size=8, ep_size=8, ep_rank=3)
    assert (ep.intermediate_size, ep.num_local_experts, ep.first_expert) == (2048, 32, 96)
    with pytest.raises(ModelConfigError, match="256 routed experts do not split over 3 expert-parallel ranks"):
        config.moe_spec(torch.bfloat16, tp_size=3, ep_size=3)


def test_a_hub_id_says_how_to_download_it() -> None:
    with pytest.raises(ModelConfigError, match=r"huggingface-cli download deepseek-ai/DeepSeek-V3 --local-dir"):
        ModelConfig.from_pretrained("deepseek-ai/DeepSeek-V3")
