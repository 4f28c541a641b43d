"""Weights into a DeepseekForCausalLM: Hugging Face safetensors (one file or sharded), DeepSeek's
published block-FP8 format, quantize-on-load, or random weights at a preset's shapes (`dummy`).

Every tensor the model needs must be in the checkpoint and every checkpoint tensor must be used
(decoder layers beyond --num-layers, and the NextN layer when it is not kept, are skipped); each
violation is an error naming the tensors.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from plugserve.core.config import ModelConfig, ModelConfigError, preset_config
from plugserve.core.distributed import SINGLE, DPGroups, ParallelGroup
from plugserve.core.layers.linear import Linear, WeightLoadError
from plugserve.core.layers.parallel import LazySlice
from plugserve.core.layers.quant import FP8_DTYPE, FP8_MAX
from plugserve.core.models.deepseek import CheckpointTensor, DeepseekForCausalLM, ModelBackends, NextNLayer
from plugserve.core.names import LOAD_FORMATS
from plugserve.core.progress import track

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# What a separate draft checkpoint must share with the target: its NextN layer runs on the target's hidden states,
# embedding and head, in the target's layer shapes (quantization may differ: a bf16 draft is quantized on load
# into an FP8 target's layers, and an e4m3 one into a bf16 target is refused by the layers).
DRAFT_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                      "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "n_routed_experts",
                      "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "topk_method",
                      "scoring_func", "n_group", "topk_group")


class SafetensorsCheckpoint:
    """Tensors of a model directory, read lazily: `model.safetensors.index.json` when present (sharded),
    else every `*.safetensors` file in it."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._files = {name: self.model_dir / file for name, file in weight_map.items()}
            absent = sorted({str(f) for f in self._files.values() if not f.is_file()})
            if absent:
                raise WeightLoadError(f"{index} lists shards that do not exist: {', '.join(absent)}")
        else:
            paths = sorted(self.model_dir.glob("*.safetensors"))
            if not paths:
                raise WeightLoadError(f"{self.model_dir} has no *.safetensors files and no {INDEX_FILE}")
            self._files = {}
            for path in paths:
                with safe_open(path, "pt") as f:
                    self._files |= dict.fromkeys(f.keys(), path)
        self._open: dict[Path, Any] = {}  # safe_open handles

    def names(self) -> set[str]:
        return set(self._files)

    def _file(self, name: str) -> Any:
        path = self._files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, "pt")
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def get_slice(self, name: str) -> LazySlice:
        """Tensor `name`, not read yet: indexing it reads only the rows or columns indexed."""
        return self._file(name).get_slice(name)


def load_checkpoint(model: DeepseekForCausalLM, checkpoint: SafetensorsCheckpoint, checkpoint_layers: int,
                    nextn: bool = True) -> None:
    """Fill `model` from `checkpoint`, whose config has `checkpoint_layers` decoder layers; its NextN layer too
    unless `nextn` is False (a draft checkpoint gives it: `load_draft_nextn`), when the checkpoint's is skipped."""
    used = _fill(model.checkpoint_tensors(checkpoint_layers, nextn), checkpoint)
    kept_layers = set(range(model.config.num_hidden_layers))
    if model.nextn is not None and nextn:
        kept_layers.add(checkpoint_layers)
    # Layers the checkpoint has but the model leaves out (--num-layers, an unused NextN layer).
    skipped_layers = set(range(checkpoint_layers + model.config.num_nextn_predict_layers)) - kept_layers
    unexpected = sorted(
        name for name in checkpoint.names() - used
        if not ((m := _LAYER.match(name)) and int(m.group(1)) in skipped_layers) and not name.endswith("inv_freq")
    )
    if unexpected:
        raise WeightLoadError(f"{checkpoint.model_dir}: {len(unexpected)} tensors the model does not have: "
                              + _some(unexpected))


