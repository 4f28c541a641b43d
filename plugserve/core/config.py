"""ModelConfig: what plugserve needs from a DeepSeek-V2/V3 `config.json`, validated.

Read through transformers' own config classes (offline), which accept both the published files
(`rope_scaling` + `rope_theta`) and transformers 5's `rope_parameters`. Keys transformers does not
model (`scoring_func`, `topk_method` for V3, `moe_layer_freq`, `quantization_config`) are read from
the attributes it keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from plugserve.core.names import PRESETS
from plugserve.core.specs import AttentionSpec, GemmSpec, MoESpec, RouterConfig

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


class ModelConfigError(ValueError):
    """A config.json plugserve cannot serve; the message names the field and the value."""


@dataclass(frozen=True)
class RopeScaling:
    """DeepSeek's YaRN: frequencies interpolated between `beta_slow` and `beta_fast` rotations over
    `original_max_position_embeddings`; cos/sin scaled by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim); the softmax scale multiplied by mscale(factor, mscale_all_dim)^2."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: Literal["deepseek_v2", "deepseek_v3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    # DeepSeekMoE; n_routed_experts None is a dense model
    n_routed_experts: int | None
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"]
    scoring_func: Literal["softmax", "sigmoid"]
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    # Block-FP8 checkpoint: (block_n, block_k); None for bf16/fp32 weights
    fp8_block: tuple[int, int] | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        from transformers import AutoConfig  # heavy: only when a model is read

        path = Path(model_dir)
        if not path.exists():
            raise ModelConfigError(f"{path} is not a local directory: plugserve reads checkpoints from disk only, "
                                   "never from the Hugging Face Hub (for a Hub id: "
                                   f"`huggingface-cli download {model_dir} --local-dir DIR`, then give DIR)")
        if not (path / "config.json").is_file():
            raise ModelConfigError(f"{path} has no config.json")
        return cls.from_hf(AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False))

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """From a transformers DeepseekV2Config / DeepseekV3Config (or any object with its attributes)."""
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(f"model_type {model_type!r} is not supported (supported: "
                                   f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        v3 = model_type == "deepseek_v3"
        get = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
        rope = dict(get("rope_parameters") or get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ModelConfigError(f"rope type {rope_type!r} is not supported (supported: default, yarn)")
        scaling = None
        if rope_type == "yarn":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast", 32)),
                beta_slow=float(rope.get("beta_slow", 1)),
                mscale=float(rope.get("mscale", 1)),
                mscale_all_dim=float(rope.get("mscale_all_dim", 0)),
            )
        if get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {get('hidden_act')!r} is not supported (supported: silu)")
        if get("attention_bias", False):
            raise ModelConfigError("attention_bias true is not supported (DeepSeek checkpoints have none)")
        eos = get("eos_token_id")
        n_routed = get("n_routed_experts")
        config = cls(
            model_type=model_type,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            intermediate_size=int(hf.intermediate_size),
            num_hidden_layers=int(hf.num_hidden_layers),
            num_attention_heads=int(hf.num_attention_heads),
            q_lora_rank=None if get("q_lora_rank") is None else int(hf.q_lora_rank),
            kv_lora_rank=int(hf.kv_lora_rank),
            qk_nope_head_dim=int(hf.qk_nope_head_dim),
            qk_rope_head_dim=int(hf.qk_rope_head_dim),
            v_head_dim=int(hf.v_head_dim),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            n_routed_experts=None if n_routed is None else int(n_routed),
            num_experts_per_tok=int(get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(get("moe_intermediate_size") or 0),
            n_shared_experts=int(get("n_shared_experts") or 0),
            first_k_dense_replace=int(get("first_k_dense_replace") or 0),
            moe_layer_freq=int(get("moe_layer_freq") or 1),
            topk_method=get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            scoring_func=get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            n_group=int(get("n_group") or 1),
            topk_group=int(get("topk_group") or 1),
            norm_topk_prob=bool(get("norm_topk_prob", False)),
            routed_scaling_factor=float(get("routed_scaling_factor") or 1.0),
            num_nextn_predict_layers=int(get("num_nextn_predict_layers") or 0),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            fp8_block=_fp8_block(get("quantization_config")),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),)),
        )
        config.validate()
        return config

    def validate(self) -> None:
        if self.n_routed_experts is None:
            return
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ModelConfigError(f"topk_method {self.topk_method!r} is not supported "
                                   "(supported: greedy, group_limited_greedy, noaux_tc)")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ModelConfigError(f"scoring_func {self.scoring_func!r} is not supported (supported: softmax, sigmoid)")
        if self.n_routed_experts % self.n_group:
            raise ModelConfigError(
                f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}"
            )
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ModelConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must lie in [1, "
                                   f"n_routed_experts={self.n_routed_experts}]")
        if not 1 <= self.topk_group <= self.n_group:
            raise ModelConfigError(f"topk_group {self.topk_group} must lie in [1, n_group={self.n_group}]")

    # -- derived -------------------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when rope is scaled."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim) ** 2
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    def router(self) -> RouterConfig:
        return RouterConfig(
            num_experts=self.n_routed_experts or 0,
            top_k=self.num_experts_per_tok,
            scoring_func=self.scoring_func,
            topk_method=self.topk_method,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def attention_spec(self, dtype: torch.dtype, page_size: int | None = None,
                       kv_cache_dtype: torch.dtype | None = None, tp_size: int = 1) -> AttentionSpec:
        """One rank's attention: the heads split over `tp_size` ranks."""
        return AttentionSpec(
            num_heads=_per_rank("num_attention_heads", self.num_attention_heads, tp_size),
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            page_size=page_size,
            sm_scale=self.softmax_scale,
        )

    def gemm_spec(self, dtype: torch.dtype) -> GemmSpec:
        return GemmSpec(dtype=dtype, block_shape=self.fp8_block or (128, 128))

    def moe_spec(self, dtype: torch.dtype, tp_size: int = 1, ep_size: int = 1, ep_rank: int = 0) -> MoESpec:
        """Rank `ep_rank`'s routed experts: each expert's intermediate width split over `tp_size` / `ep_size`
        ranks, the experts over `ep_size` (whole under expert parallelism, where ep_size = tp_size)."""
        experts = self.n_routed_experts or 0
        if experts % ep_size:
            raise ModelConfigError(f"{experts} routed experts do not split over {ep_size} expert-parallel ranks")
        return MoESpec(
            hidden_size=self.hidden_size,
            intermediate_size=_per_rank("moe_intermediate_size", self.moe_intermediate_size, tp_size // ep_size),
            dtype=dtype,
            weight_dtype=torch.float8_e4m3fn if self.fp8_block else None,
            block_shape=self.fp8_block or (128, 128),
            router=self.router(),
            ep_size=ep_size,
            ep_rank=ep_rank,
        )

    def with_layers(self, num_layers: int) -> ModelConfig:
        """The first `num_layers` decoder layers only (to fit a big model on one GPU for benchmarks)."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ModelConfigError(f"--num-layers {num_layers} must lie in [1, {self.num_hidden_layers}]")
        return replace(self, num_hidden_layers=num_layers)

    def quantized_fp8(self, block: tuple[int, int] = (128, 128)) -> ModelConfig:
        """The same model with its linear layers stored as block-FP8 (quantize-on-load)."""
        return replace(self, fp8_block=block)


def _per_rank(what: str, size: int, tp_size: int) -> int:
    if size % tp_size:
        raise ModelConfigError(f"{what} {size} does not split over {tp_size} tensor-parallel ranks")
    return size // tp_size


def _fp8_block(quantization_config: Any) -> tuple[int, int] | None:
    if not quantization_config:
        return None
    qc = dict(quantization_config) if not isinstance(quantization_config, dict) else quantization_config
    method, fmt = qc.get("quant_method"), qc.get("fmt", "e4m3")
    block = qc.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not block or len(block) != 2:
        raise ModelConfigError(
            f"quantization_config {qc} is not supported (supported: quant_method fp8, fmt e4m3, "
            "weight_block_size [n, k]: DeepSeek's published block-FP8)"
        )
    return int(block[0]), int(block[1])



def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelConfigError(f"--model-preset {name!r} is unknown (choose from {', '.join(PRESETS)})")
    return ModelConfig.from_hf(SimpleNamespace(**PRESETS[name]))
