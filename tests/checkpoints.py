"""Small DeepSeek checkpoints made by transformers itself, in the formats plugserve loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plugserve.core.layers.quant import dequantize_block_fp8, quantize_block_fp8

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_v3_config(**overrides):
    """DeepSeek-V3's structure: q LoRA, YaRN rope, sigmoid noaux_tc routing with groups, 1 shared expert."""
    from transformers import DeepseekV3Config

    kwargs = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, rope_scaling=YARN, max_position_embeddings=256, norm_topk_prob=True,
        routed_scaling_factor=2.5, num_nextn_predict_layers=0,
    )
    return DeepseekV3Config(**(kwargs | overrides))


def tiny_v2_lite_config(**overrides):
    """DeepSeek-V2-Lite's structure: no q LoRA, plain rope, softmax greedy routing, 2 shared experts."""
    from transformers import DeepseekV2Config

    kwargs = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, head_dim=8, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
        max_position_embeddings=256,
    )
    return DeepseekV2Config(**(kwargs | overrides))


def random_hf_model(config, seed: int = 0, std: float = 0.05):
    """A transformers DeepseekV2/V3ForCausalLM with every weight drawn here (transformers leaves some,
    like stacked experts, uninitialized outside from_pretrained): N(0, 0.05), norms N(1, 0.1), and a
    random router correction bias."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.1 if "norm" in name else std) + (1.0 if "norm" in name else 0.0))
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


def save_hf_model(model, directory: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek's published FP8 checkpoints store as e4m3: every linear weight of the decoder layers
    (attention, MLPs, experts), not the router gate, norms, embedding or lm head."""
    return tensor.dim() == 2 and ".layers." in name and "norm" not in name and ".mlp.gate." not in name


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Copy the bf16/fp32 checkpoint `src` to `dst` in DeepSeek's block-FP8 format: e4m3 weights with a
    `weight_scale_inv` per block and a `quantization_config` in config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    out: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if _is_quantized(name, tensor):
                out[name], out[name + "_scale_inv"] = quantize_block_fp8(tensor, block)
            else:
                out[name] = tensor
    save_file(out, dst / "model.safetensors")
    return dst


def write_dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """The FP8 checkpoint `src` with every weight dequantized to float32 (the reference's weights)."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(src / "model.safetensors")
    out = {
        name: dequantize_block_fp8(t, tensors[name + "_scale_inv"], block) if name + "_scale_inv" in tensors else t
        for name, t in tensors.items()
        if not name.endswith("_scale_inv")
    }
    save_file(out, dst / "model.safetensors")
    return dst


def add_mtp_layer(directory: Path, num_layers: int) -> dict[str, torch.Tensor]:
    """Give a transformers checkpoint the MTP layer DeepSeek-V3 publishes as `model.layers.{num_layers}`:
    a copy of the last decoder layer plus enorm / hnorm / eh_proj / shared_head and repeated embeddings."""
    tensors = load_file(directory / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    prefix, source = f"model.layers.{num_layers}.", f"model.layers.{num_layers - 1}."
    mtp = {prefix + name[len(source):]: t.clone() for name, t in tensors.items() if name.startswith(source)}
    generator = torch.Generator().manual_seed(3)
    mtp |= {
        prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        prefix + "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden, generator=generator),
        prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    save_file(tensors | mtp, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    return mtp


def write_nextn_draft(src: Path, dst: Path, num_layers: int, shared_copies: bool = True) -> Path:
    """The MTP layer of checkpoint `src` (at `model.layers.{num_layers}`, as `add_mtp_layer` writes it) alone, as
    SGLang's DeepSeek-V3-NextN exports it: its tensors as `model.layers.0.*` (without the repeated embedding and
    head unless `shared_copies`), a config of one decoder layer that is the NextN layer."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1, "num_nextn_predict_layers": 1}))
    source = f"model.layers.{num_layers}."
    tensors = {"model.layers.0." + name[len(source):]: t for name, t in load_file(src / "model.safetensors").items()
               if name.startswith(source)}
    if not shared_copies:
        tensors = {name: t for name, t in tensors.items()
                   if "embed_tokens" not in name and "shared_head.head" not in name}
    save_file(tensors, dst / "model.safetensors")
    return dst
