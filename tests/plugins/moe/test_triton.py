"""The `triton` MoE backend against the torch reference: moe_align_block_size (its one-program and
three-kernel paths) against a plain-torch oracle, the fused router, the activation quantizer, the routed
experts (fp32 / fp16 / bf16 and block-FP8 weights), dropped expert ids, shared-expert fusion,
configuration files, and the availability rules.

Without a GPU the kernels run in Triton's interpreter, in this process or an interpreted child pytest
(tests/interpreter.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from plugserve.conformance.cases import V2_LITE_ROUTER, V2_ROUTER, V3_ROUTER
from plugserve.conformance.tolerances import W8A8_MOE_ATOL, assert_close
from plugserve.core.config import preset_config
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import MoEWeights
from plugserve.core.layers.quant import per_token_group_quant_fp8, quantize_block_fp8
from plugserve.core.specs import MoESpec, RouterConfig
from plugserve.plugins.moe import configs
from plugserve.plugins.moe.configs import GemmConfig, MoEConfig
from plugserve.plugins.moe.torch_ref import fused_experts_reference, select_experts
from plugserve.plugins.moe.triton import TritonMoE
from tests.interpreter import interpreter_child, kernels_fixture

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SMALL_V3 = RouterConfig(16, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True)
RSF = 2.5  # routed_scaling_factor
REPO = Path(__file__).resolve().parents[3]


router_kernels = kernels_fixture("plugserve.plugins.moe.router")
align_kernels = kernels_fixture("plugserve.plugins.moe.align")
quant_kernels = kernels_fixture("plugserve.plugins.moe.quant")
gemm_kernels = kernels_fixture("plugserve.plugins.moe.grouped_gemm")
experts_kernels = kernels_fixture("plugserve.plugins.moe.experts")


test_kernels_in_the_interpreter = interpreter_child(__file__)


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    quantized = [quantize_block_fp8(expert) for expert in w]
    return torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized])


def _experts(e: int, h: int, i: int, dtype: torch.dtype, fp8: bool, seed: int = 0):
    """(w13, w2, w13_scale_inv, w2_scale_inv) on DEVICE, FP8-quantized or in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    if fp8:
        (w13, s13), (w2, s2) = _quantize_experts(w13), _quantize_experts(w2)
        return w13.to(DEVICE), w2.to(DEVICE), s13.to(DEVICE), s2.to(DEVICE)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype), None, None


def _routing(t: int, router: RouterConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, router.num_experts, generator=g)
    bias = torch.randn(router.num_experts, generator=g) * 0.1 if router.topk_method == "noaux_tc" else None
    weights, ids = select_experts(logits, router, bias)
    return weights.to(DEVICE), ids.to(DEVICE)


# ----------------------------------------------------------------------------------------------------
# moe_align_block_size


