"""What a model asks a backend to solve: the shapes and dtypes of its attention, block-FP8 linears and MoE
layers, per rank, and the all-reduces of its tensor-parallel ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from plugserve.core.names import KINDS, Kind

# --kv-cache-dtype's values (but auto) as torch dtypes.
KV_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                                     "fp8_e4m3": torch.float8_e4m3fn}

__all__ = ["KINDS", "SPEC_TYPES", "AttentionSpec", "CommSpec", "GemmSpec", "Kind", "MoESpec", "RouterConfig"]


@dataclass(frozen=True)
class AttentionSpec:
    """MLA shapes of one model (defaults: DeepSeek-V3 on one GPU). `page_size` None lets the decode
    backend choose. `sm_scale` None is 1/sqrt(qk_nope + qk_rope); YaRN models pass their own.
    `kv_cache_dtype` None is the activation dtype `dtype`; float8_e4m3fn stores the pool scaled by the pool's
    per-tensor `MLAKVPool.scale` (`kv_dtype` resolves it). `batch_invariant`: a request's output must not depend
    on the batch around it (only backends whose capabilities declare `batch_invariant` fit)."""

    num_heads: int = 128
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: torch.dtype | None = None  # None: the activation dtype
    page_size: int | None = None
    sm_scale: float | None = None
    batch_invariant: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(self.qk_head_dim)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: `kv_cache_dtype`, or the activation dtype when that is None."""
        return self.kv_cache_dtype if self.kv_cache_dtype is not None else self.dtype


@dataclass(frozen=True)
class GemmSpec:
    """Block-FP8 linear: e4m3 weights in `block_shape` blocks, activations quantized per
    1 x block_shape[1] token group, output in `dtype`. `batch_invariant` as in `AttentionSpec`."""

    dtype: torch.dtype = torch.bfloat16
    block_shape: tuple[int, int] = (128, 128)
    batch_invariant: bool = False


@dataclass(frozen=True)
class RouterConfig:
    """DeepSeek's gate. `topk_method`: "greedy" (V2-Lite), "group_limited_greedy" (V2: best experts of
    the `topk_group` groups with the highest max score), "noaux_tc" (V3: sigmoid scores, plus
    `e_score_correction_bias` for choosing only, groups ranked by the sum of their top-2)."""

    num_experts: int = 256
    top_k: int = 8
    scoring_func: Literal["softmax", "sigmoid"] = "sigmoid"
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "noaux_tc"
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    # Applied by `MoEBackend.forward`; `route` reads it only to weight fused shared experts.
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of one MoE layer (defaults: DeepSeek-V3). `weight_dtype` float8_e4m3fn: block-FP8
    with `block_shape` scales; None: unquantized, in `dtype`.

    `num_shared_experts` S > 0 (only for backends whose capabilities declare `shared_experts_fusion`):
    the layer's shared MLP, S x intermediate_size wide, runs inside the backend as S more experts that
    every token uses. `prepare` gets its weights, `route` returns k + S columns (the shared ids E .. E+S-1
    last, weighted 1 / routed_scaling_factor, which `forward`'s factor cancels), and `forward` returns
    routed + shared: one set of GEMMs instead of the routed ones plus a dense MLP.

    `ep_size` > 1 (expert parallelism; only for backends whose capabilities declare `expert_parallel`): this
    rank, `ep_rank`, holds the E / ep_size whole experts [first_expert, first_expert + num_local_experts).
    `route` still ranks all E and returns their global ids; `prepare` gets the local experts only, and
    `forward` adds only their terms (a slot naming another rank's expert contributes zero), so that the
    ranks' outputs sum to the whole layer's. `batch_invariant` as in `AttentionSpec`."""

    hidden_size: int = 7168
    intermediate_size: int = 2048
    dtype: torch.dtype = torch.bfloat16
    weight_dtype: torch.dtype | None = torch.float8_e4m3fn
    block_shape: tuple[int, int] = (128, 128)
    router: RouterConfig = field(default_factory=RouterConfig)
    num_shared_experts: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.num_experts % self.ep_size or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} of ep_size {self.ep_size}: the {self.num_experts} experts "
                             "must split evenly and the rank lie in [0, ep_size)")
        if self.ep_size > 1 and self.num_shared_experts:
            # Shared experts are split by width over the ranks, routed ones by expert: no common GEMM.
            raise ValueError("fused shared experts (num_shared_experts) do not combine with ep_size > 1")

    @property
    def num_experts(self) -> int:
        """E: all the layer's routed experts (the router's)."""
        return self.router.num_experts

    @property
    def num_local_experts(self) -> int:
        """The experts this rank holds: E / ep_size."""
        return self.num_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        """The global id of this rank's first expert."""
        return self.ep_rank * self.num_local_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @property
    def routed_width(self) -> int:
        """Columns of `route`'s output: top_k, plus the fused shared experts."""
        return self.router.top_k + self.num_shared_experts

    @property
    def is_fp8(self) -> bool:
        return self.weight_dtype == torch.float8_e4m3fn

    @property
    def weight_format(self) -> str:
        return "fp8_block" if self.is_fp8 else "unquantized"


@dataclass(frozen=True)
class CommSpec:
    """The all-reduces of one tensor-parallel group: `world_size` ranks on `nodes` hosts, summing tensors of
    `dtype` (the model's activations). `batch_invariant` (--enable-deterministic-inference): each element's sum the
    same whatever the message's size. `group`: their torch.distributed process group (None: the default group),
    which a backend builds on; not part of the problem's identity."""

    world_size: int = 2
    dtype: torch.dtype = torch.bfloat16
    nodes: int = 1
    batch_invariant: bool = False
    group: Any = field(default=None, compare=False, repr=False)


SPEC_TYPES: dict[Kind, type] = {"attention": AttentionSpec, "gemm": GemmSpec, "moe": MoESpec, "comm": CommSpec}
