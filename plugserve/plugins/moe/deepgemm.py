"""The `deepgemm` MoE backend: DeepSeek's routed experts as DeepGEMM's m-grouped block-FP8 GEMMs on sm90
(float32 scales: 1 x 128 per activation group, 128 x 128 per weight block; bf16 activations).

- `route`: the fused Triton router of the `triton` MoE backend.
- `forward`: lay the token-expert pairs out by expert and quantize x into those rows (one Triton kernel),
  grouped GEMM over w13, SiLU-and-mul of its gate and up halves re-quantized per 1 x 128 group (one Triton
  kernel), grouped GEMM over w2, and the top-k sum weighted by topk_weights * routed_scaling_factor (one
  Triton kernel). The layouts are built in `deepgemm_kernels`.
- Layout by batch size: up to MASKED_MAX_TOKENS = 128 tokens (decode) `m_grouped_fp8_gemm_nt_masked`: every
  expert owns a fixed group of 128 rows and the kernel reads how many are used (`masked_m`) on the device;
  the layout is one small kernel (ranks within each expert, no sort), and the kernel, told the expected
  rows per expert, can pick 64-row tiles for the few rows each expert gets at decode. Beyond 128 tokens the
  groups would have to grow to 256 rows and more for every expert, most of them nearly empty, so the
  contiguous layout of `m_grouped_fp8_gemm_nt_contiguous` (its psum form) takes over: experts' rows packed
  back to back at 128-row boundaries, T k + 127 min(E, T k) rows at most. At 128 tokens both need about
  E x 128 rows.

Neither path waits for the host: the layouts are built on the device and sized from T alone, so decode
can be captured in a CUDA graph (DeepGEMM compiles each kernel on its first use per shape, 2-5 s: warm the
batch sizes up before capturing). Needs DeepGEMM v2.6+ and, where the machine's libstdc++ setup calls for
it, LD_PRELOAD of libstdc++ (see plugserve.plugins.deepgemm_support).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import Availability, MoEBackend, MoECapabilities, MoEWeights, check_tensor
from plugserve.core.layers.quant import FP8_DTYPE, ceil_div
from plugserve.core.specs import MoESpec
from plugserve.plugins.deepgemm_support import deepgemm_availability, import_deep_gemm
from plugserve.plugins.moe.triton import TritonMoE
from plugserve.plugins.triton_support import triton_availability
from plugserve.registry import hookimpl

BLOCK = 128
MASKED_MAX_TOKENS = 128  # the masked kernel's largest row tile; see the module docstring


@dataclass(frozen=True)
class DeepGemmMoECapabilities(MoECapabilities):
    """MoECapabilities plus whole 128-wide K blocks in both GEMMs: hidden and intermediate sizes multiples
    of 128, as DeepSeek's are (DeepGEMM's grouped kernels are tested upstream on such shapes only)."""

    def check(self, spec: MoESpec, phase: Phase) -> Availability:
        fits = super().check(spec, phase)
        if fits and (spec.hidden_size % BLOCK or spec.intermediate_size % BLOCK):
            return Availability.no(f"hidden size {spec.hidden_size} and intermediate size {spec.intermediate_size} "
                                   f"must be multiples of {BLOCK}")
        return fits


@dataclass(frozen=True)
class DeepGemmMoEWeights:
    """w13 [E, 2I, H], w2 [E, H, I] float8_e4m3fn and their block scales [E, 2I/128, H/128],
    [E, H/128, I/128] float32, contiguous on the device (sm90 DeepGEMM reads scales as they are)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale_inv: torch.Tensor
    w2_scale_inv: torch.Tensor


