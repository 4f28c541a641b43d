"""The kit's oracle: independent of every backend, right on cases checked by hand, and equal to other
formulations (SDPA, un-absorbed MLA, a block-by-block dequantized matmul, two chained block-FP8 GEMMs)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plugserve.conformance import oracle
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import RouterConfig

TESTING = Path(oracle.__file__).parent
F64 = torch.float64


@pytest.mark.parametrize("module", ["oracle.py", "test_attention_conformance.py", "test_gemm_conformance.py",
                                    "test_moe_conformance.py"])
def test_the_oracle_and_the_kit_import_no_backend(module: str):
    tree = ast.parse((TESTING / module).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("plugserve.plugins") or "torch_ref" in m]


# ----------------------------------------------------------------------------------------------------
# Attention


def test_attention_by_hand():
    """One head, two tokens, sm_scale 1. Token 0 sees key 0 alone: out = v0, lse = q.k0 = 0. Token 1
    sees scores (0, ln 3): probabilities (1/4, 3/4), out = v0 / 4 + 3 v1 / 4 = (1, 6), lse = ln 4."""
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])  # [2 tokens, 1 head, 2]
    k = torch.tensor([[[0.0, 0.0]], [[math.log(3), 5.0]]])
    v = torch.tensor([[[4.0, 0.0]], [[0.0, 8.0]]])
    out, lse = oracle.ragged_attention(q, k, v, [2], [2], sm_scale=1.0, causal=True)
    torch.testing.assert_close(out, torch.tensor([[[4.0, 0.0]], [[1.0, 6.0]]], dtype=F64))
    torch.testing.assert_close(lse, torch.tensor([[0.0], [math.log(4)]], dtype=F64))
    # Non-causal, token 0 sees both keys too; a request with no key gets out 0 and lse -inf.
    out, lse = oracle.ragged_attention(q, k, v, [1, 1], [2, 0], sm_scale=1.0, causal=False)
    torch.testing.assert_close(out, torch.tensor([[[1.0, 6.0]], [[0.0, 0.0]]], dtype=F64))
    torch.testing.assert_close(lse, torch.tensor([[math.log(4)], [-math.inf]], dtype=F64))


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_matches_sdpa(kv_heads: int, causal: bool):
    torch.manual_seed(0)
    q_lens, kv_lens, heads, scale = [3, 1, 5], [7, 1, 5], 4, 0.3
    q = torch.randn(sum(q_lens), heads, 24)
    k = torch.randn(sum(kv_lens), kv_heads, 24)
    v = torch.randn(sum(kv_lens), kv_heads, 16)
    out, lse = oracle.ragged_attention(q, k, v, q_lens, kv_lens, scale, causal)
    q_start = kv_start = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        qs, ks = slice(q_start, q_start + q_len), slice(kv_start, kv_start + kv_len)
        q_start, kv_start = q_start + q_len, kv_start + kv_len
        # Bottom-right: query i is position kv_len - q_len + i.
        mask = torch.ones(q_len, kv_len, dtype=torch.bool)
        if causal:
            mask = torch.ones(kv_len, kv_len, dtype=torch.bool).tril()[kv_len - q_len :]
        qh, kh, vh = (t.double().transpose(0, 1) for t in (q[qs], k[ks].expand(-1, heads, -1),
                                                           v[ks].expand(-1, heads, -1)))
        expected = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[qs], expected)
        scores = (qh @ kh.transpose(1, 2) * scale).masked_fill(~mask, -math.inf)
        torch.testing.assert_close(lse[qs], torch.logsumexp(scores, dim=-1).transpose(0, 1))


def test_query_blocks_do_not_change_the_result(monkeypatch: pytest.MonkeyPatch):
    """Long prefills are cut into query blocks (memory on the GPU); one row per block gives the same."""
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 4)
    whole = oracle.ragged_attention(q, k, v, [9], [12], 0.4, causal=True)
    monkeypatch.setattr(oracle, "MAX_SCORES", 1)
    for blocked, expected in zip(oracle.ragged_attention(q, k, v, [9], [12], 0.4, causal=True), whole, strict=True):
        torch.testing.assert_close(blocked, expected)


def test_mla_is_attention_over_the_decompressed_paged_cache():
    """The absorbed oracle, de-paging a shuffled cache, then W_UV, equals plain causal MHA of the
    un-absorbed model: k = (W_UK c_kv ++ k_rope), v = W_UV c_kv, q = (q_nope ++ q_rope)."""
    torch.manual_seed(0)
    heads, nope, rank, rope, v_dim, page = 3, 8, 16, 4, 6, 2
    seq_lens, extend_lens = [5, 3], [2, 3]  # request 0: 3 cached tokens + 2 new; request 1: 3 new
    block_table = torch.tensor([[4, 0, 2], [3, 1, 1]], dtype=torch.int32)  # pages out of order
    pool = MLAKVPool(2, 5, page, rank, rope, F64, "cpu")
    pool.buffer(1).copy_(torch.randn(5 * page, rank + rope) * 100)  # whatever the pages hold besides
    batch = ForwardBatch.build(ForwardMode.EXTEND, seq_lens, extend_lens, block_table, pool)
    c_kv = [torch.randn(s, rank, dtype=F64) for s in seq_lens]
    k_rope = [torch.randn(s, rope, dtype=F64) for s in seq_lens]
    for b, seq_len in enumerate(seq_lens):  # the cached prefix, written position by position
        for p in range(seq_len - extend_lens[b]):
            slot = int(block_table[b, p // page]) * page + p % page
            pool.buffer(1)[slot] = torch.cat([c_kv[b][p], k_rope[b][p]])
    new_latent = torch.cat([c[-e:] for c, e in zip(c_kv, extend_lens, strict=True)])
    new_rope = torch.cat([r[-e:] for r, e in zip(k_rope, extend_lens, strict=True)])
    w_uk, w_uv = torch.randn(heads, nope, rank, dtype=F64), torch.randn(heads, rank, v_dim, dtype=F64)
    q_nope = torch.randn(sum(extend_lens), heads, nope, dtype=F64)
    q_rope = torch.randn(sum(extend_lens), heads, rope, dtype=F64)
    scale = 0.2

    absorbed, _ = oracle.mla(batch, 1, torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope, new_latent, new_rope,
                             scale)
    out = torch.einsum("thr,hrv->thv", absorbed, w_uv)

    start = 0
    for b, (seq_len, new) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        k = torch.cat([torch.einsum("hnr,sr->hsn", w_uk, c_kv[b]), k_rope[b].expand(heads, -1, -1)], dim=-1)
        v = torch.einsum("sr,hrv->hsv", c_kv[b], w_uv)
        q = torch.cat([q_nope[start : start + new], q_rope[start : start + new]], dim=-1).transpose(0, 1)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[seq_len - new :]
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[start : start + new], expected)
        start += new


def test_the_query_rounded_to_e4m3_per_head():
    """Each head's largest magnitude lands on 448 s exactly (s = that magnitude / 448 in float32), every value on
    e4m3's grid times s, within 2^-4 of itself where it is normal (e4m3's 3-bit mantissa)."""
    torch.manual_seed(0)
    q_nope, q_rope = torch.randn(3, 4, 16, dtype=torch.bfloat16) * 5, torch.randn(3, 4, 8, dtype=torch.bfloat16)
    q_nope[1, 2] = 0  # an all-zero head (but its rope part) stays finite
    nope, rope = oracle.round_query_e4m3(q_nope, q_rope)
    q, rounded = torch.cat([q_nope, q_rope], -1).double(), torch.cat([nope, rope], -1)
    scale = (q.float().abs().amax(-1, keepdim=True) / 448).double()  # float32, as the backends compute it
    assert torch.equal(rounded.abs().amax(-1, keepdim=True), 448 * scale)
    steps = rounded / scale
    assert torch.equal(steps.to(torch.float8_e4m3fn).double(), steps)
    normal = (q / scale).abs() >= 2**-6
    assert ((rounded - q).abs()[normal] <= 2**-4 * q.abs()[normal] + 1e-12).all()


def _e4m3_decode(batch: ForwardBatch, q_nope: torch.Tensor, q_rope: torch.Tensor, scale: float,
                 dropped_keys: slice = slice(0)) -> torch.Tensor:
    """What an 8-bit MLA decode computes, written apart from the oracle: the query rounded per head, each
    probability 2^8 times its value against the row max rounded to e4m3 before P V (the sum not), over 64-key blocks;
    `dropped_keys` of every block left out of P V (a wgmma's lost k-step)."""
    pool, r, outs = batch.kv_pool, batch.kv_pool.kv_lora_rank, []
    for b, seq_len in enumerate(batch.seq_lens_cpu):
        pos = torch.arange(seq_len)
        rows = pool.buffer(1)[batch.block_table[b, pos // pool.page_size].long() * pool.page_size
                              + pos % pool.page_size].double() * pool.scale
        q = torch.cat([q_nope[b], q_rope[b]], -1).float()  # [H, R + P]
        s = q.abs().amax(-1, keepdim=True) / 448
        q = (q / s).to(torch.float8_e4m3fn).double() * s.double()
        scores = q @ rows.T * scale
        p = (scores - scores.amax(-1, keepdim=True)).exp()
        p_rounded = (p * 256).to(torch.float8_e4m3fn).double() / 256
        for start in range(0, seq_len, 64):
            p_rounded[:, start:start + 64][:, dropped_keys] = 0
        outs.append(p_rounded @ rows[:, :r] / p.sum(-1, keepdim=True))
    return torch.stack(outs)


def test_the_e4m3_slack_admits_rounded_probabilities_and_catches_a_lost_k_step():
    """A decode over an e4m3 cache that rounds its query and probabilities as `rounds_decode_to_e4m3` declares
    lands within the bf16 bounds plus `mla_e4m3_probability_slack` of `mla_as_declared`; one that leaves keys 32-63
    of each 64-key block out of P V (one of two k-steps of an 8-bit wgmma) does not. Without the declaration the
    oracle is `mla`'s."""
    from plugserve.conformance.batches import random_batch
    from plugserve.conformance.tolerances import assert_close
    from plugserve.core.specs import AttentionSpec

    torch.manual_seed(0)
    spec = AttentionSpec(num_heads=8, dtype=torch.bfloat16, page_size=16, kv_cache_dtype=torch.float8_e4m3fn)
    batch = random_batch(ForwardMode.DECODE, [40, 130, 64], [1, 1, 1], spec, torch.device("cpu"), kv_scale=0.5)
    q_nope, q_rope = torch.randn(3, 8, 512, dtype=torch.bfloat16), torch.randn(3, 8, 64, dtype=torch.bfloat16)
    new = torch.zeros(3, 576, dtype=torch.bfloat16)  # the new tokens' rows, already in the cache: read back
    for b, slot in enumerate(batch.out_cache_loc.tolist()):
        new[b] = (batch.kv_pool.buffer(1)[slot].double() * batch.kv_pool.scale).to(torch.bfloat16)
    scale = oracle.softmax_scale(spec)
    expected, _, slack = oracle.mla_as_declared(batch, 1, q_nope, q_rope, new[:, :512], new[:, 512:], scale, True)
    assert slack is not None
    out = _e4m3_decode(batch, q_nope, q_rope, scale)
    assert_close(out, expected, torch.bfloat16, "e4m3 decode", slack=slack)
    plain, _, none = oracle.mla_as_declared(batch, 1, q_nope, q_rope, new[:, :512], new[:, 512:], scale, False)
    assert none is None and torch.equal(plain, oracle.mla(batch, 1, q_nope, q_rope, new[:, :512], new[:, 512:],
                                                          scale)[0])
    with pytest.raises(AssertionError):
        assert_close(_e4m3_decode(batch, q_nope, q_rope, scale, slice(32, 64)), expected, torch.bfloat16,
                     "a lost k-step", slack=slack)


def test_merge_is_attention_over_the_union():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 2, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 5)
    visible = torch.ones(4, 9, dtype=torch.bool)
    whole = oracle.attend(q, k, v, visible, 0.5)
    a = oracle.attend(q, k[:4], v[:4], visible[:, :4], 0.5)
    b = oracle.attend(q, k[4:], v[4:], visible[:, 4:], 0.5)
    for merged, expected in zip(oracle.merge_attn_states(*a, *b), whole, strict=True):
        torch.testing.assert_close(merged, expected)
    # A side that saw no key weighs nothing, even when its out is NaN; both empty: 0 and -inf.
    nan = torch.full_like(a[0], math.nan)
    empty = torch.full_like(a[1], -math.inf)
    torch.testing.assert_close(oracle.merge_attn_states(nan, empty, *b), b)
    out, lse = oracle.merge_attn_states(nan, empty, nan, empty)
    assert (out == 0).all() and torch.isneginf(lse).all()


# ----------------------------------------------------------------------------------------------------
# Block-FP8 GEMM


def test_quantization_by_hand():
    """Group 0 (128 columns): amax 896 -> scale 2; 2.2 / 2 = 1.1 rounds to e4m3's 1.125. Group 1 (the
    last 2 columns): amax 0.5 -> scale 0.5 / 448, values to +-448 * (their share of the amax)."""
    x = torch.zeros(1, 130)
    x[0, :5] = torch.tensor([896.0, 3.0, -1.0, 0.0, 2.2])
    x[0, 128:] = torch.tensor([0.25, -0.5])
    x_q, scales = oracle.quantize_per_token_group(x, 128)
    assert x_q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    torch.testing.assert_close(scales, torch.tensor([[2.0, 0.5 / 448]]))
    torch.testing.assert_close(x_q[0, :5].float(), torch.tensor([448.0, 1.5, -0.5, 0.0, 1.125]))
    torch.testing.assert_close(x_q[0, 128:].float(), torch.tensor([224.0, -448.0]))
    assert (x_q[0, 5:128].float() == 0).all()


def test_fp8_gemm_is_the_dense_dequantized_matmul():
    """N and K off the 128 grid; the weight dequantized block by block, the activation by its groups."""
    torch.manual_seed(0)
    m, n, k = 5, 200, 320
    w_q = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3) + 0.5
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.empty(n, k, dtype=F64)
    for i in range(2):
        for j in range(3):
            block = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            w[block] = w_q[block].double() * scale_inv[i, j].item()
    x_q, x_scales = oracle.quantize_per_token_group(x, 128)
    x_deq = torch.cat([x_q[:, j * 128 : (j + 1) * 128].double() * x_scales[:, j : j + 1].double()
                       for j in range(3)], dim=1)
    torch.testing.assert_close(oracle.fp8_gemm(x, w_q, scale_inv, (128, 128)), x_deq @ w.T)
    # And it is the product of the unquantized operands up to e4m3's rounding of the activation.
    cosine = F.cosine_similarity(oracle.fp8_gemm(x, w_q, scale_inv, (128, 128)).flatten(),
                                 (x.double() @ w.T).flatten(), dim=0)
    assert cosine > 0.999