def draft_nextn_prefix(config: ModelConfig) -> str | None:
    """Where a draft checkpoint keeps its NextN layer: `model.layers.0` in a NextN-only export (as many decoder
    layers as NextN layers, e.g. SGLang's DeepSeek-V3-NextN), else after its decoder layers, as in DeepSeek-V3's
    own checkpoint; None when its config declares none."""
    if config.num_nextn_predict_layers < 1:
        return None
    only_nextn = config.num_hidden_layers == config.num_nextn_predict_layers
    return "model.layers.0" if only_nextn else f"model.layers.{config.num_hidden_layers}"


def load_draft_nextn(model: DeepseekForCausalLM, draft_path: str) -> None:
    """Fill `model`'s NextN layer from the draft checkpoint in `draft_path` (`draft_nextn_prefix`), which must
    have the target's shapes (DRAFT_SHAPE_FIELDS); its other tensors (its own decoder layers, embedding and head)
    are not read. Raises ModelConfigError / WeightLoadError naming the flag and what does not fit."""
    assert model.nextn is not None
    where = f"--speculative-draft-model-path {draft_path}"
    config = ModelConfig.from_pretrained(draft_path)
    mismatched = [f"{field} {getattr(config, field)} (the target's: {getattr(model.config, field)})"
                  for field in DRAFT_SHAPE_FIELDS if getattr(config, field) != getattr(model.config, field)]
    if mismatched:
        raise ModelConfigError(f"{where}: its NextN layer does not fit the target: {', '.join(mismatched)}")
    prefix = draft_nextn_prefix(config)
    if prefix is None:
        raise ModelConfigError(f"{where}: its config.json declares no NextN layer (num_nextn_predict_layers is 0)")
    checkpoint = SafetensorsCheckpoint(draft_path)
    expected = model.nextn.checkpoint_tensors(prefix, model.config.vocab_size)
    for copy in NextNLayer.SHARED_COPIES:  # a NextN-only export may leave out its copies of the shared ones
        if f"{prefix}.{copy}" not in checkpoint.names():
            del expected[f"{prefix}.{copy}"]
    used = _fill(expected, checkpoint, where)
    unexpected = sorted(name for name in checkpoint.names() - used if name.startswith(prefix + "."))
    if unexpected:
        raise WeightLoadError(f"{where}: {len(unexpected)} tensors of its NextN layer ({prefix}) the model does not "
                              "have: " + _some(unexpected))


def _fill(expected: dict[str, CheckpointTensor], checkpoint: SafetensorsCheckpoint, where: str | None = None
          ) -> set[str]:
    """Load every tensor of `expected` (by checkpoint name) from `checkpoint`, with its block scales where it has
    them; returns the names read (scales included). Raises WeightLoadError naming those missing."""
    available = checkpoint.names()
    missing = sorted(name for name in expected if name not in available)
    if missing:
        raise WeightLoadError(f"{where or checkpoint.model_dir}: {len(missing)} tensors the model needs are missing: "
                              + _some(missing))
    used = set()
    for name, target in track(expected.items(), len(expected), "loading weights", "tensors"):
        scale_name = name + SCALE_SUFFIX
        used.update((name, scale_name))
        if not target.read:
            continue
        scale = checkpoint.get(scale_name) if scale_name in available else None
        target.load(name, checkpoint.get_slice(name) if target.lazy else checkpoint.get(name), scale)
    return used


