"""The conformance kit's oracle: what every backend must compute, written from the contracts in
`core/interfaces.py` for clarity rather than speed, and independent of every backend (it imports no
plugin, `torch_ref` included), so that the kit checks the reference backends too.

- Float64 throughout: inputs are upcast from the dtype the kit draws them in, so the oracle's own
  rounding is far below every tolerance and a mismatch is the backend's.
- Attention one request at a time. The paged MLA cache is de-paged through the request's block table
  (position p lives on page block_table[b, p // page_size] at offset p % page_size), then an explicit
  softmax: scores, a bottom-right causal mask (or a draft tree's: a node sees the prefix, its ancestors and
  itself), exp, sum, divide; lse = max + log(sum).
- The KV cache's values are what its dtype holds: an fp8 (e4m3) cache's stored value times its per-tensor scale,
  the new tokens quantized as the contract says (`stored_kv`), so a backend is checked on the values it reads.
  A backend whose decode over it runs 8-bit MMAs (`AttentionBackend.rounds_decode_to_e4m3`) is checked against the
  query rounded as it declares (`round_query_e4m3`), with room for its probabilities' rounding
  (`mla_e4m3_probability_slack`).
- Absorbed MLA written out: q_nope already carries W_UK, so head h scores a cached token j as
  (q_nope[h] . c_kv[j] + q_rope[h] . k_rope[j]) * sm_scale and returns the softmax-weighted sum of c_kv
  (W_UV is applied after the backend); one KV head, the cache row, shared by every query head.
- Block-FP8 GEMM: quantize the activation per 1 x bk token group as the contract specifies, dequantize
  both operands (each element times the scale of its block), one dense matmul.
- MoE: DeepSeek's router (V3 noaux_tc, V2 group-limited greedy, V2-Lite greedy), then a loop over the
  tokens and, for each, over its k chosen experts.

Loops over requests and tokens are Python loops; within one, the math is vectorized, and score matrices
are cut into query blocks so that full DeepSeek-V3 shapes fit a GPU's memory in float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.specs import AttentionSpec, RouterConfig

NEG_INF = float("-inf")
# Float64 score elements of one block of queries: 2^26 x 8 bytes = 512 MiB, whatever the heads and keys
# (the softmax holds two such tensors at once).
MAX_SCORES = 1 << 26
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3 value

# ----------------------------------------------------------------------------------------------------
# Attention


def softmax_scale(spec: AttentionSpec) -> float:
    """The spec's sm_scale, or the contract's default 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)."""
    if spec.sm_scale is not None:
        return spec.sm_scale
    return 1.0 / math.sqrt(spec.qk_nope_head_dim + spec.qk_rope_head_dim)


def visible_keys(q_len: int, kv_len: int, causal: bool, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool, True where query i sees key j. Causal is bottom-right aligned: the q_len
    queries are positions kv_len - q_len .. kv_len - 1 and position p sees keys 0 .. p."""
    if not causal:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    query_position = torch.arange(kv_len - q_len, kv_len, device=device)
    key_position = torch.arange(kv_len, device=device)
    return key_position[None, :] <= query_position[:, None]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one request, in float64.

    q [n, H, D]; k [m, Hk, D], v [m, Hk, Dv] with Hk = H (MHA) or 1 (MQA: one key/value head shared by
    every query head); visible [n, m] bool. Returns out [n, H, Dv] and lse [n, H] float64, where
    lse = log(sum of exp(score) over the visible keys); a query that sees no key gets out = 0, lse = -inf.
    """
    n, heads = q.shape[:2]
    out = torch.zeros(n, heads, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((n, heads), NEG_INF, dtype=torch.float64, device=q.device)
    m = k.shape[0]
    if n == 0 or m == 0:
        return out, lse
    mqa = k.shape[1] == 1
    keys = "kd" if mqa else "khd"
    k64 = (k[:, 0] if mqa else k).double()
    v64 = (v[:, 0] if mqa else v).double()
    block = max(1, MAX_SCORES // (heads * m))
    for start in range(0, n, block):
        rows = slice(start, start + block)
        scores = torch.einsum(f"qhd,{keys}->hqk", q[rows].double(), k64) * sm_scale  # [H, r, m]
        scores.masked_fill_(~visible[rows], NEG_INF)
        best = scores.amax(dim=-1, keepdim=True)  # [H, r, 1]; -inf where no key is visible
        seen = torch.isfinite(best)
        # Shift by the max for range; rows that see nothing shift by 0 and keep exp(-inf) = 0 everywhere.
        weights = (scores - torch.where(seen, best, torch.zeros_like(best))).exp_()
        total = weights.sum(dim=-1, keepdim=True)
        probs = weights.div_(torch.where(seen, total, torch.ones_like(total)))
        out[rows] = torch.einsum(f"hqk,{keys}->qhd", probs, v64)
        lse[rows] = torch.where(seen, best + total.log(), NEG_INF).squeeze(-1).transpose(0, 1)
    return out, lse


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    sm_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Requests packed request-major: q [sum(q_lens), H, D]; k [sum(kv_lens), Hk, D], v [.., Hk, Dv].
    Request b's queries attend to its own keys only. Returns out [sum(q_lens), H, Dv], lse float64."""
    if len(q_lens) != len(kv_lens) or q.shape[0] != sum(q_lens) or k.shape[0] != sum(kv_lens):
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not hold q_lens {list(q_lens)} / "
                         f"kv_lens {list(kv_lens)}")
    outs, lses = [], []
    q_start = kv_start = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        qs, ks = slice(q_start, q_start + q_len), slice(kv_start, kv_start + kv_len)
        out, lse = attend(q[qs], k[ks], v[ks], visible_keys(q_len, kv_len, causal, q.device), sm_scale)
        outs.append(out)
        lses.append(lse)
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    return torch.cat(outs), torch.cat(lses)