# ----------------------------------------------------------------------------------------------------
# MoE


def _logit(p: list[float]) -> torch.Tensor:
    t = torch.tensor(p, dtype=torch.float32)
    return torch.log(t / (1 - t)).unsqueeze(0)  # sigmoid(logit(p)) = p


def test_v3_router_by_hand():
    """8 experts in 4 groups of 2, the best 2 groups, top 2, sigmoid scores p. Groups by the sum of their
    best two: g1 (0.6 + 0.55) and g0 (0.9 + 0.1) win, so expert 4 (0.8, group 2) is left out, and the
    choice is experts 0 and 2, weighted 0.9 / 1.5 and 0.6 / 1.5. A bias of +0.2 on expert 3 makes it
    beat expert 2 (0.75 > 0.6), but its weight is its unbiased score: 0.9 / 1.45 and 0.55 / 1.45."""
    router = RouterConfig(8, 2, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True)
    logits = _logit([0.9, 0.1, 0.6, 0.55, 0.8, 0.05, 0.3, 0.3])
    routing = oracle.route(logits, router, torch.zeros(8))
    assert routing.ids.tolist() == [[0, 2]] and not routing.near_tie.any()
    torch.testing.assert_close(routing.weights, torch.tensor([[0.6, 0.4]], dtype=F64))
    bias = torch.zeros(8)
    bias[3] = 0.2
    routing = oracle.route(logits, router, bias)
    assert routing.ids.tolist() == [[0, 3]]
    torch.testing.assert_close(routing.weights, torch.tensor([[0.9 / 1.45, 0.55 / 1.45]], dtype=F64))


