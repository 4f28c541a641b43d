"""The torch reference MoE: DeepSeek's router and a per-expert loop over the routed experts, itself
checked against the kit's float64 oracle (plugserve/conformance/oracle.py). Runs on the CPU and on CUDA.

The router follows HF transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter except that it
leaves routed_scaling_factor out of the weights (the MoEBackend contract applies it in `forward`).
With FP8 block weights the experts also quantize their activations per 1 x bk token group, as a
w8a8 kernel does, so that the reference computes what such a kernel computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from plugserve.core.batch_invariant import batch_invariant
from plugserve.core.interfaces import MoEBackend, MoECapabilities, MoEWeights, check_tensor
from plugserve.core.layers.quant import FP8_DTYPE, ceil_div, dequantize_block_fp8, per_token_group_quant_fp8
from plugserve.core.specs import RouterConfig
from plugserve.registry import hookimpl


def _keep_top_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """scores [T, E] with every expert outside the `topk_group` best groups (group_scores [T, G])
    set to `fill`."""
    num_tokens, num_groups = group_scores.shape
    group_size = scores.shape[1] // num_groups
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    score_mask = group_mask.unsqueeze(-1).expand(-1, -1, group_size).reshape(num_tokens, -1)
    return scores.masked_fill(~score_mask, fill)


def select_experts(
    router_logits: torch.Tensor, router: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's gate: router_logits [T, E] float32 (correction_bias [E], noaux_tc only) ->
    (topk_weights [T, k] float32, topk_ids [T, k] int32), ids in no particular order.

    The weights are the scores of the chosen experts, normalized to sum 1 when
    `router.norm_topk_prob`, without routed_scaling_factor.
    """
    num_tokens, num_experts = router_logits.shape
    if num_experts != router.num_experts:
        raise ValueError(f"router_logits must be [T, {router.num_experts}], got {tuple(router_logits.shape)}")
    if router.topk_method != "greedy" and num_experts % router.n_group:
        raise ValueError(f"{router.topk_method} needs num_experts ({num_experts}) divisible by n_group "
                         f"({router.n_group})")
    if correction_bias is not None and router.topk_method != "noaux_tc":
        raise ValueError(f"correction_bias is only used by noaux_tc, not by {router.topk_method}")

    logits = router_logits.float()
    if router.scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif router.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unknown scoring_func {router.scoring_func!r}")

    if router.topk_method == "greedy":
        topk_weights, topk_ids = torch.topk(scores, k=router.top_k, dim=-1, sorted=False)
    elif router.topk_method == "group_limited_greedy":
        group_scores = scores.view(num_tokens, router.n_group, -1).amax(dim=-1)
        # Masked experts score 0 (not -inf), as in DeepSeek's and HF's code; scores are >= 0 anyway.
        masked = _keep_top_groups(scores, group_scores, router.topk_group, 0.0)
        topk_weights, topk_ids = torch.topk(masked, k=router.top_k, dim=-1, sorted=False)
    elif router.topk_method == "noaux_tc":
        if correction_bias is None or tuple(correction_bias.shape) != (num_experts,):
            got = None if correction_bias is None else tuple(correction_bias.shape)
            raise ValueError(f"noaux_tc needs correction_bias of shape ({num_experts},), got {got}")
        # The bias only decides which experts are chosen; their weights are the unbiased scores.
        scores_for_choice = scores + correction_bias.float()
        group_scores = scores_for_choice.view(num_tokens, router.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        masked = _keep_top_groups(scores_for_choice, group_scores, router.topk_group, float("-inf"))
        topk_ids = torch.topk(masked, k=router.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
    else:
        raise ValueError(f"unknown topk_method {router.topk_method!r}")

    if router.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights, topk_ids.to(torch.int32)


def _fake_quant_fp8(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] -> float32 [M, K] rounded as per-token-group e4m3 quantization rounds it."""
    x_q, scales = per_token_group_quant_fp8(x, group_size)
    return dequantize_block_fp8(x_q, scales, (1, group_size))


def _expert_weight(
    w: torch.Tensor, scale_inv: torch.Tensor | None, expert: int, block_shape: tuple[int, int]
) -> torch.Tensor:
    if scale_inv is None:
        return w[expert].float()
    return dequantize_block_fp8(w[expert], scale_inv[expert], block_shape)


def fused_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
    first_expert: int = 0,
) -> torch.Tensor:
    """Routed experts, one expert at a time, in float32.

    x [T, H]; w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up) and w2 [E, H, I], in any float dtype,
    or float8_e4m3fn with block scales w13_scale_inv [E, ceil(2I/bn), ceil(H/bk)] and
    w2_scale_inv [E, ceil(H/bn), ceil(I/bk)] float32, experts first_expert .. first_expert + E - 1;
    topk_ids [T, k] integer, topk_weights [T, k]. Returns routed_scaling_factor * sum_j topk_weights[t, j] *
    W2 (silu(W_gate x) * (W_up x)) of expert topk_ids[t, j] over the slots whose expert is one of these
    (others, such as another rank's, contribute nothing), [T, H] of x.dtype. With FP8 weights x and the
    intermediate h are quantized per 1 x block_shape[1] token group before their GEMMs.
    """
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 and (w13_scale_inv is None or w2_scale_inv is None):
        raise ValueError("float8_e4m3fn expert weights need w13_scale_inv and w2_scale_inv")
    num_experts, intermediate = w2.shape[0], w2.shape[2]
    group_size = block_shape[1]
    x32 = _fake_quant_fp8(x, group_size) if fp8 else x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local_ids = topk_ids - first_expert
    for expert in local_ids.unique().tolist():
        if not 0 <= expert < num_experts:
            continue
        token_idx, slot = torch.where(local_ids == expert)
        gate_up = x32[token_idx] @ _expert_weight(w13, w13_scale_inv, expert, block_shape).T
        h = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        if fp8:
            h = _fake_quant_fp8(h, group_size)
        y = h @ _expert_weight(w2, w2_scale_inv, expert, block_shape).T
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot].float().unsqueeze(-1))
    return (out * routed_scaling_factor).to(x.dtype)


@dataclass(frozen=True)
class TorchRefMoEWeights:
    """w13 [E, 2I, H], w2 [E, H, I] and, for FP8, their block scales (see MoEBackend.prepare)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale_inv: torch.Tensor | None
    w2_scale_inv: torch.Tensor | None


class TorchRefMoE(MoEBackend):
    name: ClassVar[str] = "torch_ref"
    verified: ClassVar[str] = "cpu"
    capabilities: ClassVar[MoECapabilities] = MoECapabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        devices=frozenset({"cpu", "cuda"}),
        cuda_graph=False,  # forward loops over the experts it finds on the host (unique().tolist())
        expert_parallel=True,
        batch_invariant=True,  # matmuls in fixed row blocks (core/batch_invariant.py) under the spec's flag
    )
    priority: ClassVar[dict[str, int]] = {"default": 0}

    def route(
        self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] float32 -> (topk_weights [T, k] float32, topk_ids [T, k] int32)."""
        with batch_invariant(self.spec.batch_invariant):
            return select_experts(router_logits, self.spec.router, correction_bias)

    def route_hidden(
        self, x: torch.Tensor, gate: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`MoEBackend.route_hidden`, its gate GEMM batch-invariant too under the spec's flag."""
        with batch_invariant(self.spec.batch_invariant):
            return super().route_hidden(x, gate, correction_bias)

    def prepare(self, weights: MoEWeights) -> TorchRefMoEWeights:
        """The routed experts of `weights` (no shared ones: this backend does not fuse them), kept as they are."""
        spec = self.spec
        w13, w2, w13_scale_inv, w2_scale_inv = weights.w13, weights.w2, weights.w13_scale_inv, weights.w2_scale_inv
        if weights.shared_w13 is not None or weights.shared_w2 is not None:
            raise ValueError(f"the {self.name} MoE backend does not fuse shared experts")
        e, h, i = spec.num_local_experts, spec.hidden_size, spec.intermediate_size
        weight_dtype = FP8_DTYPE if spec.is_fp8 else spec.dtype
        check_tensor("w13", w13, (e, 2 * i, h), weight_dtype)
        check_tensor("w2", w2, (e, h, i), weight_dtype)
        if spec.is_fp8:
            if w13_scale_inv is None or w2_scale_inv is None:
                raise ValueError("fp8_block experts need w13_scale_inv and w2_scale_inv")
            bn, bk = spec.block_shape
            w13_grid = (e, ceil_div(2 * i, bn), ceil_div(h, bk))
            w2_grid = (e, ceil_div(h, bn), ceil_div(i, bk))
            check_tensor("w13_scale_inv", w13_scale_inv, w13_grid, torch.float32)
            check_tensor("w2_scale_inv", w2_scale_inv, w2_grid, torch.float32)
        elif w13_scale_inv is not None or w2_scale_inv is not None:
            raise ValueError(f"unquantized experts ({spec.dtype}) take no w13_scale_inv / w2_scale_inv")
        return TorchRefMoEWeights(w13, w2, w13_scale_inv, w2_scale_inv)

    def forward(
        self,
        x: torch.Tensor,
        packed: TorchRefMoEWeights,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        routed_scaling_factor: float,
    ) -> torch.Tensor:
        """x [T, H] of spec.dtype, topk_ids [T, k] int32 (global ids), topk_weights [T, k] float32 -> [T, H]:
        the terms of this rank's experts."""
        self.check_forward_inputs(x, topk_ids, topk_weights)
        num_experts = self.spec.num_experts
        if topk_ids.numel() and not (int(topk_ids.min()) >= -1 and int(topk_ids.max()) < num_experts):
            # Ids are route's, of every expert, or -1 (a slot to skip): another is a caller's bug, not another
            # rank's expert.
            raise ValueError(f"topk_ids must lie in [0, {num_experts}) or be -1, got [{int(topk_ids.min())}, "
                             f"{int(topk_ids.max())}]")
        with batch_invariant(self.spec.batch_invariant):
            return fused_experts_reference(
                x, packed.w13, packed.w2, topk_ids, topk_weights, routed_scaling_factor,
                packed.w13_scale_inv, packed.w2_scale_inv, self.spec.block_shape, self.spec.first_expert,
            )


@hookimpl
def plugserve_backends() -> list[type[MoEBackend]]:
    return [TorchRefMoE]
