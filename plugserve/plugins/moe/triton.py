"""The `triton` MoE backend: DeepSeek's router and the routed experts as Triton kernels, in the
activation dtype (bf16 / fp16 / fp32 experts) or block-FP8 w8a8 (e4m3 experts in 128 x 128 blocks,
activations quantized per 1 x 128 token group).

- `route`: one fused kernel for every router variant (greedy, group_limited_greedy, noaux_tc; softmax
  or sigmoid scores), one program per token. `route_hidden` at decode sizes: the gate GEMV and that
  selection in one launch (`fused_router`: the programs that stream the gate count themselves in, and
  the last one selects).
- `forward`: moe_align_block_size (pairs sorted by expert, padded to BLOCK_SIZE_M), a grouped GEMM
  over w13 with SiLU-and-mul in its epilogue, a grouped GEMM over w2 multiplying by the top-k weight
  times routed_scaling_factor in its epilogue, and a top-k sum (for one token, in that epilogue too;
  see `fused_experts`). Launch configurations come from tuned files in `configs/`
  (benchmarks/tune/tune_fused_moe.py) or a default.
- Shared-expert fusion (`MoESpec.num_shared_experts`): `prepare` appends the shared MLP (`MoEWeights.shared_w13`,
  `shared_w2`) as extra experts, the router kernel gives them to every token, and `forward` returns routed +
  shared from the same GEMMs.
- Batch invariance (`MoESpec.batch_invariant`, --enable-deterministic-inference): a token's result must not depend
  on the tokens beside it, so every token count takes one path: `route_hidden` the gate's logits in fixed token tiles
  (`router.router_logits`) and `route`, never the fused router; `forward` one launch config
  (`configs.batch_invariant_config`: no split-K, no column kernel) and no one-token path (`fused_experts`).

The kernels live in `router`, `align`, `quant`, `grouped_gemm` and `experts`, imported on first use:
loading this plugin does not import Triton. On the CPU the kernels run only in Triton's interpreter
(TRITON_INTERPRET=1), for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, Availability, MoEBackend, MoECapabilities, MoEWeights, check_tensor
from plugserve.core.layers.quant import FP8_DTYPE, ceil_div
from plugserve.core.specs import MoESpec
from plugserve.plugins.moe.configs import MoEConfig, batch_invariant_config, get_config
from plugserve.plugins.triton_support import triton_availability
from plugserve.registry import hookimpl

# FP8 tensor cores (tl.dot on float8e4nv) need Ada / Hopper or newer.
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class TritonMoECapabilities(MoECapabilities):
    """MoECapabilities plus the rule that block-FP8 experts need an sm89+ GPU. `check` has no
    hardware argument: it asks about the current CUDA device, when there is one (on the CPU, Triton's
    interpreter runs FP8 anywhere)."""

    fp8_min_capability: tuple[int, int] = FP8_MIN_CAPABILITY

    def check(self, spec: MoESpec, phase: Phase) -> Availability:
        fits = super().check(spec, phase)
        if not fits or not spec.is_fp8 or not torch.cuda.is_available():
            return fits
        hardware = Hardware.detect("cuda")
        if hardware.capability is not None and hardware.capability < self.fp8_min_capability:
            major, minor = self.fp8_min_capability
            return Availability.no(f"fp8_block experts need FP8 tensor cores (sm{major}{minor} or newer), "
                                   f"this GPU is {hardware.arch}")
        return OK


@dataclass(frozen=True)
class TritonMoEWeights:
    """w13 [E + S, 2I, H], w2 [E + S, H, I] (S fused shared experts after the E routed ones), of the
    activation dtype or float8_e4m3fn with block scales [E + S, ceil(2I/bn), ceil(H/bk)] and
    [E + S, ceil(H/bn), ceil(I/bk)] float32."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale_inv: torch.Tensor | None
    w2_scale_inv: torch.Tensor | None