def _align_oracle(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """BlockAlignment's contract in plain torch: the kept pairs (ids in [0, E)) stably sorted by expert,
    each expert's run padded with num_pairs to a multiple of block_m, then padding up to the worst case
    P + min(E, P) * (block_m - 1) slots. -> (sorted_ids, expert_ids, num_padded)."""
    flat = ids.flatten().long().cpu()
    num_pairs = flat.numel()
    kept = torch.arange(num_pairs)[(flat >= 0) & (flat < num_experts)]
    experts, order = flat[kept].sort(stable=True)
    runs = kept[order].split(torch.bincount(experts, minlength=num_experts).tolist())
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for expert, run in enumerate(runs):
        padded = -(-len(run) // block_m) * block_m
        sorted_ids += run.tolist() + [num_pairs] * (padded - len(run))
        expert_ids += [expert] * (padded // block_m)
    num_padded = len(sorted_ids)
    num_blocks = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)
    sorted_ids += [num_pairs] * (num_blocks * block_m - num_padded)
    expert_ids += [-1] * (num_blocks - len(expert_ids))
    return torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(expert_ids, dtype=torch.int32), num_padded


def _align_ids(t: int, k: int, e: int, kind: str) -> torch.Tensor:
    """[t, k] int32 expert ids: "routed" (distinct per token, as routers give them, with one -1, an id
    past E and a token naming expert 3 k times), "one_expert" (every pair to expert e - 1) or "dropped"
    (every id outside [0, E))."""
    g = torch.Generator().manual_seed(t * 1000 + e)
    if kind == "one_expert":
        return torch.full((t, k), e - 1, dtype=torch.int32)
    if kind == "dropped":
        return torch.tensor([-1, e, e + 7, -5], dtype=torch.int32).repeat(t * k // 4 + 1)[: t * k].view(t, k)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    ids[0, 0] = -1  # dropped (another rank's expert)
    ids[-1, -1] = e  # out of range: dropped too
    if t > 2:
        ids[1, :] = 3  # duplicates are fine for the alignment
    return ids


@pytest.mark.parametrize("path", ["one_program", "one_program_chunked", "three_kernels"])
@pytest.mark.parametrize(
    ("t", "k", "e", "block_m", "kind"),
    [(1, 1, 8, 4, "one_expert"), (1, 4, 16, 16, "routed"), (37, 4, 16, 16, "routed"), (64, 6, 64, 16, "routed"),
     (40, 4, 16, 16, "one_expert"), (3, 4, 16, 16, "dropped"), (20, 9, 257, 64, "routed"),
     (70, 8, 256, 128, "routed")],
)
def test_align_block_size_matches_oracle(
    align_kernels, monkeypatch: pytest.MonkeyPatch, path: str, t: int, k: int, e: int, block_m: int, kind: str
) -> None:
    if path == "three_kernels":
        monkeypatch.setattr(align_kernels, "_ALIGN_SINGLE_MAX_PAIRS", 0)
    elif path == "one_program_chunked":  # several sorted chunks, each continuing its experts' runs
        monkeypatch.setattr(align_kernels, "_ALIGN_SORT", 16)
    ids = _align_ids(t, k, e, kind)
    a = align_kernels.moe_align_block_size(ids.to(DEVICE), e, block_m)
    sorted_ids, expert_ids, num_padded = _align_oracle(ids, e, block_m)
    assert a.num_pairs == t * k and a.block_m == block_m
    assert torch.equal(a.sorted_ids.cpu(), sorted_ids)
    assert torch.equal(a.expert_ids.cpu(), expert_ids)
    assert a.num_padded.shape == (1,) and int(a.num_padded) == num_padded


def test_align_block_size_beyond_one_program(align_kernels) -> None:
    """More pairs than one program takes (prefill): the three-kernel path, several chunks of pairs."""
    t, k, e, block_m = 520, 8, 64, 32
    assert t * k > align_kernels._ALIGN_SINGLE_MAX_PAIRS
    ids = _align_ids(t, k, e, "routed")
    a = align_kernels.moe_align_block_size(ids.to(DEVICE), e, block_m)
    sorted_ids, expert_ids, num_padded = _align_oracle(ids, e, block_m)
    assert torch.equal(a.sorted_ids.cpu(), sorted_ids) and torch.equal(a.expert_ids.cpu(), expert_ids)
    assert int(a.num_padded) == num_padded


def test_one_token_takes_a_block_per_pair_without_sorting(align_kernels) -> None:
    """Decode at batch 1: the k distinct experts of the token each get their own M-block, with no kernel."""
    ids = torch.tensor([[5, 2, 9]], dtype=torch.int32, device=DEVICE)
    one = align_kernels.align_pairs(ids, 16, 16)
    assert one.per_pair and one.num_blocks == 3 and one.expert_ids.tolist() == [5, 2, 9]
    assert not align_kernels.align_pairs(ids.repeat(2, 1), 16, 16).per_pair


def test_align_block_size_empty(align_kernels) -> None:
    a = align_kernels.moe_align_block_size(torch.empty(0, 4, dtype=torch.int32, device=DEVICE), 16, 16)
    assert a.num_blocks == 0 and a.sorted_ids.numel() == 0 and int(a.num_padded) == 0


# ----------------------------------------------------------------------------------------------------
# Router


@pytest.mark.parametrize("t", [1, 33])
@pytest.mark.parametrize(
    "router",
    [V3_ROUTER, V2_ROUTER, V2_LITE_ROUTER, SMALL_V3,
     RouterConfig(64, 6, "softmax", "greedy", 1, 1, norm_topk_prob=True),
     RouterConfig(32, 4, "sigmoid", "noaux_tc", 4, 2, norm_topk_prob=False)],
    ids=lambda r: f"e{r.num_experts}top{r.top_k}-{r.topk_method}-{r.scoring_func}-norm{int(r.norm_topk_prob)}",
)
def test_route_matches_reference(router_kernels, router: RouterConfig, t: int) -> None:
    backend = TritonMoE(MoESpec(dtype=torch.float16, router=router), DEVICE)
    logits = torch.randn(t, router.num_experts, device=DEVICE)
    bias = torch.randn(router.num_experts, device=DEVICE) * 0.1 if router.topk_method == "noaux_tc" else None
    weights, ids = backend.route(logits, bias)
    ref_weights, ref_ids = select_experts(logits, router, bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (t, router.top_k)
    ids_sorted, order = ids.long().sort(dim=1)
    ref_sorted, ref_order = ref_ids.long().sort(dim=1)
    assert torch.equal(ids_sorted, ref_sorted)
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-5, atol=1e-6)
    assert torch.all(weights[:, :-1] >= weights[:, 1:]) or router.topk_method == "noaux_tc", "best first"


@pytest.mark.parametrize("t", [1, 3, 4, 5])
@pytest.mark.parametrize("router", [V3_ROUTER, V2_ROUTER, SMALL_V3, RouterConfig(24, 4, "softmax", "greedy", 1, 1,
                                                                                  True)],
                         ids=lambda r: f"e{r.num_experts}-{r.topk_method}")
@pytest.mark.parametrize("num_shared", [0, 2])
def test_route_hidden_matches_the_gate_then_route(router_kernels, router: RouterConfig, t: int,
                                                  num_shared: int) -> None:
    """Up to four tokens in the one-launch router (5: the GEMM and `route`), repeated (the arrival count is back at
    0 after each launch), against the reference router on the float64 logits."""
    backend = TritonMoE(MoESpec(dtype=torch.float16, router=router, num_shared_experts=num_shared), DEVICE)
    g = torch.Generator().manual_seed(t)
    hidden = 96  # not a multiple of the kernel's K chunk
    x = torch.randn(t, hidden, generator=g).to(DEVICE, torch.float16)
    gate = (torch.randn(router.num_experts, hidden, generator=g) / hidden**0.5).to(DEVICE, torch.float16)
    bias = (torch.randn(router.num_experts, generator=g) * 0.1).to(DEVICE) if router.topk_method == "noaux_tc" else None
    ref_weights, ref_ids = select_experts((x.double() @ gate.double().T).float(), router, bias)
    for _ in range(2):
        weights, ids = backend.route_hidden(x, gate, bias)
        assert int(backend._router_scratch[1].item()) == 0
        assert ids.shape == weights.shape == (t, router.top_k + num_shared)
        ids_sorted, order = ids[:, : router.top_k].long().sort(dim=1)
        ref_sorted, ref_order = ref_ids.long().sort(dim=1)
        assert torch.equal(ids_sorted, ref_sorted)
        torch.testing.assert_close(weights[:, : router.top_k].gather(1, order), ref_weights.gather(1, ref_order),
                                   rtol=1e-4, atol=1e-5)
        shared = torch.arange(router.num_experts, router.num_experts + num_shared, dtype=torch.int32, device=DEVICE)
        assert torch.equal(ids[:, router.top_k :], shared.expand(t, num_shared))


def test_route_hidden_takes_one_launch_only_at_decode_sizes(router_kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = TritonMoE(MoESpec(dtype=torch.float16, router=SMALL_V3), DEVICE)
    fused: list[int] = []
    real = router_kernels.fused_router
    monkeypatch.setattr(router_kernels, "fused_router", lambda x, *args: fused.append(x.shape[0]) or real(x, *args))
    gate, bias = torch.randn(16, 32, device=DEVICE), torch.zeros(16, device=DEVICE)
    for t in (1, router_kernels.FUSED_ROUTER_MAX_TOKENS, router_kernels.FUSED_ROUTER_MAX_TOKENS + 1):
        backend.route_hidden(torch.randn(t, 32, device=DEVICE), gate, bias)
    assert fused == [1, router_kernels.FUSED_ROUTER_MAX_TOKENS]
    with pytest.raises(ValueError, match="gate must be"):
        backend.route_hidden(torch.randn(1, 32, device=DEVICE), gate[:, :16], bias)


def test_router_logits_sum_fixed_token_tiles(router_kernels) -> None:
    """The gate's float32 logits, each token's the same bits alone, in a prefix or in the whole batch (tiles of
    ROUTER_BLOCK_T tokens at every count), a hidden size that is no multiple of the K chunk."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 96, generator=g).to(DEVICE, torch.float16)
    gate = (torch.randn(24, 96, generator=g) / 96**0.5).to(DEVICE, torch.float16)
    whole = router_kernels.router_logits(x, gate)
    assert whole.dtype == torch.float32 and whole.shape == (11, 24)
    torch.testing.assert_close(whole, (x.double() @ gate.double().T).float(), rtol=1e-5, atol=1e-5)
    for rows in (slice(0, 1), slice(0, 3), slice(0, 5), slice(10, 11), slice(2, 9)):
        assert torch.equal(router_kernels.router_logits(x[rows], gate), whole[rows]), f"tokens {rows}"


def test_batch_invariant_moe_takes_one_path_at_every_token_count(router_kernels, experts_kernels,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Under spec.batch_invariant, on a GPU too: one launch config at every token count, route_hidden through
    router_logits and route (never the fused router), and one token sorted like a batch and summed by the top-k sum
    kernel (no pair blocks, no pair sum in the w2 pass); a token's weights, ids and output are then the same bits
    alone as in the batch."""
    backend = TritonMoE(MoESpec(128, 64, torch.float32, None, router=SMALL_V3, batch_invariant=True), DEVICE)
    backend._hardware = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132)
    assert backend.config(1) == backend.config(300) == configs.batch_invariant_config(False, torch.float32, "cuda")
    monkeypatch.setattr(router_kernels, "fused_router", lambda *args: pytest.fail("the fused router ran"))
    monkeypatch.setattr(experts_kernels, "align_pairs", lambda *args: pytest.fail("the one-token alignment ran"))
    sums: list[int] = []
    real_sum = experts_kernels._topk_sum_kernel
    monkeypatch.setattr(experts_kernels, "_topk_sum_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: sums.append(grid[0]) or real_sum[grid]})())
    w13, w2, _, _ = _experts(16, 128, 64, torch.float32, False)
    packed = backend.prepare(MoEWeights(w13, w2))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 128, generator=g).to(DEVICE)
    gate = (torch.randn(16, 128, generator=g) / 128**0.5).to(DEVICE)
    bias = (torch.randn(16, generator=g) * 0.1).to(DEVICE)

    def run(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights, ids = backend.route_hidden(rows, gate, bias)
        return weights, ids, backend.forward(rows, packed, ids, weights, RSF)

    whole = run(x)
    for m in (1, 2):
        assert all(torch.equal(a, b[:m]) for a, b in zip(run(x[:m]), whole, strict=True)), f"the first {m} tokens"
    assert sums == [5, 1, 2]


def test_route_rejects_misused_bias(router_kernels) -> None:
    backend = TritonMoE(MoESpec(dtype=torch.float16, router=V2_LITE_ROUTER), DEVICE)
    with pytest.raises(ValueError, match="correction_bias"):
        backend.route(torch.randn(2, 64, device=DEVICE), torch.zeros(64, device=DEVICE))


# ----------------------------------------------------------------------------------------------------
# Activation quantization


def test_per_token_group_quant_is_bit_exact(quant_kernels) -> None:
    x = torch.randn(5, 320) * torch.logspace(-4, 3, 5).unsqueeze(1)  # K not a multiple of 128
    x[2] = 0.0  # all-zero groups: scale floored at SCALE_EPS
    q, scales = quant_kernels.per_token_group_quant(x.to(DEVICE), 128)
    ref_q, ref_scales = per_token_group_quant_fp8(x, 128)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (5, 3)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scales.cpu(), ref_scales)


# ----------------------------------------------------------------------------------------------------
# Routed experts

# Multi-tile: several K steps per 128-wide scale block, several N tiles, partial last tiles.
SMALL_TILES = MoEConfig(32, GemmConfig(32, 32, 2, 4, 2), GemmConfig(64, 64, 1, 4, 2))
# TMA weight boxes: w13's second 128-row block (I = 192) reaches into the up rows, w2's second 128-deep K step past
# K = 192 (zero-filled).
TMA_TILES = MoEConfig(32, GemmConfig(128, 64, 2, 4, 2, tma=True), GemmConfig(64, 128, 1, 4, 2, tma=True))
# Split-K: w13's K = 256 in 8 steps of 32 as runs of 3, 3 and 2; w2's K = 192 in 3 steps of 64 as runs of 2 and 1.
SPLIT_TILES = MoEConfig(16, GemmConfig(32, 32, 1, 4, 2, split_k=3), GemmConfig(64, 64, 1, 4, 2, split_k=2))
# The w2 pass's 8 column blocks of 32 (H = 256) as programs of 3, 3 and 2, K = 192 in 3 unrolled steps of 64.
COLUMN_TILES = MoEConfig(16, GemmConfig(32, 64, 1, 4, 2), GemmConfig(32, 64, 1, 4, 2, column_blocks=3))


def _config_id(p) -> str:
    if not isinstance(p, MoEConfig):
        return str(p).removeprefix("torch.")
    if p.w2.column_blocks > 1:
        return "column_tiles"
    return "split_tiles" if p.w13.split_k > 1 else "tma_tiles" if p.w13.tma else "small_tiles"


@pytest.mark.parametrize(
    ("t", "dtype", "fp8", "config"),
    [
        (1, torch.float32, False, None),
        (37, torch.float32, False, SMALL_TILES),
        (1, torch.float16, True, None),
        (37, torch.float16, True, SMALL_TILES),
        (37, torch.float32, True, None),
        (9, torch.bfloat16, False, None),
        (9, torch.bfloat16, True, None),
        (37, torch.float16, False, TMA_TILES),
        (37, torch.float32, True, TMA_TILES),
        (1, torch.bfloat16, True, TMA_TILES),
        (1, torch.float16, True, SPLIT_TILES),
        (37, torch.float32, False, SPLIT_TILES),
        (1, torch.float16, True, COLUMN_TILES),  # one token's pair blocks: the general kernel
        (37, torch.float32, False, COLUMN_TILES),
        (37, torch.float32, True, replace(COLUMN_TILES, w2=replace(COLUMN_TILES.w2, tma=True))),
    ],
    ids=_config_id,
)
def test_fused_experts_match_reference(experts_kernels, t: int, dtype: torch.dtype, fp8: bool, config) -> None:
    h, i = 256, 192  # T = 37 fills no 16- or 32-row block exactly; I not a multiple of 128
    spec = MoESpec(h, i, dtype, torch.float8_e4m3fn if fp8 else None, router=SMALL_V3)
    backend = TritonMoE(spec, DEVICE)
    w13, w2, s13, s2 = _experts(SMALL_V3.num_experts, h, i, dtype, fp8)
    packed = backend.prepare(MoEWeights(w13, w2, s13, s2))
    weights, ids = _routing(t, SMALL_V3)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE, dtype)
    if config is None:
        out = backend.forward(x, packed, ids, weights, RSF)
    else:
        out = experts_kernels.fused_experts(x, packed.w13, packed.w2, s13, s2, ids, weights, RSF, config)
    expected = fused_experts_reference(x, w13, w2, ids, weights, RSF, s13, s2)
    assert out.dtype == dtype
    # Block-FP8: the kit's bound, since the e4m3 intermediate may round to the neighbouring value on either side.
    assert_close(out, expected, dtype, f"triton MoE t={t} {dtype} fp8={fp8}", W8A8_MOE_ATOL if fp8 else None)
    from plugserve.core import triton_tiles  # with the kernels: it imports triton

    assert not any(arrivals.any() for arrivals in triton_tiles._arrivals.values())  # re-armed for the next launch


def test_split_k_results_do_not_depend_on_arrival_order(experts_kernels) -> None:
    """The last program of a block adds the splits' slices in split order: two launches give the same bits."""
    h, i = 256, 192
    w13, w2, _, _ = _experts(16, h, i, torch.float32, False)
    weights, ids = _routing(9, SMALL_V3)
    x = torch.randn(9, h, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    runs = [experts_kernels.fused_experts(x, w13.to(DEVICE), w2.to(DEVICE), None, None, ids, weights, RSF, SPLIT_TILES)
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_split_k_refuses_the_in_pass_pair_sum(align_kernels, gemm_kernels) -> None:
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    a = torch.zeros(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="pair_sum needs SPLIT_K 1"):
        gemm_kernels.grouped_gemm(a, None, torch.zeros(2, 32, 64, device=DEVICE), None,
                                  torch.empty(2, 32, device=DEVICE), align_kernels.pair_blocks(ids, 16), SPLIT_TILES.w2,
                                  a_row_div=1, silu_mul=False,
                                  pair_sum=(torch.empty(32, device=DEVICE), torch.zeros(4, dtype=torch.int32,
                                                                                        device=DEVICE)))


@pytest.mark.parametrize("fp8", [False, True])
def test_column_blocks_give_the_general_kernels_bits(align_kernels, gemm_kernels, quant_kernels, fp8: bool) -> None:
    """A program running several column blocks adds each block's K steps in the order one program a block does:
    the w2 pass gives the same bits either way (here with a last program of fewer blocks and a K not a multiple
    of 128)."""
    h, i, t = 256, 192, 37
    _, w2, _, s2 = _experts(16, h, i, torch.float16, fp8)
    weights, ids = _routing(t, SMALL_V3)
    alignment = align_kernels.align_pairs(ids.to(torch.int32), 16, COLUMN_TILES.block_m)
    g = torch.Generator().manual_seed(5)
    hidden = (torch.randn(t * 4, i, generator=g) / 4).to(DEVICE, torch.float16)
    a, a_scale = quant_kernels.per_token_group_quant(hidden, 128) if fp8 else (hidden, None)
    outs = []
    for tile in (replace(COLUMN_TILES.w2, column_blocks=1), COLUMN_TILES.w2):
        out = torch.full((t * 4, h), float("nan"), device=DEVICE, dtype=torch.float16)
        gemm_kernels.grouped_gemm(a, a_scale, w2, s2, out, alignment, tile, a_row_div=1, silu_mul=False,
                                  topk_weights=weights.float().view(-1).contiguous(), routed_scaling_factor=RSF)
        outs.append(out)
    assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1])


def test_column_blocks_are_a_short_w2_option(align_kernels, gemm_kernels) -> None:
    alignment = align_kernels.align_pairs(torch.tensor([[0, 1], [1, 0]], dtype=torch.int32, device=DEVICE), 2, 16)
    with pytest.raises(ValueError, match="COLUMN_BLOCKS is the w2 pass's"):
        gemm_kernels.grouped_gemm(torch.zeros(4, 64, device=DEVICE), None, torch.zeros(2, 64, 64, device=DEVICE),
                                  None, torch.empty(4, 32, device=DEVICE), alignment, COLUMN_TILES.w2, a_row_div=2,
                                  silu_mul=True)
    k = gemm_kernels.COLUMN_MAX_K + 64
    with pytest.raises(ValueError, match=f"K <= {gemm_kernels.COLUMN_MAX_K}, got a_row_div 1 and K {k}"):
        gemm_kernels.grouped_gemm(torch.zeros(4, k, device=DEVICE), None, torch.zeros(2, 32, k, device=DEVICE),
                                  None, torch.empty(4, 32, device=DEVICE), alignment, COLUMN_TILES.w2, a_row_div=1,
                                  silu_mul=False)


@pytest.mark.parametrize("config", [None, TMA_TILES, SPLIT_TILES, COLUMN_TILES],
                         ids=["default", "tma_tiles", "split_tiles", "column_tiles"])
@pytest.mark.parametrize("t", [1, 6])  # one token: one M-block per pair (pair_blocks), no alignment kernel
def test_dropped_ids_contribute_nothing(experts_kernels, t: int, config) -> None:
    h, i = 128, 64
    backend = TritonMoE(MoESpec(h, i, torch.float32, None, router=SMALL_V3), DEVICE)
    w13, w2, _, _ = _experts(16, h, i, torch.float32, False)
    weights, ids = _routing(t, SMALL_V3)
    dropped = ids.clone()
    dropped[::2, 1] = -1
    dropped[0, 2] = SMALL_V3.num_experts  # past the experts this rank holds
    x = torch.randn(t, h, device=DEVICE)
    packed = backend.prepare(MoEWeights(w13, w2))
    out = (backend.forward(x, packed, dropped, weights, RSF) if config is None else experts_kernels.fused_experts(
        x, packed.w13, packed.w2, None, None, dropped, weights, RSF, config, arrived=backend._pair_sum_arrived))
    kept = torch.where((dropped >= 0) & (dropped < SMALL_V3.num_experts), weights, 0.0)
    assert_close(out, fused_experts_reference(x, w13, w2, ids, kept, RSF), torch.float32, "dropped ids")
    assert not backend._pair_sum_arrived.any()


@pytest.mark.parametrize("config", [None, SMALL_TILES, TMA_TILES], ids=["default", "small_tiles", "tma_tiles"])
def test_one_token_sums_its_pairs_in_the_w2_pass(experts_kernels, monkeypatch: pytest.MonkeyPatch, config) -> None:
    """One token: the w2 pass's last program of each column block adds the pairs (no top-k sum launch), the
    arrival counts are back at 0 after each call, and too few counts fall back to the sum kernel."""
    h, i = 256, 192
    backend = TritonMoE(MoESpec(h, i, torch.float16, None, router=SMALL_V3), DEVICE)
    w13, w2, _, _ = _experts(16, h, i, torch.float16, False)
    packed = backend.prepare(MoEWeights(w13, w2))
    config = config or backend.config(1)
    sums: list[int] = []
    real_sum = experts_kernels._topk_sum_kernel
    monkeypatch.setattr(experts_kernels, "_topk_sum_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: sums.append(1) or real_sum[grid]})())
    for seed, arrived in ((0, backend._pair_sum_arrived), (1, backend._pair_sum_arrived), (2, None),
                          (3, torch.zeros(1, dtype=torch.int32, device=DEVICE))):
        weights, ids = _routing(1, SMALL_V3, seed)
        x = torch.randn(1, h, device=DEVICE).to(torch.float16)
        out = experts_kernels.fused_experts(x, packed.w13, packed.w2, None, None, ids, weights, RSF, config,
                                            arrived=arrived)
        assert_close(out, fused_experts_reference(x, w13, w2, ids, weights, RSF), torch.float16, f"seed {seed}")
        assert not backend._pair_sum_arrived.any()
    assert len(sums) == 2  # the calls without enough arrival counts


def test_empty_batch(experts_kernels) -> None:
    backend = TritonMoE(MoESpec(128, 64, torch.float16, None, router=SMALL_V3), DEVICE)
    w13, w2, _, _ = _experts(16, 128, 64, torch.float16, False)
    ids = torch.empty(0, 4, dtype=torch.int32, device=DEVICE)
    out = backend.forward(torch.empty(0, 128, device=DEVICE, dtype=torch.float16),
                          backend.prepare(MoEWeights(w13, w2)), ids, torch.empty(0, 4, device=DEVICE), RSF)
    assert out.shape == (0, 128)


# ----------------------------------------------------------------------------------------------------
# Shared-expert fusion


# The fused shared experts' results: the kit's test_forward_with_fused_shared_experts (against the oracle).
def test_shared_fusion_takes_shared_experts_exactly_when_the_spec_has_them(experts_kernels) -> None:
    w13, w2, _, _ = _experts(16, 128, 64, torch.float32, False)
    shared_w13, shared_w2 = torch.zeros(128, 128, device=DEVICE), torch.zeros(128, 64, device=DEVICE)
    fused = TritonMoE(MoESpec(128, 64, torch.float32, None, router=SMALL_V3, num_shared_experts=1), DEVICE)
    with pytest.raises(ValueError, match="shared_w13"):
        fused.prepare(MoEWeights(w13, w2, shared_w13=torch.zeros(100, 128, device=DEVICE), shared_w2=shared_w2))
    with pytest.raises(ValueError, match="needs both"):
        fused.prepare(MoEWeights(w13, w2))
    assert fused.prepare(MoEWeights(w13, w2, shared_w13=shared_w13, shared_w2=shared_w2)).w13.shape[0] == 17
    plain = TritonMoE(MoESpec(128, 64, torch.float32, None, router=SMALL_V3), DEVICE)
    with pytest.raises(ValueError, match="num_shared_experts 0"):
        plain.prepare(MoEWeights(w13, w2, shared_w13=shared_w13, shared_w2=shared_w2))


# ----------------------------------------------------------------------------------------------------
# Configurations, capabilities, availability, the tuner


def test_config_files_round_trip_and_nearest_m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = configs.config_file_name(256, 256, "NVIDIA_H100_80GB_HBM3", torch.bfloat16, (128, 128))
    assert name == "E=256,N=256,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128, 128].json"
    unquantized = configs.config_file_name(64, 1408, "cpu", torch.bfloat16, None)
    assert unquantized == "E=64,N=1408,device_name=cpu,dtype=bfloat16.json"
    small = MoEConfig(16, GemmConfig(64, 128, 1, 4, 3), GemmConfig(128, 128, 1, 4, 4))
    large = MoEConfig(64, GemmConfig(128, 128, 16, 8, 3, tma=True), GemmConfig(256, 128, 32, 8, 4))
    assert large.to_json()["w13"]["TMA"] == 1 and "TMA" not in large.to_json()["w2"]
    with pytest.raises(ValueError, match="TMA must be 0 or 1, got 2"):
        GemmConfig.from_json(large.to_json()["w13"] | {"TMA": 2})
    assert "SPLIT_K" not in large.to_json()["w13"] and SPLIT_TILES.to_json()["w13"]["SPLIT_K"] == 3
    assert MoEConfig.from_json(SPLIT_TILES.to_json()) == SPLIT_TILES
    with pytest.raises(ValueError, match="SPLIT_K must be a positive integer, got 0"):
        GemmConfig.from_json(large.to_json()["w13"] | {"SPLIT_K": 0})
    assert COLUMN_TILES.to_json()["w2"]["COLUMN_BLOCKS"] == 3 and "COLUMN_BLOCKS" not in large.to_json()["w2"]
    assert MoEConfig.from_json(COLUMN_TILES.to_json()) == COLUMN_TILES
    with pytest.raises(ValueError, match="COLUMN_BLOCKS must be a positive integer, got 0"):
        GemmConfig.from_json(large.to_json()["w2"] | {"COLUMN_BLOCKS": 0})
    with pytest.raises(ValueError, match="SPLIT_K and COLUMN_BLOCKS exclude each other"):
        GemmConfig.from_json(large.to_json()["w2"] | {"COLUMN_BLOCKS": 4, "SPLIT_K": 2})
    with pytest.raises(ValueError, match="COLUMN_BLOCKS is a w2 option"):
        MoEConfig.from_json(large.to_json() | {"w13": large.to_json()["w13"] | {"COLUMN_BLOCKS": 4}})
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.write_config_file(tmp_path / configs.config_file_name(16, 32, "dev", torch.float16, None),
                              {1: small, 512: large})
    dev = Hardware("cuda", "dev", (9, 0), 0, 132)
    assert configs.get_config(200, 4, 16, 32, torch.float16, None, dev) == small
    assert configs.get_config(300, 4, 16, 32, torch.float16, None, dev) == large
    assert configs.get_config(1024, 4, 16, 32, torch.float16, None, dev) == large
    # Past twice the largest tuned M the file says nothing: prefill batches of a decode-tuned file take the default.
    assert configs.get_config(1025, 4, 16, 32, torch.float16, None, dev) == configs.default_config(
        1025, 4, 16, False, torch.float16, "cuda")
    untuned = configs.get_config(300, 4, 16, 32, torch.float32, None, dev)
    assert untuned == configs.default_config(300, 4, 16, False, torch.float32, "cuda")


def test_another_sm90_gpu_takes_the_closest_measured_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    tuned = MoEConfig(16, GemmConfig(64, 128, 1, 4, 3), GemmConfig(128, 128, 1, 4, 4))
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    for key in ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"):
        configs.write_config_file(tmp_path / configs.config_file_name(16, 32, key, torch.float16, None), {1: tuned})
    h200_nvl = Hardware("cuda", "NVIDIA H200 NVL", (9, 0), 141 * 2**30, 132)
    with caplog.at_level("INFO", logger="plugserve.plugins.moe.configs"):
        assert configs.get_config(1, 4, 16, 32, torch.float16, None, h200_nvl) == tuned
    assert ("no tuned config E=16,N=32 for NVIDIA H200 NVL; using NVIDIA_H200, the closest measured "
            "(same sm90 family, H200)") in caplog.text
    a10 = Hardware("cuda", "NVIDIA A10", (8, 6), 24 * 2**30, 72)
    assert configs.get_config(1, 4, 16, 32, torch.float16, None, a10) == configs.default_config(
        1, 4, 16, False, torch.float16, "cuda")


@pytest.mark.parametrize(("ep_size", "ep_rank", "experts", "width"), [(1, 0, 256, 1024), (2, 1, 128, 2048)])
def test_rank_configs_are_looked_up_under_per_rank_experts(ep_size: int, ep_rank: int, experts: int, width: int,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3 at --tp-size 2: tensor-parallel experts of width I / 2, or expert-parallel E / 2 whole ones."""
    spec = preset_config("deepseek-v3").moe_spec(torch.bfloat16, 2, ep_size, ep_rank)
    tuned = MoEConfig(32, GemmConfig(64, 128, 1, 4, 3), GemmConfig(128, 128, 1, 4, 4))
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.write_config_file(tmp_path / configs.config_file_name(experts, width, "cpu", spec.dtype, (128, 128)),
                              {1: tuned})
    configs.write_config_file(tmp_path / configs.config_file_name(256, 2048, "cpu", spec.dtype, (128, 128)),
                              {1: MoEConfig(64, tuned.w13, tuned.w2)})  # the whole layer's: never this rank's
    assert TritonMoE(spec, torch.device("cpu")).config(1) == tuned


def test_capabilities_and_priority() -> None:
    caps = TritonMoE.capabilities
    assert caps.dtypes == {torch.bfloat16, torch.float16, torch.float32}
    assert caps.check(MoESpec(), Phase.DECODE)  # V3: block-FP8, noaux_tc (an sm89+ GPU, or the CPU)
    assert caps.check(MoESpec(weight_dtype=None, router=V2_ROUTER), Phase.PREFILL)
    assert not caps.check(MoESpec(block_shape=(64, 64)), Phase.DECODE)
    assert TritonMoE.priority_on(Hardware("cuda", "H100", (9, 0), 0, 132)) == 50
    assert TritonMoE.priority_on(Hardware.detect("cpu")) == -1  # below the reference: auto keeps torch_ref there


def test_fp8_needs_sm89(monkeypatch: pytest.MonkeyPatch) -> None:
    ampere = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 << 30, 108)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls, device=None: ampere))
    refused = TritonMoE.capabilities.check(MoESpec(), Phase.DECODE)
    assert not refused and "sm89" in refused.reason and "sm80" in refused.reason
    assert TritonMoE.capabilities.check(MoESpec(weight_dtype=None), Phase.DECODE)


def test_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    refused = TritonMoE.availability(Hardware.detect("cpu"))
    assert not refused and "TRITON_INTERPRET=1" in refused.reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonMoE.availability(Hardware.detect("cpu"))


@pytest.mark.skipif(ON_GPU, reason="checks the refusal on a machine without a GPU")
def test_tuner_refuses_the_cpu() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "benchmarks.tune.tune_fused_moe", "--quick"],
                            capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert result.returncode != 0 and "GPU" in result.stderr


def test_tuner_decode_space() -> None:
    """Decode-sized batches search narrow tiles whose K step divides the FP8 block, and wider BLOCK_SIZE_M
    only when an expert gets more than a few pairs."""
    from benchmarks.tune.tune_fused_moe import decode_space

    block_ms, tiles = decode_space(True, torch.bfloat16, pairs_per_expert=1 * 8 / 256)
    assert block_ms == (16,) and all(128 % tile.block_k == 0 for tile in tiles)
    assert {tile.block_n for tile in tiles} == {16, 32, 64, 128}
    assert sum(tile.tma for tile in tiles) * 2 == len(tiles)  # each tile with and without TMA weight loads
    block_ms, tiles = decode_space(False, torch.bfloat16, pairs_per_expert=64 * 6 / 64)
    assert block_ms == (16, 32) and {tile.block_k for tile in tiles} == {128, 256}


def test_tuner_quick_prefill_space_widens_the_quick_one() -> None:
    """From PREFILL_M tokens on the quick search adds 256-wide tiles and 8 warps to the tiles it tries below, in
    64- and 128-row blocks."""
    from benchmarks.tune.tune_fused_moe import PREFILL_M, search_space

    below_ms, below = search_space(True, torch.bfloat16, True, PREFILL_M - 1)
    block_ms, tiles = search_space(True, torch.bfloat16, True, PREFILL_M)
    assert below_ms == (16, 32, 64, 128) and block_ms == (64, 128)
    assert set(below) < set(tiles) and len(tiles) == 48
    assert {t.num_warps for t in tiles} == {4, 8} and {t.block_n for t in tiles} == {64, 128, 256}
    assert all(t.block_k == 128 for t in tiles)  # block-FP8: the scale block's K


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, True)], ids=["float32", "fp8"])
def test_tuner_checks_each_winner_against_the_reference(experts_kernels, monkeypatch: pytest.MonkeyPatch,
                                                        dtype: torch.dtype, fp8: bool) -> None:
    from benchmarks.tune.tune_fused_moe import Experts, check_config

    spec = MoESpec(256, 192, dtype, torch.float8_e4m3fn if fp8 else None, router=SMALL_V3)
    experts = Experts.random(spec, DEVICE)
    weights, ids = _routing(9, SMALL_V3)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    check_config(experts, TMA_TILES, x, ids, weights)
    monkeypatch.setattr(experts_kernels, "fused_experts", lambda x, *args, **kwargs: torch.zeros_like(x))
    with pytest.raises(AssertionError, match=r"tuned MoE config .* at M=9"):
        check_config(experts, TMA_TILES, x, ids, weights)


def test_tuner_times_the_files_config_beside_the_candidates(experts_kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --update a count's configuration in the file is timed too, and kept when no candidate beats it."""
    import benchmarks.tune.tune_fused_moe as tuner

    spec = MoESpec(256, 192, torch.float32, None, router=SMALL_V3)
    experts = tuner.Experts.random(spec, DEVICE)
    kept_tiles = (TMA_TILES.w13, TMA_TILES.w2)
    monkeypatch.setattr(tuner, "time_ms", lambda fn, quick: 1.0 if fn.keywords["config"] in kept_tiles else 2.0)
    best, total, _, _ = tuner.tune_batch(experts, 9, (16,), [SMALL_TILES.w13], True, kept=TMA_TILES)
    assert best == TMA_TILES and total == 2.0
    best, total, _, _ = tuner.tune_batch(experts, 9, (16,), [SMALL_TILES.w13], True)
    assert best == MoEConfig(16, SMALL_TILES.w13, SMALL_TILES.w13) and total == 4.0


def test_tuner_cuts_the_w13_pass_at_decode(experts_kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """At decode sizes the w13 pass's fastest uncut tiles are timed again with K cut into DECODE_SPLITS runs; the
    w2 pass is never cut. The winner passes the reference check (tune_batch's check_config)."""
    import benchmarks.tune.tune_fused_moe as tuner

    spec = MoESpec(256, 192, torch.float32, None, router=SMALL_V3)
    experts = tuner.Experts.random(spec, DEVICE)
    tiles = [SMALL_TILES.w13, replace(SMALL_TILES.w13, block_n=64)]
    monkeypatch.setattr(tuner, "decode_space", lambda *args: ((16,), tiles))
    timed: list[GemmConfig] = []
    monkeypatch.setattr(tuner, "time_ms", lambda fn, quick: timed.append(fn.keywords["config"])
                        or (1.0 if fn.keywords["config"].split_k == 4 else 2.0))
    best, _, _, _ = tuner.tune_batch(experts, 1, None, None, True)
    assert best.w13.split_k == 4 and best.w2.split_k == 1
    assert {tile.split_k for tile in timed} == {1, *tuner.DECODE_SPLITS}
    assert all(tile.block_n in (32, 64) for tile in timed if tile.split_k > 1)


def test_tuner_loops_the_w2_pass_over_column_blocks_at_prefill(experts_kernels,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """From the prefill sizes on, the w2 pass's fastest tiles are timed again with PREFILL_COLUMN_BLOCKS column
    blocks a program; the w13 pass never loops. The winner passes the reference check."""
    import benchmarks.tune.tune_fused_moe as tuner

    spec = MoESpec(256, 192, torch.float32, None, router=SMALL_V3)
    experts = tuner.Experts.random(spec, DEVICE)
    tiles = [SMALL_TILES.w13, replace(SMALL_TILES.w13, block_n=64)]
    timed: list[tuple[GemmConfig, bool]] = []
    monkeypatch.setattr(tuner, "time_ms", lambda fn, quick: timed.append(
        (fn.keywords["config"], fn.keywords.get("silu_mul", False))) or (
        1.0 if fn.keywords["config"].column_blocks == 16 else 2.0))
    best, _, _, _ = tuner.tune_batch(experts, 9, (16,), tiles, True)
    assert best.w2.column_blocks == 16 and best.w13.column_blocks == 1
    assert {tile.column_blocks for tile, _ in timed} == {1, *tuner.PREFILL_COLUMN_BLOCKS}
    assert not any(silu and tile.column_blocks > 1 for tile, silu in timed)


def test_tuner_checks_its_expert_parallel_size(capsys: pytest.CaptureFixture[str]) -> None:
    """Before any GPU work: --ep is 1 or --tp (then a file of E / EP whole experts, the name each rank looks up)."""
    from benchmarks.tune import tune_fused_moe

    for argv, message in [(["--model", "v3", "--tp", "8", "--ep", "4"], "--ep 4 must be 1 or the tensor-parallel "
                                                                        "size (v3: --tp 8)"),
                          (["--model", "v3", "--tp", "512", "--ep", "512"], "v3's experts do not split over --tp 512 "
                                                                            "--ep 512")]:
        with pytest.raises(SystemExit):
            tune_fused_moe.main(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(("tp", "ep"), [(8, 1), (8, 8)])
def test_tuner_tunes_the_experts_a_rank_looks_up(tp: int, ep: int) -> None:
    from benchmarks.tune import tune_fused_moe

    tuned = tune_fused_moe.rank_spec(tune_fused_moe.MODELS["v3"], tp, ep, "fp8_w8a8")
    served = preset_config("deepseek-v3").moe_spec(torch.bfloat16, tp, ep, 0)
    assert (tuned.num_local_experts, tuned.intermediate_size) == (served.num_local_experts, served.intermediate_size)
    assert (tuned.is_fp8, tuned.dtype, tuned.router.num_experts) == (served.is_fp8, served.dtype, 256)


def test_tuner_writes_each_finished_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tuning run cut short (a device call's time limit) leaves the token counts it finished in the file."""
    import benchmarks.tune.tune_fused_moe as tuner

    cpu = Hardware.detect("cpu")
    monkeypatch.setattr(tuner.Hardware, "detect", lambda device: cpu)
    monkeypatch.setattr(tuner.Experts, "random", lambda spec, device: None)
    monkeypatch.setattr(tuner, "read_bandwidth", lambda device: 1e12)

    def tune_batch(experts, m, block_ms, tiles, quick, kept):
        if m == 64:
            raise KeyboardInterrupt  # the step's timeout
        return TMA_TILES, 1.0, 2.0, 1000

    monkeypatch.setattr(tuner, "tune_batch", tune_batch)
    with pytest.raises(KeyboardInterrupt):
        tuner.tune_model("v2", tuner.MODELS["v2"], 1, 1, "bfloat16", (1, 16, 64), True, 64, tmp_path)
    (path,) = tmp_path.iterdir()
    assert configs.load_config_file.__wrapped__(path) == {1: TMA_TILES, 16: TMA_TILES}