def mha(
    batch: ForwardBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    prefix_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`AttentionBackend.forward_mha` on `batch`: q [T, H, Dqk] of the new tokens; k/v per request hold
    prefix chunk `prefix_chunk` (non-causal), the new tokens (MHA_CHUNKED_KV, causal) or the whole
    sequence (MHA, causal). Returns out [T, H, Dv] and lse [T, H] float64."""
    if prefix_chunk is not None:
        kv_lens, causal = batch.prefix_chunks[prefix_chunk].lens_cpu, False
    elif batch.attn_method is AttnForwardMethod.MHA_CHUNKED_KV:
        kv_lens, causal = batch.extend_lens_cpu, True
    else:
        kv_lens, causal = batch.seq_lens_cpu, True
    return ragged_attention(q, k, v, batch.extend_lens_cpu, kv_lens, sm_scale, causal)


def depage(cache: torch.Tensor, block_table_row: torch.Tensor, positions: torch.Tensor, page_size: int
           ) -> torch.Tensor:
    """A request's cache rows at `positions` [n] int64: position p lives on page
    block_table_row[p // page_size], at offset p % page_size. cache [num_slots, W] is a layer's pool
    buffer (slot = page * page_size + offset). Returns [n, W]."""
    pages = block_table_row[positions // page_size].long()
    return cache[pages * page_size + positions % page_size]


def stored_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a KV pool of `dtype` stores for x, as float64 values: float8_e4m3fn holds x / scale (divided in float32,
    saturated to +-448, rounded to nearest even), read back times scale; other dtypes hold x cast to them."""
    if dtype != FP8:
        return x.to(dtype).double()
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).double() * scale


def mla(
    batch: ForwardBatch,
    layer_id: int,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`AttentionBackend.forward_mla` after `set_kv(layer_id, batch.out_cache_loc, latent, k_rope)`,
    computed without trusting either: call it before the backend writes the new tokens.

    q_nope [T, H, R], q_rope [T, H, P]; latent [T, R] and k_rope [T, P] of the new tokens, stored in the
    cache's dtype as set_kv stores them (`stored_kv`); the prefix read as stored, times an fp8 pool's scale.
    Request b's keys are its prefix (positions 0 .. seq_len - extend_len - 1, de-paged from layer `layer_id` of
    batch.kv_pool) followed by its new tokens, seen causally, or with `batch.tree` as draft-tree nodes: node i
    sees node j where tree.mask[b, i, j].
    Returns out [T, H, R] and lse [T, H] float64."""
    outs, lses = [], []
    for q, k, c_kv, visible in _mla_requests(batch, layer_id, q_nope, q_rope, latent, k_rope):
        out, lse = attend(q, k, c_kv.unsqueeze(1), visible, sm_scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _mla_requests(batch: ForwardBatch, layer_id: int, q_nope: torch.Tensor, q_rope: torch.Tensor,
                  latent: torch.Tensor, k_rope: torch.Tensor
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per request (`mla`): its queries [new, H, R + P], keys [seq_len, 1, R + P] float64, latent values
    [seq_len, R] float64 and visible [new, seq_len] bool."""
    pool = batch.kv_pool
    cache, r, device = pool.buffer(layer_id), pool.kv_lora_rank, q_nope.device
    start = 0
    for b, (seq_len, new) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True)):
        rows = slice(start, start + new)
        start += new
        prefix = depage(cache, batch.block_table[b], torch.arange(seq_len - new, device=device), pool.page_size)
        prefix = prefix.double() * (pool.scale if pool.dtype == FP8 else 1.0)
        c_kv = torch.cat([prefix[:, :r], stored_kv(latent[rows], pool.dtype, pool.scale)])  # [seq_len, R]
        k_pe = torch.cat([prefix[:, r:], stored_kv(k_rope[rows], pool.dtype, pool.scale)])  # [seq_len, P]
        # q_nope . c_kv + q_rope . k_pe is one dot product of the concatenations: MQA over R + P columns.
        q = torch.cat([q_nope[rows], q_rope[rows]], dim=-1)  # [new, H, R + P]
        k = torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1)  # [seq_len, 1, R + P]
        visible = visible_keys(new, seq_len, True, device)
        if batch.tree is not None:  # the prefix, then the tree's ancestor-or-self mask over the new tokens
            visible[:, seq_len - new :] = batch.tree.mask[b]
        yield q, k, c_kv, visible