def test_v2_routers_by_hand():
    """Softmax scores p (logits log p). Greedy: the best 3 anywhere. Group-limited (4 groups of 2, the 2
    groups with the best max): groups 0 (0.30) and 1 (0.25) only, so 0.22 loses to 0.02. No norm."""
    p = [0.30, 0.01, 0.25, 0.02, 0.22, 0.18, 0.01, 0.01]
    logits = torch.tensor(p).log().unsqueeze(0)
    greedy = oracle.route(logits, RouterConfig(8, 3, "softmax", "greedy", 1, 1, False), None)
    assert greedy.ids.tolist() == [[0, 2, 4]]
    torch.testing.assert_close(greedy.weights, torch.tensor([[0.30, 0.25, 0.22]], dtype=F64))
    limited = oracle.route(logits, RouterConfig(8, 3, "softmax", "group_limited_greedy", 4, 2, False), None)
    assert limited.ids.tolist() == [[0, 2, 3]]
    torch.testing.assert_close(limited.weights, torch.tensor([[0.30, 0.25, 0.02]], dtype=F64))


def test_router_flags_near_ties():
    router = RouterConfig(4, 1, "sigmoid", "noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True)
    logits = torch.tensor([[0.5, 0.5, -1.0, -1.0], [0.5, 0.4, -1.0, -1.0]])
    assert oracle.route(logits, router, torch.zeros(4)).near_tie.tolist() == [True, False]


def test_moe_by_hand():
    """H = 2, I = 1. Expert 0: gate x[0], up x[1], out (h, 0); expert 1: gate x[1], up x[0] + x[1],
    out (0, 2h); expert 2 is huge and never chosen. x = (1, 2), weights 1/4 and 3/4, scaling 2."""
    def silu(g: float) -> float:
        return g / (1 + math.exp(-g))

    w13 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 1.0]], [[1e6, 1e6], [1e6, 1e6]]])
    w2 = torch.tensor([[[1.0], [0.0]], [[0.0], [2.0]], [[1e6], [1e6]]])
    x = torch.tensor([[1.0, 2.0]])
    out = oracle.moe(x, w13, w2, torch.tensor([[0, 1]]), torch.tensor([[0.25, 0.75]]), 2.0)
    expected = [2 * 0.25 * silu(1) * 2, 2 * 0.75 * 2 * silu(2) * 3]
    torch.testing.assert_close(out, torch.tensor([expected], dtype=F64))