class DeepGemmMoE(MoEBackend):
    """Routed experts as DeepGEMM grouped GEMMs; see the module docstring."""

    name: ClassVar[str] = "deepgemm"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[DeepGemmMoECapabilities] = DeepGemmMoECapabilities(
        dtypes=frozenset({torch.bfloat16}),  # the sm90 grouped kernels write bf16 only
        devices=frozenset({"cuda"}),
        min_capability=(9, 0),
        max_capability=(9, 0),
        weight_formats=frozenset({"fp8_block"}),
        block_shapes=frozenset({(BLOCK, BLOCK)}),
        cuda_graph=True,  # layouts built on the device and sized from T (see the module docstring)
        batch_invariant_note="DeepGEMM picks its block sizes by the token count",
    )
    priority: ClassVar[dict[str, int]] = {"sm90": 40}  # below `triton` until a shootout table ranks it

    def __init__(self, spec: MoESpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.deep_gemm: ModuleType = import_deep_gemm()
        self.router = TritonMoE(spec, device)
        self.alignment: int = self.deep_gemm.get_mk_alignment_for_contiguous_layout()
        self.masked_max_tokens = MASKED_MAX_TOKENS

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = deepgemm_availability(hardware, super().availability(hardware))
        return triton_availability(hardware) if available else available

    def route(
        self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] float32 (correction_bias [E], noaux_tc only) -> (topk_weights [T, k] float32,
        topk_ids [T, k] int32), by the `triton` backend's fused router kernel."""
        return self.router.route(router_logits, correction_bias)

    def route_hidden(
        self, x: torch.Tensor, gate: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`MoEBackend.route_hidden` by the `triton` backend's (one kernel at decode sizes)."""
        return self.router.route_hidden(x, gate, correction_bias)

    def prepare(self, weights: MoEWeights) -> DeepGemmMoEWeights:
        """The routed experts of `weights`, float8_e4m3fn in 128 x 128 blocks (no shared ones: this backend does not
        fuse them) -> contiguous copies on the device."""
        spec = self.spec
        w13, w2, w13_scale_inv, w2_scale_inv = weights.w13, weights.w2, weights.w13_scale_inv, weights.w2_scale_inv
        if weights.shared_w13 is not None or weights.shared_w2 is not None:
            raise ValueError(f"the {self.name} MoE backend does not fuse shared experts")
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        check_tensor("w13", w13, (e, 2 * i, h), FP8_DTYPE)
        check_tensor("w2", w2, (e, h, i), FP8_DTYPE)
        if w13_scale_inv is None or w2_scale_inv is None:
            raise ValueError("fp8_block experts need w13_scale_inv and w2_scale_inv")
        check_tensor("w13_scale_inv", w13_scale_inv, (e, ceil_div(2 * i, BLOCK), ceil_div(h, BLOCK)), torch.float32)
        check_tensor("w2_scale_inv", w2_scale_inv, (e, ceil_div(h, BLOCK), ceil_div(i, BLOCK)), torch.float32)
        return DeepGemmMoEWeights(*(t.to(self.device).contiguous() for t in (w13, w2, w13_scale_inv, w2_scale_inv)))

    def forward(
        self,
        x: torch.Tensor,
        packed: DeepGemmMoEWeights,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        routed_scaling_factor: float,
    ) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32, topk_weights [T, k] float32 -> [T, H] bf16:
        routed_scaling_factor * sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]). Ids outside
        [0, E) contribute nothing. A token's k experts must be distinct (every router gives them so)."""
        from plugserve.plugins.moe import deepgemm_kernels as kernels

        spec = self.spec
        self.check_forward_inputs(x, topk_ids, topk_weights)
        num_tokens, top_k = topk_ids.shape
        if num_tokens == 0:
            return torch.empty_like(x)
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        num_pairs = num_tokens * top_k
        # The pairs an active expert gets on average: the GEMM heuristics' expected rows per group. From the
        # shapes alone, never the ids: a CUDA graph bakes this host int (and the kernel it picks) in.
        expected_m = ceil_div(num_pairs, min(e, num_pairs))
        dg = self.deep_gemm

        if num_tokens <= self.masked_max_tokens:
            layout = kernels.masked_layout(topk_ids, e, ceil_div(num_tokens, kernels.MASKED_ROW_MULTIPLE)
                                           * kernels.MASKED_ROW_MULTIPLE)
            dst, max_m = layout.dst, layout.max_m
            a = kernels.quantize_rows(x, dst, e, max_m, top_k=top_k)
            gate_up = torch.empty((e, max_m, 2 * i), dtype=torch.bfloat16, device=x.device)
            dg.m_grouped_fp8_gemm_nt_masked(a, (packed.w13, packed.w13_scale_inv), gate_up, layout.masked_m,
                                            expected_m)
            hidden = kernels.quantize_rows(gate_up.view(e * max_m, 2 * i), dst, e, max_m, silu_mul=True)
            down = torch.empty((e, max_m, h), dtype=torch.bfloat16, device=x.device)
            dg.m_grouped_fp8_gemm_nt_masked(hidden, (packed.w2, packed.w2_scale_inv), down, layout.masked_m,
                                            expected_m)
            down = down.view(e * max_m, h)
        else:
            layout = kernels.contiguous_layout(topk_ids, e, self.alignment)
            dst, rows = layout.dst, layout.num_rows
            a_q, a_scales = kernels.quantize_rows(x, dst, 1, rows, top_k=top_k)
            gate_up = torch.empty((rows, 2 * i), dtype=torch.bfloat16, device=x.device)
            dg.m_grouped_fp8_gemm_nt_contiguous((a_q[0], a_scales[0]), (packed.w13, packed.w13_scale_inv), gate_up,
                                                layout.psum, use_psum_layout=True,
                                                expected_m_for_psum_layout=expected_m)
            h_q, h_scales = kernels.quantize_rows(gate_up, dst, 1, rows, silu_mul=True)
            down = torch.empty((rows, h), dtype=torch.bfloat16, device=x.device)
            dg.m_grouped_fp8_gemm_nt_contiguous((h_q[0], h_scales[0]), (packed.w2, packed.w2_scale_inv), down,
                                                layout.psum, use_psum_layout=True,
                                                expected_m_for_psum_layout=expected_m)
        return kernels.topk_reduce(down, dst, topk_weights, routed_scaling_factor, x.dtype)


@hookimpl
def plugserve_backends() -> list[type[MoEBackend]]:
    return [DeepGemmMoE]