def mla_as_declared(batch: ForwardBatch, layer_id: int, q_nope: torch.Tensor, q_rope: torch.Tensor,
                    latent: torch.Tensor, k_rope: torch.Tensor, sm_scale: float, rounds_decode_to_e4m3: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`mla` (out, lse) for a backend with `AttentionBackend.rounds_decode_to_e4m3` as given, and the room its
    output needs beyond the dtype's bounds (None: none): a DECODE over an e4m3 cache by such a backend sees the
    query rounded (`round_query_e4m3`) and its probabilities' rounding (`mla_e4m3_probability_slack`)."""
    if not (rounds_decode_to_e4m3 and batch.mode is ForwardMode.DECODE and batch.kv_pool.dtype == FP8):
        return *mla(batch, layer_id, q_nope, q_rope, latent, k_rope, sm_scale), None
    q_nope, q_rope = round_query_e4m3(q_nope, q_rope)
    out, lse = mla(batch, layer_id, q_nope, q_rope, latent, k_rope, sm_scale)
    return out, lse, mla_e4m3_probability_slack(batch, layer_id, q_nope, q_rope, latent, k_rope, sm_scale)


def round_query_e4m3(q_nope: torch.Tensor, q_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed query [T, H, R] and [T, H, P] as a backend that rounds it for 8-bit MMAs declares it does
    (`AttentionBackend.rounds_decode_to_e4m3`): each head's R + P values divided by s = max |value| / 448 (float32,
    from the query's own dtype), rounded to e4m3 (nearest, ties to even), times s; float64."""
    q = torch.cat([q_nope, q_rope], dim=-1).float()
    scale = q.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    rounded = (q / scale).to(FP8).double() * scale.double()
    return rounded[..., : q_nope.shape[-1]], rounded[..., q_nope.shape[-1] :]


def mla_e4m3_probability_slack(batch: ForwardBatch, layer_id: int, q_nope: torch.Tensor, q_rope: torch.Tensor,
                               latent: torch.Tensor, k_rope: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Room [T, H, R] float64 for `mla`'s output when each probability is rounded to e4m3 on its way into the
    P V product (2^8 times its value against the running max, so at most 256), the row sums not: a probability
    moves by at most 2^-4 of itself on e4m3's normal range (2^-8 more where it was rounded to 16 bits first), by at
    most 2^-10 / 2^8 of the row's largest below it (subnormal), so an output element by at most
    (2^-4 + 2^-8) sum_k p_k |v_k| + 2^-18 sum_k |v_k| over the visible keys."""
    slacks = []
    for q, k, c_kv, visible in _mla_requests(batch, layer_id, q_nope, q_rope, latent, k_rope):
        weighted, _ = attend(q, k, c_kv.abs().unsqueeze(1), visible, sm_scale)  # sum_k p_k |v_k|
        flat = visible.double() @ c_kv.abs()  # [new, R]: sum_k |v_k|
        slacks.append((2**-4 + 2**-8) * weighted + 2**-18 * flat.unsqueeze(1))
    return torch.cat(slacks)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets: out_* [T, H, D], lse_* [T, H] -> float64.

    Each side's sum of exp(score) is exp(lse), so lse = log(exp(lse_a) + exp(lse_b)) and out is the
    average of out_a and out_b weighted by those sums. A side with lse = -inf saw no key and weighs 0,
    whatever its out holds; both -inf gives out = 0, lse = -inf."""
    lse_a, lse_b = lse_a.double(), lse_b.double()
    best = torch.maximum(lse_a, lse_b)
    seen = torch.isfinite(best)
    shift = torch.where(seen, best, torch.zeros_like(best))
    weight_a, weight_b = torch.exp(lse_a - shift), torch.exp(lse_b - shift)  # sums of exp, scaled alike
    total = weight_a + weight_b

    def part(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # where, not a product: 0 * NaN is NaN, and an empty side's out is unspecified.
        return torch.where(weight.unsqueeze(-1) > 0, weight.unsqueeze(-1) * out.double(), 0.0)

    out = (part(weight_a, out_a) + part(weight_b, out_b)) / torch.where(seen, total, 1.0).unsqueeze(-1)
    return out, torch.where(seen, shift + total.log(), NEG_INF)


# ----------------------------------------------------------------------------------------------------
# Block-FP8 GEMM

# An all-zero group's scale: x / scale stays 0 rather than NaN, and x_q * scale is 0 whatever it is.
SCALE_FLOOR = 1e-10


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's activation quantization: x [M, K] -> (x_q [M, K] float8_e4m3fn, scales
    [M, ceil(K/group)] float32). Per token and per group of `group` columns (the last may be shorter):
    scale = amax / 448 in float32, x_q = x / scale rounded to the nearest e4m3."""
    m, k = x.shape
    num_groups = -(-k // group)
    # The last group padded with zeros to full width: zeros change no amax and are cut off again.
    groups = F.pad(x.double(), (0, num_groups * group - k)).view(m, num_groups, group)
    scales = (groups.abs().amax(dim=-1).clamp(min=SCALE_FLOOR) / FP8_MAX).float()  # [M, G]
    x_q = (groups / scales.double().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x_q.view(m, num_groups * group)[:, :k].contiguous(), scales


def dequantize(w_q: torch.Tensor, scale_inv: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """w_q [..., N, K] float8_e4m3fn (or any float), scale_inv [..., ceil(N/bn), ceil(K/bk)] float32 ->
    float64 [..., N, K]: element (n, k) times the scale of its block (n // bn, k // bk)."""
    n, k = w_q.shape[-2:]
    bn, bk = block_shape
    if tuple(scale_inv.shape[-2:]) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"scales {tuple(scale_inv.shape)} are not the {block_shape} block grid of {tuple(w_q.shape)}")
    block_row = torch.arange(n, device=w_q.device) // bn
    block_col = torch.arange(k, device=w_q.device) // bk
    return w_q.double() * scale_inv.double()[..., block_row, :][..., block_col]


def fp8_gemm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor, block_shape: tuple[int, int]
) -> torch.Tensor:
    """`Fp8GemmBackend.apply`: x [M, K] quantized per 1 x bk token group, times the dequantized weight
    w_q [N, K] e4m3 (block scales [ceil(N/bn), ceil(K/bk)]) transposed. Returns [M, N] float64."""
    bk = block_shape[1]
    x_q, x_scales = quantize_per_token_group(x, bk)
    return dequantize(x_q, x_scales, (1, bk)) @ dequantize(w_q, w_scale_inv, block_shape).T


# ----------------------------------------------------------------------------------------------------
# MoE

# Two candidates (experts or groups) closer than this, relative to the token's largest choice score,
# are a tie that float32 routers may break either way.
ROUTER_TIE = 1e-6


@dataclass(frozen=True)
class Routing:
    """weights [T, k] float64 (without routed_scaling_factor) and ids [T, k] int64, sorted by expert id
    (the contract leaves the order free); near_tie [T] bool: a group or expert choice of that token was
    decided by less than ROUTER_TIE, so a float32 router may choose otherwise."""

    weights: torch.Tensor
    ids: torch.Tensor
    near_tie: torch.Tensor


def route(router_logits: torch.Tensor, router: RouterConfig, correction_bias: torch.Tensor | None,
          tie: float = ROUTER_TIE) -> Routing:
    """`MoEBackend.route`: router_logits [T, E] (and the e_score_correction_bias [E], noaux_tc only). `tie`: the
    relative closeness of a near tie (ROUTER_TIE for float32 logits the backend is given; more for logits it
    computes itself, whose float32 sums are further off).

    scores = softmax or sigmoid of the logits. greedy (V2-Lite): the k best scores. group_limited_greedy
    (V2): the k best among the topk_group groups of E / n_group experts with the best max score. noaux_tc
    (V3): choice = scores + bias, groups ranked by the sum of their best two choices, the k best choices
    among the topk_group best groups; the bias steers the choice only. The weights are the unbiased
    scores of the chosen experts, divided by their sum when norm_topk_prob."""
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.double()
    scores = logits.softmax(dim=-1) if router.scoring_func == "softmax" else logits.sigmoid()
    v3 = router.topk_method == "noaux_tc"
    if v3 and correction_bias is None:
        raise ValueError("noaux_tc needs the correction bias")
    choice = scores + correction_bias.double() if v3 else scores  # type: ignore[union-attr]
    tie = tie * choice.abs().amax(dim=1)
    near_tie = torch.zeros(num_tokens, dtype=torch.bool, device=logits.device)
    allowed = torch.ones_like(choice, dtype=torch.bool)
    if router.topk_method != "greedy":
        per_group = choice.view(num_tokens, router.n_group, num_experts // router.n_group)
        group_score = per_group.topk(2, dim=-1).values.sum(dim=-1) if v3 else per_group.amax(dim=-1)
        best_groups = group_score.sort(dim=1, descending=True)
        kept = torch.zeros_like(group_score, dtype=torch.bool)
        kept.scatter_(1, best_groups.indices[:, : router.topk_group], True)
        allowed = kept.repeat_interleave(num_experts // router.n_group, dim=1)
        if router.topk_group < router.n_group:
            gap = best_groups.values[:, router.topk_group - 1] - best_groups.values[:, router.topk_group]
            near_tie |= gap <= tie
    best = choice.masked_fill(~allowed, NEG_INF).sort(dim=1, descending=True)
    ids = best.indices[:, : router.top_k]
    if router.top_k < num_experts:
        near_tie |= best.values[:, router.top_k - 1] - best.values[:, router.top_k] <= tie
    weights = scores.gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=1, keepdim=True)
    ids, order = ids.sort(dim=1)
    return Routing(weights.gather(1, order), ids, near_tie)


def _fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] -> float64 [M, K] as per-token-group e4m3 quantization leaves it (x_q * scale)."""
    x_q, scales = quantize_per_token_group(x, group)
    return dequantize(x_q, scales, (1, group))


# Hopper's FP8 tensor cores add a K block's products with about 14 mantissa bits before a backend adds the block into
# float32 (DeepSeek-V3's report, 3.3.2), so its gate and up may differ from the float64 ones by up to about this
# times the sum of the products' magnitudes (`moe_rounding_flips.py` in benchmarks/ checks it); h inherits the error.
ACCUMULATION_REL = 2.0**-16


def moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """`MoEBackend.forward`: x [T, H]; w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up), w2 [E, H, I] in
    a float dtype, or float8_e4m3fn with block scales [E, ceil(2I/bn), ceil(H/bk)] / [E, ceil(H/bn),
    ceil(I/bk)]; topk_ids, topk_weights [T, k]. Returns [T, H] float64:
    out[t] = routed_scaling_factor * sum_j topk_weights[t, j] * W2_e (silu(Wgate_e x[t]) * (Wup_e x[t]))
    with e = topk_ids[t, j]. Block-FP8 experts quantize their inputs (x, then the intermediate) per
    1 x bk token group, as the block-FP8 GEMM contract does: they are w8a8."""
    return moe_with_rounding_slack(x, w13, w2, topk_ids, topk_weights, routed_scaling_factor, w13_scale_inv,
                                   w2_scale_inv, block_shape)[0]


def moe_with_rounding_slack(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`moe`'s output, its rounding slack), both [T, H] float64. The slack is 0 for unquantized experts. For
    block-FP8 ones it is how far each output may move where a backend, whose h is off by its accumulation error
    (`silu_mul_with_error`), rounds an element of h to the other e4m3 neighbour: the sum, over the token's pairs
    and the elements of h that can flip (`rounding_flip_steps`), of routed_scaling_factor * |weight| * |W2_e[:, i]|
    * one e4m3 step of h_i. Elsewhere the backend must round as the oracle does."""
    fp8 = w13.dtype == FP8
    if fp8 and (w13_scale_inv is None or w2_scale_inv is None):
        raise ValueError("float8_e4m3fn experts need their block scales")
    group = block_shape[1]

    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    slack = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    # Quantization is per token (row), so all rows at once quantize each token as it would alone.
    inputs = _fake_quant(x, group) if fp8 else x.double()  # [T, H]
    top_k = topk_ids.shape[1]
    pair_ids = topk_ids.reshape(-1).long()  # pair p = t * top_k + j
    pair_weights = routed_scaling_factor * topk_weights.double().reshape(-1, 1)  # [P, 1]
    # One expert at a time, all its pairs at once: each expert is dequantized once.
    for e in pair_ids.unique().tolist():
        pairs = (pair_ids == e).nonzero().view(-1)
        tokens, weight = pairs // top_k, pair_weights[pairs]
        if fp8:
            w13_e = dequantize(w13[e], w13_scale_inv[e], block_shape)  # type: ignore[index]
            w2_e = dequantize(w2[e], w2_scale_inv[e], block_shape)  # type: ignore[index]
        else:
            w13_e, w2_e = w13[e].double(), w2[e].double()
        h, h_error = silu_mul_with_error(inputs[tokens], w13_e, ACCUMULATION_REL if fp8 else 0.0)  # [P_e, I]
        if fp8:
            slack.index_add_(0, tokens, weight.abs() * (rounding_flip_steps(h, h_error, group) @ w2_e.abs().T))
            h = _fake_quant(h, group)
        out.index_add_(0, tokens, weight * (h @ w2_e.T))
    return out, slack


def silu_mul_with_error(x: torch.Tensor, w13: torch.Tensor,
                        accumulation_rel: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, H], w13 [2I, H] (gate rows, then up rows), both float64 -> (h = silu(gate) * up, its error bound),
    both [M, I] float64: what h may be off by where gate and up are each off by accumulation_rel times the sum of
    their products' magnitudes, carried through silu(gate) * up to first order (no bound is computed for 0)."""
    intermediate = w13.shape[0] // 2
    gate_up = x @ w13.T
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    sigmoid = torch.sigmoid(gate)
    h = gate * sigmoid * up
    if accumulation_rel == 0:
        return h, torch.zeros_like(h)
    error = accumulation_rel * (x.abs() @ w13.abs().T)
    silu_slope = sigmoid * (1 + gate * (1 - sigmoid))
    return h, (silu_slope * up).abs() * error[:, :intermediate] + (gate * sigmoid).abs() * error[:, intermediate:]


def rounding_flip_steps(h: torch.Tensor, h_error: torch.Tensor, group: int) -> torch.Tensor:
    """h, h_error [M, K] float64 -> [M, K] float64: for each element whose per-1 x group e4m3 quantization may
    round to the other neighbour when h moves by up to h_error, directly or through its group's scale (amax / 448,
    which moves with the amax), the dequantized step to the neighbour across that rounding
    boundary; 0 elsewhere."""
    m, k = h.shape
    x_q, scales = quantize_per_token_group(h, group)
    scale = scales.double().repeat_interleave(group, dim=1)[:, :k]
    v = h / scale  # what the quantizer rounds, |v| <= 448
    # The scale moves as the group's amax may: to the largest |h| + h_error, or down to the largest |h| - h_error.
    padding = (0, -k % group)
    magnitude, error = (F.pad(t, padding).view(m, -1, group) for t in (h.abs(), h_error))  # [M, G, group]
    amax = magnitude.amax(dim=-1)
    scale_move = torch.maximum((magnitude + error).amax(dim=-1) - amax, amax - (magnitude - error).amax(dim=-1))
    scale_rel = (scale_move / amax.clamp(min=SCALE_FLOOR)).repeat_interleave(group, dim=1)[:, :k]
    # 2^-22: the float32 rounding of the scale and of h / scale, which may differ by an ulp between computations.
    tolerance = h_error / scale + v.abs() * (scale_rel + 2.0**-22)
    a, b = v.abs(), x_q.double().abs()  # b: the e4m3 value a rounds to
    # e4m3 spacing above b: 2^(floor(log2 b) - 3) for normals (>= 2^-6), 2^-9 below; half that below a power of two.
    # frexp, not log2: CUDA's float64 log2 of a power of two may fall just short of the integer.
    normal = b.clamp(min=2.0**-6)
    mantissa, _ = torch.frexp(normal)  # normal = mantissa * 2^e, mantissa in [0.5, 1)
    above = normal / mantissa / 16  # 2^(e - 4) exactly
    below = torch.where((mantissa == 0.5) & (b > 2.0**-6), above / 2, above)
    # Either boundary around b may be the one within reach (just above a power of two, the one below is nearer).
    up = ((b + above / 2 - a).abs() <= tolerance) & (b < FP8_MAX)
    down = (a - (b - below / 2)).abs() <= tolerance  # from 0: across -below / 2, to the negative neighbour
    return torch.where(up, above, torch.where(down, below, 0.0)) * scale
