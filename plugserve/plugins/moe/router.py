"""DeepSeek's gate as Triton kernels: the top-k experts of each token from its router logits (`grouped_topk`), or
from its hidden state and the gate's weight in one launch at decode sizes (`fused_router`), and the gate's logits
alone in tiles of a fixed number of tokens (`router_logits`: a token's logits the same bits at any token count).
Imported lazily (by `plugserve.plugins.moe.triton`), so that loading the plugin never imports Triton; with
TRITON_INTERPRET=1 set before this import the kernels run on the CPU in Triton's interpreter.

On Hopper and newer GPUs every kernel here launches as a programmatic dependent (`plugserve.core.triton_pdl`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugserve.core.specs import RouterConfig
from plugserve.core.triton_pdl import launch_options, programmatic_prologue

# `_select_experts`' GROUPING: how experts are grouped before the top-k.
NO_GROUPS, GROUP_BY_MAX, GROUP_BY_TOP2_SUM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# fused_router: at most this many tokens (its last program selects every token's experts one after another), over
# about ROUTER_PROGRAMS programs.
FUSED_ROUTER_MAX_TOKENS = 4
ROUTER_PROGRAMS = 64
# router_logits: tokens a program, at every token count: the fused router's largest tile (its [tokens, BLOCK_E,
# BLOCK_K] products held in registers).
ROUTER_BLOCK_T = FUSED_ROUTER_MAX_TOKENS


@triton.jit
def _select_experts(
    logits_row, bias_ptr, weights_ptr, ids_ptr, token,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, GROUPING: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_TO_ZERO: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, shared_weight,
    VOLATILE: tl.constexpr,
):
    """DeepSeek's gate for one token from its float32 logits at `logits_row` (VOLATILE: written by other
    programs of this launch, so read past the L1 cache) into row `token` of the outputs. Experts are laid out
    [group, expert in group] (one group: greedy). Rows of the outputs hold TOP_K routed then NUM_SHARED fused
    shared experts (ids E.., `shared_weight`)."""
    group = tl.arange(0, GROUPS_PAD)
    expert = group[:, None] * GROUP_SIZE + tl.arange(0, GROUP_PAD)[None, :]
    valid = (group[:, None] < NUM_GROUPS) & (tl.arange(0, GROUP_PAD)[None, :] < GROUP_SIZE)
    logits = tl.load(logits_row + expert, mask=valid, other=float("-inf"), volatile=VOLATILE).to(tl.float32)
    if SOFTMAX:
        shifted = tl.exp(logits - tl.max(tl.max(logits, 1), 0))
        scores = shifted / tl.sum(tl.sum(shifted, 1), 0)
    else:
        scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:  # noaux_tc: the bias decides which experts are chosen, not their weights
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if GROUPING != NO_GROUPS:
        top1 = tl.max(choice, 1)
        if GROUPING == GROUP_BY_MAX:
            group_score = top1
        else:  # the sum of the two best experts of each group
            column = tl.arange(0, GROUP_PAD)[None, :]
            first = tl.min(tl.where(choice == top1[:, None], column, GROUP_PAD), 1)
            group_score = top1 + tl.max(tl.where(column == first[:, None], float("-inf"), choice), 1)
        group_score = tl.where(group < NUM_GROUPS, group_score, float("-inf"))
        keep = group < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.min(tl.where(group_score == tl.max(group_score, 0), group, GROUPS_PAD), 0)
            keep = keep | (group == best)
            group_score = tl.where(group == best, float("-inf"), group_score)
        dropped = 0.0 if MASK_TO_ZERO else float("-inf")
        choice = tl.where(keep[:, None] & valid, choice, tl.where(valid, dropped, float("-inf")))

    slot = tl.arange(0, TOPK_PAD)
    topk_weights = tl.zeros([TOPK_PAD], dtype=tl.float32)
    topk_ids = tl.zeros([TOPK_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, 1), 0)
        pick = tl.min(tl.min(tl.where(choice == best, expert, GROUPS_PAD * GROUP_PAD), 1), 0)
        weight = tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), 1), 0)
        topk_weights = tl.where(slot == j, weight, topk_weights)
        topk_ids = tl.where(slot == j, pick, topk_ids)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if RENORMALIZE:
        topk_weights = topk_weights / (tl.sum(topk_weights, 0) + 1e-20)
    row = token * (TOP_K + NUM_SHARED)
    tl.store(weights_ptr + row + slot, topk_weights, mask=slot < TOP_K)
    tl.store(ids_ptr + row + slot, topk_ids, mask=slot < TOP_K)
    if NUM_SHARED > 0:
        shared = tl.arange(0, SHARED_PAD)
        on = shared < NUM_SHARED
        tl.store(weights_ptr + row + TOP_K + shared, tl.full(shared.shape, shared_weight, tl.float32), mask=on)
        tl.store(ids_ptr + row + TOP_K + shared, NUM_GROUPS * GROUP_SIZE + shared, mask=on)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_logits,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, GROUPING: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_TO_ZERO: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, shared_weight,
    PDL: tl.constexpr,
):
    """One token per program: `_select_experts` from its row of router logits."""
    programmatic_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    _select_experts(logits_ptr + token * stride_logits, bias_ptr, weights_ptr, ids_ptr, token,
                    NUM_GROUPS, GROUP_SIZE, GROUPS_PAD, GROUP_PAD, TOPK_GROUP, TOP_K, TOPK_PAD, SOFTMAX, GROUPING,
                    HAS_BIAS, MASK_TO_ZERO, RENORMALIZE, NUM_SHARED, SHARED_PAD, shared_weight, False)


@triton.jit
def _gate_logits(x_rows, gate_rows, token_ok, expert_ok, hidden, TOKENS: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The gate's float32 logits [TOKENS, BLOCK_E] of the tokens and experts whose rows start at x_rows [TOKENS, 1]
    and gate_rows [BLOCK_E, 1] (masked by token_ok [TOKENS], expert_ok [BLOCK_E]): the products of BLOCK_K columns at
    a time summed in float32, one slice after another."""
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([TOKENS, BLOCK_E], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + k
        w = tl.load(gate_rows + kk[None, :], mask=expert_ok[:, None] & (kk < hidden)[None, :], other=0.0)
        x = tl.load(x_rows + kk[None, :], mask=token_ok[:, None] & (kk < hidden)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _router_logits_kernel(
    x_ptr, gate_ptr, logits_ptr, num_tokens, num_experts, hidden, stride_x, stride_gate, stride_logits,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token block, expert block): the gate's logits of BLOCK_T tokens and BLOCK_E experts, token blocks
    fastest so that the programs streaming one slice of the gate run together."""
    programmatic_prologue(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    token_ok, expert_ok = t < num_tokens, e < num_experts
    acc = _gate_logits(x_ptr + t[:, None] * stride_x, gate_ptr + e[:, None].to(tl.int64) * stride_gate, token_ok,
                       expert_ok, hidden, BLOCK_T, BLOCK_E, BLOCK_K)
    tl.store(logits_ptr + t[:, None] * stride_logits + e[None, :], acc, mask=token_ok[:, None] & expert_ok[None, :])


@triton.jit
def _fused_router_kernel(
    x_ptr, gate_ptr, logits_ptr, arrived_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_tokens, hidden, stride_x, stride_gate,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, GROUPING: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_TO_ZERO: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, shared_weight,
    TOKENS_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program e: the gate's logits of experts [e * BLOCK_E, (e + 1) * BLOCK_E) for every token into the float32
    scratch logits [num_tokens, E] (contiguous). The program that arrives last (an atomic count in arrived_ptr,
    after every program's stores) selects every token's experts from the whole rows, and sets the count back to
    0 for the next launch (a CUDA graph's replay too)."""
    programmatic_prologue(PDL)
    experts = NUM_GROUPS * GROUP_SIZE
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.arange(0, TOKENS_PAD)
    token_ok, expert_ok = t < num_tokens, e < experts
    acc = _gate_logits(x_ptr + t[:, None] * stride_x, gate_ptr + e[:, None].to(tl.int64) * stride_gate, token_ok,
                       expert_ok, hidden, TOKENS_PAD, BLOCK_E, BLOCK_K)
    tl.store(logits_ptr + t[:, None] * experts + e[None, :], acc, mask=token_ok[:, None] & expert_ok[None, :])
    tl.debug_barrier()  # every thread's stores before the arrival (release) below
    if tl.atomic_add(arrived_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for token in range(num_tokens):
            _select_experts(logits_ptr + token * experts, bias_ptr, weights_ptr, ids_ptr, token,
                            NUM_GROUPS, GROUP_SIZE, GROUPS_PAD, GROUP_PAD, TOPK_GROUP, TOP_K, TOPK_PAD, SOFTMAX,
                            GROUPING, HAS_BIAS, MASK_TO_ZERO, RENORMALIZE, NUM_SHARED, SHARED_PAD, shared_weight,
                            True)
        tl.atomic_xchg(arrived_ptr, 0)


def grouped_topk(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, router: RouterConfig, num_shared: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's gate, as `torch_ref.select_experts`: router_logits [T, E] float32 (correction_bias [E],
    noaux_tc only) -> (topk_weights [T, k + num_shared] float32, topk_ids [T, k + num_shared] int32), best
    expert first, then the fused shared experts E .. E+S-1 weighted 1 / routed_scaling_factor.

    greedy: top-k of all scores; group_limited_greedy: top-k within the `topk_group` groups of the
    highest max score (other experts scored 0); noaux_tc: sigmoid scores plus the bias, groups ranked by
    the sum of their best two, other experts excluded, weights the unbiased scores."""
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.contiguous()
    width = router.top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    constants = _selection_constants(router, num_experts, num_shared, correction_bias is not None)
    _grouped_topk_kernel[(num_tokens,)](
        logits, correction_bias.contiguous() if correction_bias is not None else None, weights, ids, logits.stride(0),
        **constants, **launch_options(logits),
        num_warps=4 if constants["GROUPS_PAD"] * constants["GROUP_PAD"] > 256 else 1,
    )
    return weights, ids


def _selection_constants(router: RouterConfig, num_experts: int, num_shared: int, has_bias: bool) -> dict:
    """`_select_experts`' constexprs (and shared_weight) for `router` over num_experts experts."""
    grouped = router.topk_method != "greedy"
    num_groups = router.n_group if grouped else 1
    group_size = num_experts // num_groups
    grouping = {"greedy": NO_GROUPS, "group_limited_greedy": GROUP_BY_MAX, "noaux_tc": GROUP_BY_TOP2_SUM}
    return dict(
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, GROUPS_PAD=triton.next_power_of_2(num_groups),
        GROUP_PAD=triton.next_power_of_2(group_size), TOPK_GROUP=router.topk_group if grouped else 1,
        TOP_K=router.top_k, TOPK_PAD=triton.next_power_of_2(router.top_k),
        SOFTMAX=router.scoring_func == "softmax", GROUPING=grouping[router.topk_method], HAS_BIAS=has_bias,
        MASK_TO_ZERO=router.topk_method == "group_limited_greedy", RENORMALIZE=router.norm_topk_prob,
        NUM_SHARED=num_shared, SHARED_PAD=triton.next_power_of_2(max(num_shared, 1)),
        shared_weight=1.0 / router.routed_scaling_factor,
    )


def fused_router(
    x: torch.Tensor, gate: torch.Tensor, correction_bias: torch.Tensor | None, router: RouterConfig,
    num_shared: int, scratch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_topk(router_logits(x, gate), ...)` in one launch for a few tokens: x [T, H] (T <= FUSED_ROUTER_MAX_
    TOKENS, last dim contiguous), gate [E, H] contiguous (any float dtype; products summed in float32). scratch:
    (logits [>= T * E] float32, arrived [1] int32 zeros) kept by the caller across launches (the kernel leaves the
    count at 0 again). Same outputs as `grouped_topk`; no allocation but the outputs, no host sync."""
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    logits, arrived = scratch
    if num_tokens > FUSED_ROUTER_MAX_TOKENS or logits.numel() < num_tokens * num_experts:
        raise ValueError(f"fused_router takes at most {FUSED_ROUTER_MAX_TOKENS} tokens and scratch for them, got "
                         f"{num_tokens} tokens and {logits.numel()} scratch logits for {num_experts} experts")
    width = router.top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int32, device=x.device)
    if num_tokens == 0:
        return weights, ids
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens_pad = triton.next_power_of_2(num_tokens)
    block_e, block_k = _gate_tile(num_experts, hidden, tokens_pad)
    _fused_router_kernel[(triton.cdiv(num_experts, block_e),)](
        x, gate, logits, arrived, correction_bias.contiguous() if correction_bias is not None else None, weights, ids,
        num_tokens, hidden, x.stride(0), gate.stride(0),
        **_selection_constants(router, num_experts, num_shared, correction_bias is not None),
        TOKENS_PAD=tokens_pad, BLOCK_E=block_e, BLOCK_K=block_k, **launch_options(x), num_warps=4,
    )
    return weights, ids


def _gate_tile(num_experts: int, hidden: int, tokens: int) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_K) of `_gate_logits` over `tokens` tokens: enough programs to stream the gate at bandwidth (V3's
    256 x 7168 over 64), each a [tokens, BLOCK_E, BLOCK_K] product of at most 8192 float32 (64 registers a thread on 4
    warps)."""
    block_e = max(1, min(triton.next_power_of_2(num_experts) // ROUTER_PROGRAMS, 16))
    return block_e, max(16, min(1024, triton.next_power_of_2(hidden), 8192 // (tokens * block_e)))


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H] (last dim contiguous), gate [E, H] contiguous (any float dtype) -> the gate's logits [T, E] float32,
    products summed in float32 in tiles of ROUTER_BLOCK_T tokens whatever T: a token's logits are the same bits alone
    or in any batch (a cuBLAS GEMM picks its kernel, and its summation order, by T)."""
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return logits
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_e, block_k = _gate_tile(num_experts, hidden, ROUTER_BLOCK_T)
    _router_logits_kernel[(triton.cdiv(num_tokens, ROUTER_BLOCK_T), triton.cdiv(num_experts, block_e))](
        x, gate, logits, num_tokens, num_experts, hidden, x.stride(0), gate.stride(0), logits.stride(0),
        BLOCK_T=ROUTER_BLOCK_T, BLOCK_E=block_e, BLOCK_K=block_k, **launch_options(x), num_warps=4,
    )
    return logits