def test_fp8_moe_is_two_block_fp8_gemms_per_expert():
    torch.manual_seed(0)
    e, h, i, k = 4, 256, 192, 2
    w13_q = (torch.randn(e, 2 * i, h) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    w2_q = (torch.randn(e, h, i) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(e, 3, 2) / 100, torch.rand(e, 2, 2) / 100
    x = torch.randn(3, h, dtype=torch.bfloat16)
    ids, weights = torch.tensor([[3, 0], [1, 2], [2, 3]]), torch.rand(3, k)
    out = oracle.moe(x, w13_q, w2_q, ids, weights, 2.5, s13, s2)
    for t in range(3):
        expected = torch.zeros(h, dtype=F64)
        for j in range(k):
            ex = int(ids[t, j])
            gate_up = oracle.fp8_gemm(x[t : t + 1], w13_q[ex], s13[ex], (128, 128))
            hidden = F.silu(gate_up[:, :i]) * gate_up[:, i:]
            expected += weights[t, j].item() * oracle.fp8_gemm(hidden, w2_q[ex], s2[ex], (128, 128))[0]
        torch.testing.assert_close(out[t], 2.5 * expected)


def test_rounding_flip_steps_mark_only_values_within_their_error_of_a_boundary():
    """Group amax 448 makes the scale 1: 1.0625 lies on the boundary between e4m3's 1.0 and 1.125 (step 0.125),
    100.0001 within its error 0.01 of the one between 96 and 104 (step 8); 1.03 and 99 are farther from any than
    their error, and 448 itself is the largest value. The second row, twice the first, has its own scale 2 and
    twice the steps. Without an error only the value exactly on a boundary is marked."""
    h = torch.tensor([448.0, 1.0625, 100.0001, 1.03, 99.0], dtype=F64)
    error = torch.tensor([0.0, 0.0, 0.01, 0.01, 0.01], dtype=F64)
    steps = oracle.rounding_flip_steps(torch.stack([h, 2 * h]), torch.stack([error, 2 * error]), 128)
    expected = torch.tensor([0.0, 0.125, 8.0, 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(steps, torch.stack([expected, 2 * expected]))
    exact = oracle.rounding_flip_steps(h.unsqueeze(0), torch.zeros(1, 5, dtype=F64), 128)
    torch.testing.assert_close(exact[0], torch.tensor([0.0, 0.125, 0.0, 0.0, 0.0], dtype=F64))


def test_rounding_flip_steps_count_the_scale_moving_with_the_amax():
    """An error on the amax element (448 -> 448 +- 4.48, 1 %) moves the scale and every value with it: 1.06 is
    1.06 +- 0.0106 in units of the scale, which reaches the boundary at 1.0625; so does another element's error
    that can make it the amax."""
    h = torch.tensor([[448.0, 1.06]], dtype=F64)
    steps = oracle.rounding_flip_steps(h, torch.tensor([[4.48, 0.0]], dtype=F64), 128)
    torch.testing.assert_close(steps, torch.tensor([[0.0, 0.125]], dtype=F64))
    assert not oracle.rounding_flip_steps(h, torch.tensor([[0.0, 0.001]], dtype=F64), 128).any()
    # Another element may become the amax: 447 + 5.48 moves it by 1 % too.
    h = torch.tensor([[448.0, 447.0, 1.06]], dtype=F64)
    steps = oracle.rounding_flip_steps(h, torch.tensor([[0.0, 5.48, 0.0]], dtype=F64), 128)
    assert steps[0, 2] == 0.125


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("absolute", [1e-1, 1e-2, 1e-3, 0.0])
def test_every_code_that_moving_h_within_its_error_changes_is_marked(absolute: float, device: str):
    """h moved anywhere within h_error (a relative and an absolute part, as an accumulation error has) changes the
    e4m3 code only of elements rounding_flip_steps marks, by the step it gives, through the scale too; a power of
    two's lower boundary, a quarter step away, included. On the GPU too: its float64 log2 of a power of two may
    fall short of the integer, which once left such codes unmarked."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(512, 256, generator=g, dtype=F64) * torch.randn(512, 256, generator=g, dtype=F64)
    h_error = 3e-4 * h.abs() + absolute * torch.rand(512, 256, generator=g, dtype=F64)
    moved = h + h_error * (2 * torch.rand(512, 256, generator=g, dtype=F64) - 1)
    h, h_error, moved = (t.to(device) for t in (h, h_error, moved))
    steps = oracle.rounding_flip_steps(h, h_error, 128)
    (before, scales), (after, _) = (oracle.quantize_per_token_group(t, 128) for t in (h, moved))
    changed = before.double() != after.double()
    assert changed.sum() > 100 and not (changed & (steps == 0)).any()
    # Where the scale stays, a changed code moved by exactly the marked step.
    code_step = (after.double() - before.double()).abs() * scales.double().repeat_interleave(128, dim=1)
    same_scale = (scales == oracle.quantize_per_token_group(moved, 128)[1]).repeat_interleave(128, dim=1)
    torch.testing.assert_close(code_step[changed & same_scale], steps[changed & same_scale])


def test_silu_mul_error_bounds_h_when_gate_and_up_move_by_theirs():
    """Gate and up moved by their bound (rel x |x| @ |W|^T) with any signs move h by at most its bound, to first
    order; a tiny rel keeps second-order terms out."""
    torch.manual_seed(0)
    x, w13 = torch.randn(64, 32, dtype=F64), torch.randn(48, 32, dtype=F64)
    rel = 1e-8
    h, h_error = oracle.silu_mul_with_error(x, w13, rel)
    gate_up = x @ w13.T + rel * (x.abs() @ w13.abs().T) * torch.randint(0, 2, (64, 48), dtype=F64).mul(2).sub(1)
    moved = F.silu(gate_up[:, :24]) * gate_up[:, 24:]
    torch.testing.assert_close(h, F.silu(x @ w13[:24].T) * (x @ w13[24:].T))
    assert ((moved - h).abs() <= h_error * (1 + 1e-5) + 1e-15).all()
    assert ((moved - h).abs() > 0.3 * h_error).float().mean() > 0.5  # a bound, not a loose one
    assert not oracle.silu_mul_with_error(x, w13, 0.0)[1].any()


def test_moe_rounding_slack_sums_each_pairs_flips_through_w2(monkeypatch: pytest.MonkeyPatch):
    """0 for unquantized experts; for block-FP8 ones, per token, routed_scaling_factor * sum over its pairs of
    |weight| * |W2_e| @ (the flip steps of the pair's h), here with every element of h given a step of 1."""
    torch.manual_seed(0)
    e, h, i = 3, 128, 128
    w13, w2 = torch.randn(e, 2 * i, h) / h**0.5, torch.randn(e, h, i) / i**0.5
    x = torch.randn(2, h)
    ids, weights = torch.tensor([[0, 2], [1, 0]]), torch.tensor([[0.5, -0.25], [1.0, 0.125]])
    assert not oracle.moe_with_rounding_slack(x, w13, w2, ids, weights, 2.5)[1].any()
    w13_q, s13 = (torch.stack(t) for t in zip(*(quantize_block_fp8(w) for w in w13), strict=True))
    w2_q, s2 = (torch.stack(t) for t in zip(*(quantize_block_fp8(w) for w in w2), strict=True))
    monkeypatch.setattr(oracle, "rounding_flip_steps", lambda hidden, error, group: torch.ones_like(hidden))
    _, slack = oracle.moe_with_rounding_slack(x, w13_q, w2_q, ids, weights, 2.5, s13, s2)
    column_sums = oracle.dequantize(w2_q, s2, (128, 128)).abs().sum(dim=2)  # [E, H]
    expected = 2.5 * torch.stack([0.5 * column_sums[0] + 0.25 * column_sums[2],
                                  column_sums[1] + 0.125 * column_sums[0]])
    torch.testing.assert_close(slack, expected)

