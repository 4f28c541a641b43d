"""Export a trained model in DeepSeek-V3's published format (training/verify.py checks the export).

The folder holds what DeepSeek's Hugging Face repositories hold, at this model's size:
- config.json with DeepSeek's keys (architectures DeepseekV3ForCausalLM, noaux_tc, yarn rope_scaling,
  num_nextn_predict_layers 1, and quantization_config fp8 / e4m3 / dynamic / weight_block_size [128, 128]);
- model-0000i-of-0000n.safetensors shards and model.safetensors.index.json: the linear weights of attention, MLPs,
  experts and eh_proj as float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block; embeddings, lm head,
  norms and router gates in bfloat16; the routers' e_score_correction_bias in float32; experts one by one
  (`mlp.experts.{e}.gate_proj` ...); the MTP layer under `model.layers.{num_hidden_layers}` with enorm, hnorm,
  eh_proj, shared_head.norm, and the copies of the embedding (`embed_tokens`) and lm head (`shared_head.head`)
  DeepSeek's checkpoints repeat there;
- tokenizer.json and tokenizer_config.json (with the chat template).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from plugserve.core.layers.quant import quantize_block_fp8
from training.model import TrainingModel

BLOCK = (128, 128)
# Shards of at most this size, as DeepSeek shards its checkpoints (with model.safetensors.index.json): the device
# tool brings back files of 16 MiB at most.
MAX_SHARD_BYTES = 12 * 2**20
INDEX_FILE = "model.safetensors.index.json"
# What DeepSeek's block-FP8 checkpoints store as e4m3: every linear layer of the decoder layers and the MTP's
# eh_proj; not the norms, embeddings, lm head or router gates.
QUANTIZED = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight",
             "gate_proj.weight", "up_proj.weight", "down_proj.weight", "eh_proj.weight")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def deepseek_tensors(model: TrainingModel) -> dict[str, torch.Tensor]:
    """Every tensor of the model under its name in DeepSeek's checkpoints, float32 on the CPU. transformers keeps
    experts stacked (gate_up_proj [E, 2I, H] = [gate; up], down_proj [E, H, I]); DeepSeek stores them one by one."""
    tensors: dict[str, torch.Tensor] = {}

    def add(name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().float().cpu()
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1), strict=True)):
                tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                tensors[f"{prefix}{e}.down_proj.weight"] = down
        else:
            tensors[name] = tensor

    for name, tensor in model.lm.state_dict().items():
        add(name, tensor)
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    for name, tensor in model.mtp.state_dict().items():
        add(mtp + name.removeprefix("layer."), tensor)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return tensors


def quantize_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's stored tensors: block-FP8 + weight_scale_inv where DeepSeek quantizes, float32 correction
    biases, bfloat16 for the rest."""
    stored = {}
    for name, tensor in tensors.items():
        if name.endswith(QUANTIZED):
            stored[name], stored[name + "_scale_inv"] = quantize_block_fp8(tensor, BLOCK)
        elif name.endswith("e_score_correction_bias"):
            stored[name] = tensor.float().contiguous()
        else:
            stored[name] = tensor.to(torch.bfloat16).contiguous()
    return stored


def deepseek_config(model: TrainingModel) -> dict:
    """config.json with the keys of DeepSeek-V3's (less auto_map: transformers has the model built in)."""
    c = model.config
    rope = c.rope_parameters
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": model.balance_alpha,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "ep_size": 1,
        "first_k_dense_replace": c.first_k_dense_replace,
        "hidden_act": c.hidden_act,
        "hidden_size": c.hidden_size,
        "initializer_range": c.initializer_range,
        "intermediate_size": c.intermediate_size,
        "kv_lora_rank": c.kv_lora_rank,
        "max_position_embeddings": c.max_position_embeddings,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_layer_freq": 1,
        "n_group": c.n_group,
        "n_routed_experts": c.n_routed_experts,
        "n_shared_experts": c.n_shared_experts,
        "norm_topk_prob": c.norm_topk_prob,
        "num_attention_heads": c.num_attention_heads,
        "num_experts_per_tok": c.num_experts_per_tok,
        "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "num_nextn_predict_layers": 1,
        "pretraining_tp": 1,
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": list(BLOCK)},
        "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": {key: rope[key] for key in ("beta_fast", "beta_slow", "factor", "mscale", "mscale_all_dim",
                                                    "original_max_position_embeddings")} | {"type": "yarn"},
        "rope_theta": rope["rope_theta"],
        "routed_scaling_factor": c.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": c.topk_group,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "v_head_dim": c.v_head_dim,
        "vocab_size": c.vocab_size,
    }


def save_sharded(tensors: dict[str, torch.Tensor], output: Path) -> None:
    """Safetensors shards of at most MAX_SHARD_BYTES (tensors in order) and their index, as DeepSeek publishes."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, output / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (output / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def export(model: TrainingModel, tokenizer_dir: Path, output: Path) -> dict[str, int]:
    """Write the checkpoint folder; returns each file's size in bytes."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(deepseek_config(model), indent=2) + "\n")
    save_sharded(quantize_checkpoint(deepseek_tensors(model)), output)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, output / name)
    return {path.name: path.stat().st_size for path in sorted(output.iterdir())}