def init_dummy_weights(model: DeepseekForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random weights with the model's real shapes: N(0, std) for float tensors (norm weights stay 1,
    the router bias 0), and for block-FP8 layers e4m3 values with scales that dequantize to N(0, std).
    Drawn on the model's device (a 15B model in seconds on a GPU); the seed fixes them per device type.
    Each rank of a tensor-parallel model draws its own slices: the weights depend on the world size."""
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    fp8_spread = FP8_MAX / 4  # keeps e4m3 values well inside the +-448 range

    chunk = 2**24  # elements drawn at once: one reused float32 buffer, not a copy of each weight
    buffer = torch.empty(chunk, device=device)

    def fill(param: torch.Tensor, scale: float) -> None:
        flat = param.data.view(-1)
        for start in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - start)
            values = buffer[:n]
            torch.randn(n, generator=generator, out=values).mul_(scale)
            if flat.dtype == FP8_DTYPE:
                values.clamp_(-FP8_MAX, FP8_MAX)
            flat[start : start + n].copy_(values)

    for module in model.modules():
        if isinstance(module, Linear):
            if module.fp8_block is None:
                fill(module.weight, std)
            else:
                fill(module.weight, fp8_spread)
                module.weight_scale_inv.data.fill_(std / fp8_spread)
    fill(model.embed_tokens.weight, std)
    fill(model.lm_head.weight, std)
    for layer in model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            fill(gate, std)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """--dtype: auto (bfloat16 on a GPU, float32 on the CPU), bfloat16, float16 or float32."""
    choices = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in choices:
        raise ValueError(f"--dtype {dtype!r} is not supported (choose from auto, {', '.join(choices)})")
    return choices[dtype]


def read_config(model_path: str | None, model_preset: str | None, quantization: str | None = None,
                num_layers: int | None = None) -> tuple[ModelConfig, int]:
    """The model's config (from the checkpoint in `model_path`, else --model-preset's) and its checkpoint's layer
    count. ServerArgs.model_dir says which checkpoint a server reads (the embedded model when no flag names one)."""
    if model_path is not None:
        config = ModelConfig.from_pretrained(model_path)
    elif model_preset is not None:
        config = preset_config(model_preset)
    else:
        raise ValueError("a model needs a checkpoint directory or a --model-preset")
    checkpoint_layers = config.num_hidden_layers
    if quantization not in (None, "fp8"):
        raise ValueError(f"--quantization {quantization!r} is not supported (choose from fp8)")
    if quantization == "fp8" and config.fp8_block is None:
        config = config.quantized_fp8()
    elif quantization == "fp8":
        block = "x".join(map(str, config.fp8_block))  # type: ignore[arg-type]
        logger.warning("--quantization fp8: the checkpoint is block-FP8 already (%s blocks): its weights are used "
                       "as stored", block)
    if num_layers is not None:
        config = config.with_layers(num_layers)
    return config, checkpoint_layers


def load_model(
    config: ModelConfig,
    backends: ModelBackends,
    *,
    model_path: str | None,
    checkpoint_layers: int,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    group: ParallelGroup = SINGLE,
    expert_parallel: bool = False,
    dp: DPGroups | None = None,
    draft_model_path: str | None = None,
    dummy_nextn: bool = False,
) -> DeepseekForCausalLM:
    """Build the model (this rank's part of it, split over `group`, the routed experts whole when
    `expert_parallel`, the attention over its DP group's ranks under DP attention, `dp`), fill its weights (its
    NextN layer's from `draft_model_path` when given, else from the checkpoint when it has one; with dummy weights,
    random like the rest when `dummy_nextn` and the config declares one: speculative decoding on a preset's
    shapes), and pack them for `backends` (built for this rank's shapes: `ModelConfig.attention_spec` / `moe_spec`
    with the world size, the attention's with the DP group's ranks under DP attention, and the rank under expert
    parallelism)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not supported (choose from {', '.join(LOAD_FORMATS)})")
    dummy = load_format == "dummy" or model_path is None
    checkpoint = None if dummy else SafetensorsCheckpoint(model_path)  # type: ignore[arg-type]
    declared = config.num_nextn_predict_layers > 0
    with_nextn = draft_model_path is not None or (
        (dummy_nextn and declared) if checkpoint is None
        else declared and f"model.layers.{checkpoint_layers}.eh_proj.weight" in checkpoint.names()
    )
    model = DeepseekForCausalLM(config, dtype, device, with_nextn=with_nextn, group=group,
                                expert_parallel=expert_parallel, dp=dp)
    if checkpoint is None:
        init_dummy_weights(model, seed)
    else:
        load_checkpoint(model, checkpoint, checkpoint_layers, nextn=draft_model_path is None)
    if draft_model_path is not None:
        load_draft_nextn(model, draft_model_path)
    model.finalize(backends)
    return model


def _some(names: list[str], limit: int = 8) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