class TritonMoE(MoEBackend):
    """Routed experts (and optionally the shared ones) as Triton kernels; see the module docstring."""

    name: ClassVar[str] = "triton"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[TritonMoECapabilities] = TritonMoECapabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        devices=frozenset({"cuda", "cpu"}),
        cuda_graph=True,  # every buffer and grid sized from T alone; the alignment's counts stay on the device
        batch_invariant=True,  # under the spec's flag: one route path and one launch config at every token count
        shared_experts_fusion=True,
        expert_parallel=True,  # the kernels drop ids outside the packed experts
    )
    priority: ClassVar[dict[str, int]] = {"cuda": 50, "cpu": -1}  # on the CPU (interpreter) the reference wins

    def __init__(self, spec: MoESpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self._hardware = Hardware.detect(device)
        from plugserve.plugins.moe.grouped_gemm import MIN_BLOCK_N
        from plugserve.plugins.moe.router import FUSED_ROUTER_MAX_TOKENS

        # fused_router's float32 logits and arrival count, and the w2 pass's arrival counts (one per column block of
        # the smallest BLOCK_N) for one token's top-k sum, made here (not in a forward a CUDA graph may capture) and
        # shared by every layer and replay.
        self._router_scratch = (
            torch.empty(FUSED_ROUTER_MAX_TOKENS * spec.num_experts, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )
        self._pair_sum_arrived = torch.zeros(ceil_div(spec.hidden_size, MIN_BLOCK_N), dtype=torch.int32, device=device)

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = super().availability(hardware)
        return triton_availability(hardware) if available else available

    def route(
        self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] float32 (correction_bias [E], noaux_tc only) -> (topk_weights [T, k]
        float32, topk_ids [T, k] int32), best expert first, without routed_scaling_factor."""
        from plugserve.plugins.moe.router import grouped_topk

        if router_logits.dim() != 2:
            raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
        self._check_routing(router_logits.shape[1], correction_bias)
        return grouped_topk(router_logits, correction_bias, self.spec.router, self.spec.num_shared_experts)

    def route_hidden(
        self, x: torch.Tensor, gate: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`MoEBackend.route_hidden`. Up to FUSED_ROUTER_MAX_TOKENS tokens (decode) in one kernel, `fused_router`:
        the gate's logits and the selection, where the GEMM and `route` take two launches. Under spec.batch_invariant
        `router_logits` and `route` at every token count."""
        from plugserve.plugins.moe.router import FUSED_ROUTER_MAX_TOKENS, fused_router, router_logits

        invariant = self.spec.batch_invariant
        if not invariant and (x.dim() != 2 or x.shape[0] > FUSED_ROUTER_MAX_TOKENS):
            return super().route_hidden(x, gate, correction_bias)
        if x.dim() != 2 or gate.dim() != 2 or gate.shape[1] != x.shape[1]:
            raise ValueError(f"gate must be [E, H] for x [T, H], got gate {tuple(gate.shape)} for x {tuple(x.shape)}")
        self._check_routing(gate.shape[0], correction_bias)
        if invariant:
            return self.route(router_logits(x, gate.contiguous()), correction_bias)
        return fused_router(x, gate.contiguous(), correction_bias, self.spec.router, self.spec.num_shared_experts,
                            self._router_scratch)

    def _check_routing(self, num_experts: int, correction_bias: torch.Tensor | None) -> None:
        router = self.spec.router
        if num_experts != router.num_experts:
            raise ValueError(f"router logits must have {router.num_experts} experts, got {num_experts}")
        if router.topk_method != "greedy" and router.num_experts % router.n_group:
            raise ValueError(f"{router.topk_method} needs num_experts ({router.num_experts}) divisible by n_group "
                             f"({router.n_group})")
        if (correction_bias is not None) != (router.topk_method == "noaux_tc"):
            given = "given" if correction_bias is not None else "None"
            raise ValueError(f"correction_bias [E] is needed by noaux_tc and only by it (topk_method "
                             f"{router.topk_method}, correction_bias {given})")
        if correction_bias is not None and tuple(correction_bias.shape) != (router.num_experts,):
            raise ValueError(f"correction_bias must have shape ({router.num_experts},), "
                             f"got {tuple(correction_bias.shape)}")

    def prepare(self, weights: MoEWeights) -> TritonMoEWeights:
        """`weights` (see `MoEWeights`) as contiguous tensors. Shared-expert fusion: the shared MLP of intermediate
        size S * I (DeepSeek's n_shared_experts = S; FP8 with S > 1 needs I a multiple of bn) becomes S experts
        E .. E+S-1 (slices of I) that `forward` gives every token, so that its result is routed + shared MLP."""
        spec = self.spec
        w13, w2, w13_scale_inv, w2_scale_inv = weights.w13, weights.w2, weights.w13_scale_inv, weights.w2_scale_inv
        shared_w13, shared_w2 = weights.shared_w13, weights.shared_w2
        shared_w13_scale_inv, shared_w2_scale_inv = weights.shared_w13_scale_inv, weights.shared_w2_scale_inv
        e, h, i = spec.num_local_experts, spec.hidden_size, spec.intermediate_size
        weight_dtype = FP8_DTYPE if spec.is_fp8 else spec.dtype
        check_tensor("w13", w13, (e, 2 * i, h), weight_dtype)
        check_tensor("w2", w2, (e, h, i), weight_dtype)
        bn, bk = spec.block_shape
        if spec.is_fp8:
            if w13_scale_inv is None or w2_scale_inv is None:
                raise ValueError("fp8_block experts need w13_scale_inv and w2_scale_inv")
            check_tensor("w13_scale_inv", w13_scale_inv, (e, ceil_div(2 * i, bn), ceil_div(h, bk)), torch.float32)
            check_tensor("w2_scale_inv", w2_scale_inv, (e, ceil_div(h, bn), ceil_div(i, bk)), torch.float32)
        elif w13_scale_inv is not None or w2_scale_inv is not None:
            raise ValueError(f"unquantized experts ({spec.dtype}) take no w13_scale_inv / w2_scale_inv")
        s = spec.num_shared_experts
        if not s:
            if shared_w13 is not None or shared_w2 is not None:
                raise ValueError("shared experts given to a spec with num_shared_experts 0")
            return TritonMoEWeights(w13.contiguous(), w2.contiguous(), w13_scale_inv, w2_scale_inv)
        if shared_w13 is None or shared_w2 is None:
            raise ValueError(f"num_shared_experts {s} needs both shared_w13 and shared_w2")
        check_tensor("shared_w13", shared_w13, (2 * s * i, h), weight_dtype)
        check_tensor("shared_w2", shared_w2, (h, s * i), weight_dtype)
        gate_up = shared_w13.view(2, s, i, h).transpose(0, 1).reshape(s, 2 * i, h)
        down = shared_w2.view(h, s, i).transpose(0, 1)
        w13, w2 = torch.cat([w13, gate_up]), torch.cat([w2, down])
        if spec.is_fp8:
            if shared_w13_scale_inv is None or shared_w2_scale_inv is None:
                raise ValueError("fp8_block shared experts need shared_w13_scale_inv and shared_w2_scale_inv")
            if s > 1 and i % bn:
                raise ValueError(f"{s} fused FP8 shared experts need the intermediate size ({i}) to be a "
                                 f"multiple of the weight block ({bn})")
            check_tensor("shared_w13_scale_inv", shared_w13_scale_inv,
                          (ceil_div(2 * s * i, bn), ceil_div(h, bk)), torch.float32)
            check_tensor("shared_w2_scale_inv", shared_w2_scale_inv,
                          (ceil_div(h, bn), ceil_div(s * i, bk)), torch.float32)
            if s == 1:  # laid out as one expert already
                gate_up_scale, down_scale = shared_w13_scale_inv[None], shared_w2_scale_inv[None]
            else:  # every slice of I rows or columns is a whole number of scale blocks
                hb, kb = shared_w2_scale_inv.shape[0], ceil_div(h, bk)
                gate_up_scale = shared_w13_scale_inv.view(2, s, -1, kb).transpose(0, 1).reshape(s, -1, kb)
                down_scale = shared_w2_scale_inv.view(hb, s, -1).transpose(0, 1)
            w13_scale_inv = torch.cat([w13_scale_inv, gate_up_scale])
            w2_scale_inv = torch.cat([w2_scale_inv, down_scale])
        elif shared_w13_scale_inv is not None or shared_w2_scale_inv is not None:
            raise ValueError(f"unquantized shared experts ({spec.dtype}) take no scales")
        return TritonMoEWeights(
            w13.contiguous(), w2.contiguous(),
            None if w13_scale_inv is None else w13_scale_inv.contiguous(),
            None if w2_scale_inv is None else w2_scale_inv.contiguous(),
        )

    def config(self, num_tokens: int) -> MoEConfig:
        """The launch configuration for a batch of `num_tokens` tokens (tuned file or default), looked
        up under this rank's routed experts' count and top-k also when shared experts are fused; under
        spec.batch_invariant `batch_invariant_config`, the same for every token count."""
        spec = self.spec
        if spec.batch_invariant:
            return batch_invariant_config(spec.is_fp8, spec.dtype, self._hardware.device_type)
        return get_config(num_tokens, spec.top_k, spec.num_local_experts, spec.intermediate_size, spec.dtype,
                          spec.block_shape if spec.is_fp8 else None, self._hardware)

    def forward(
        self,
        x: torch.Tensor,
        packed: TritonMoEWeights,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        routed_scaling_factor: float,
    ) -> torch.Tensor:
        """x [T, H] of spec.dtype, topk_ids [T, k + S] int32, topk_weights [T, k + S] float32 -> [T, H]:
        routed_scaling_factor * sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) over this rank's
        experts: global ids, shifted to the packed ones under expert parallelism, where the kernels drop
        the others (another rank's experts).

        Fused shared experts (S = spec.num_shared_experts): `route` gave every token experts E .. E+S-1
        with weight 1 / routed_scaling_factor, which the w2 epilogue's factor cancels."""
        from plugserve.plugins.moe.experts import fused_experts

        spec = self.spec
        self.check_forward_inputs(x, topk_ids, topk_weights)
        if spec.first_expert:
            topk_ids = topk_ids - spec.first_expert
        return fused_experts(
            x, packed.w13, packed.w2, packed.w13_scale_inv, packed.w2_scale_inv, topk_ids, topk_weights,
            routed_scaling_factor, self.config(x.shape[0]), spec.block_shape, self._pair_sum_arrived,
            spec.batch_invariant,
        )


@hookimpl
def plugserve_backends() -> list[type[MoEBackend]]:
    return [TritonMoE]
