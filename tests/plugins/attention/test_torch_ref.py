"""The torch reference attention backend against oracles it did not write: torch's SDPA, explicit
logsumexp, the non-absorbed (de-compressed) MHA form of MLA, and one-shot versus chunked prefixes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from plugserve.core.batch_invariant import batch_invariant
from plugserve.core.dispatch import prepare_attention
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention.torch_ref import (
    TorchRefAttention,
    causal_mask,
    dense_attention,
    merge_attn_states,
    ragged_attention,
)
from plugserve.registry import Registry

CPU = torch.device("cpu")
ATOL, RTOL = 1e-5, 1e-4

# Small MLA shapes: heads, latent rank R, rope dim P, nope dim, value dim.
H, R, P, NOPE, V = 4, 32, 16, 24, 20
NUM_LAYERS = 2


def mla_spec(dtype: torch.dtype = torch.float32) -> AttentionSpec:
    return AttentionSpec(
        num_heads=H, kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=P, v_head_dim=V, dtype=dtype
    )


def expected_slot(block_table: torch.Tensor, b: int, pos: int, page_size: int) -> int:
    """Where position `pos` of request `b` lives, written out by hand (independent of token_slots)."""
    return int(block_table[b, pos // page_size]) * page_size + pos % page_size


def make_batch(
    mode: ForwardMode, seq_lens: list[int], extend_lens: list[int], page_size: int, gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> ForwardBatch:
    """A batch over a pool whose pages are handed out in shuffled order, so that position order and
    slot order differ. Unused block-table entries point past the pool, so reading one fails loudly."""
    pages_per_request = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_request) + 3
    pool = MLAKVPool(NUM_LAYERS, num_pages, page_size, R, P, dtype, "cpu")
    shuffled = torch.randperm(num_pages, generator=gen).tolist()
    block_table = torch.full((len(seq_lens), max(pages_per_request)), num_pages, dtype=torch.int32)
    for b, n in enumerate(pages_per_request):
        pages, shuffled = shuffled[:n], shuffled[n:]
        if pages == sorted(pages) and n > 1:  # chance alone may leave a request in page order
            pages[0], pages[1] = pages[1], pages[0]
        block_table[b, :n] = torch.tensor(pages, dtype=torch.int32)
    return ForwardBatch.build(mode, seq_lens, extend_lens, block_table, pool)


def fill_positions(batch: ForwardBatch, layer: int, latents: list[torch.Tensor], ropes: list[torch.Tensor],
                   upto: list[int]) -> None:
    """Write positions [0, upto[b]) of every request straight into the pool (the cached prefix)."""
    for b, n in enumerate(upto):
        slots = torch.tensor([expected_slot(batch.block_table, b, p, batch.kv_pool.page_size) for p in range(n)],
                             dtype=torch.int64)
        batch.kv_pool.write(layer, slots, latents[b][:n], ropes[b][:n])


def bottom_right_mask(q_len: int, kv_len: int) -> torch.Tensor:
    """SDPA's is_causal aligns top-left; new tokens are the last q_len keys, so shift the diagonal."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
         is_causal: bool = False) -> torch.Tensor:
    """q [n, H, D], k [m, H, D], v [m, H, Dv] -> [n, H, Dv] through torch's own SDPA."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=is_causal, scale=scale
    )
    return out.transpose(0, 1)


# ----------------------------------------------------------------------------------------------------
# 1. forward_mha against SDPA and an explicit logsumexp


@pytest.mark.parametrize("with_prefix", [False, True], ids=["no_prefix", "one_shot_prefix"])
def test_forward_mha_matches_sdpa(with_prefix: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, qk_dim, v_dim, sm_scale = 4, 192, 128, 0.07
    spec = AttentionSpec(num_heads=heads, kv_lora_rank=R, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=v_dim, dtype=torch.float32, sm_scale=sm_scale)
    extend_lens = [5, 1, 17]
    seq_lens = [9, 1, 30] if with_prefix else extend_lens
    # The threshold keeps small prefixes in one-shot MHA instead of absorbed MLA.
    batch = prepare_attention(make_batch(ForwardMode.EXTEND, seq_lens, extend_lens, 16, gen),
                              chunked_prefix_cache_threshold=1)
    assert batch.attn_method is AttnForwardMethod.MHA

    q = torch.randn(sum(extend_lens), heads, qk_dim, generator=gen)
    k = torch.randn(sum(seq_lens), heads, qk_dim, generator=gen)
    v = torch.randn(sum(seq_lens), heads, v_dim, generator=gen)
    backend = TorchRefAttention(spec, CPU)
    backend.plan(batch)
    out, lse = backend.forward_mha(q, k, v)
    assert out.shape == (sum(extend_lens), heads, v_dim) and out.dtype == torch.float32
    assert lse.shape == (sum(extend_lens), heads) and lse.dtype == torch.float32

    q0 = k0 = 0
    for n, m in zip(extend_lens, seq_lens, strict=True):
        qb, kb, vb = q[q0 : q0 + n], k[k0 : k0 + m], v[k0 : k0 + m]
        if n == m:
            want = sdpa(qb, kb, vb, sm_scale, is_causal=True)
        else:
            want = sdpa(qb, kb, vb, sm_scale, mask=bottom_right_mask(n, m))
        torch.testing.assert_close(out[q0 : q0 + n], want, atol=ATOL, rtol=RTOL)

        scores = torch.einsum("qhd,khd->qhk", qb, kb) * sm_scale
        scores = scores.masked_fill(~bottom_right_mask(n, m)[:, None, :], float("-inf"))
        torch.testing.assert_close(lse[q0 : q0 + n], torch.logsumexp(scores, dim=-1), atol=ATOL, rtol=RTOL)
        q0, k0 = q0 + n, k0 + m


def test_forward_mha_rejects_wrong_kv_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    batch = prepare_attention(make_batch(ForwardMode.EXTEND, [6, 4], [3, 4], 1, gen),
                              chunked_prefix_cache_threshold=1)
    backend = TorchRefAttention(mla_spec(), CPU)
    backend.plan(batch)
    q = torch.randn(7, H, NOPE + P)
    with pytest.raises(ValueError, match="10 rows"):
        # 7 rows are the new tokens only; one-shot MHA needs the whole sequences (10 rows).
        backend.forward_mha(q, torch.randn(7, H, NOPE + P), torch.randn(7, H, V))


def test_query_with_keys_all_masked_gets_zero_and_neg_inf() -> None:
    # kv_len < q_len: bottom-right alignment leaves the first new token with no visible key although
    # the request has keys, so the -inf row goes through the softmax (not around it, as with 0 keys).
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(3, 2, 8, generator=gen)
    k = torch.randn(2, 2, 8, generator=gen)
    v = torch.randn(2, 2, 5, generator=gen)
    out, lse = ragged_attention(q, k, v, [3], [2], 0.3, causal=True)
    assert not torch.isnan(out).any()
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    want = sdpa(q[1:], k, v, 0.3, is_causal=True)  # rows 1, 2 see keys [0] and [0, 1]: top-left here
    torch.testing.assert_close(out[1:], want, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------------------------------
# 2. Absorbed MLA (forward_mla) == non-absorbed MHA over de-compressed K/V


MLA_CASES = {
    "decode": (ForwardMode.DECODE, [1, 7, 33, 18], [1, 1, 1, 1]),
    "target_verify": (ForwardMode.TARGET_VERIFY, [3, 9, 40], [3, 3, 3]),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [5, 21], [2, 4]),
    "extend_prefix": (ForwardMode.EXTEND, [20, 37, 5], [6, 37, 2]),
}


# Not named `page_size`: the conformance kit's pytest plugin parametrizes every argument of that name.
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_absorbed_mla_equals_decompressed_mha(case: str, page: int) -> None:
    mode, seq_lens, extend_lens = MLA_CASES[case]
    gen = torch.Generator().manual_seed(10 * list(MLA_CASES).index(case) + page)
    batch = make_batch(mode, seq_lens, extend_lens, page, gen)
    spec = mla_spec()
    layer = 1

    # Per request, the whole sequence's latent and rope key, in position order.
    latents = [torch.randn(s, R, generator=gen) for s in seq_lens]
    ropes = [torch.randn(s, P, generator=gen) for s in seq_lens]
    prefix_lens = [s - e for s, e in zip(seq_lens, extend_lens, strict=True)]
    fill_positions(batch, layer, latents, ropes, prefix_lens)
    # Layer 0 holds other values: reading the wrong layer would show.
    fill_positions(batch, 0, [torch.randn(s, R) for s in seq_lens], [torch.randn(s, P) for s in seq_lens], seq_lens)

    w_uk = torch.randn(H, R, NOPE, generator=gen) / math.sqrt(R)
    w_uv = torch.randn(H, R, V, generator=gen) / math.sqrt(R)
    q_nope_raw = torch.randn(batch.num_tokens, H, NOPE, generator=gen)
    q_rope = torch.randn(batch.num_tokens, H, P, generator=gen)

    backend = TorchRefAttention(spec, CPU)
    backend.plan(batch)
    new_latent = torch.cat([lat[p:] for lat, p in zip(latents, prefix_lens, strict=True)])
    new_rope = torch.cat([rope[p:] for rope, p in zip(ropes, prefix_lens, strict=True)])
    backend.set_kv(layer, batch.out_cache_loc, new_latent, new_rope)

    q_absorbed = torch.einsum("thn,hrn->thr", q_nope_raw, w_uk)
    out_latent = backend.forward_mla(q_absorbed, q_rope, layer)
    assert out_latent.shape == (batch.num_tokens, H, R) and out_latent.dtype == torch.float32
    out = torch.einsum("thr,hrv->thv", out_latent, w_uv)

    q0 = 0
    for b, (s, e) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        k_nope = torch.einsum("sr,hrn->shn", latents[b], w_uk)
        k = torch.cat([k_nope, ropes[b][:, None, :].expand(s, H, P)], dim=-1)
        v = torch.einsum("sr,hrv->shv", latents[b], w_uv)
        q = torch.cat([q_nope_raw[q0 : q0 + e], q_rope[q0 : q0 + e]], dim=-1)
        want = sdpa(q, k, v, spec.softmax_scale, mask=bottom_right_mask(e, s))
        torch.testing.assert_close(out[q0 : q0 + e], want, atol=ATOL, rtol=RTOL)
        q0 += e


def test_forward_mla_bf16_returns_bf16() -> None:
    seq_lens = [4, 11]
    # Values exactly representable in bf16, so the float32 run sees the very same cache and queries.
    gen = torch.Generator().manual_seed(2)
    latents = [torch.randn(s, R, generator=gen).bfloat16().float() for s in seq_lens]
    ropes = [torch.randn(s, P, generator=gen).bfloat16().float() for s in seq_lens]
    q_nope = torch.randn(2, H, R, generator=gen).bfloat16()
    q_rope = torch.randn(2, H, P, generator=gen).bfloat16()
    outs = {}
    for dtype in (torch.bfloat16, torch.float32):
        batch = make_batch(ForwardMode.DECODE, seq_lens, [1, 1], 16, torch.Generator().manual_seed(7), dtype=dtype)
        fill_positions(batch, 0, latents, ropes, seq_lens)
        backend = TorchRefAttention(mla_spec(dtype), CPU)
        backend.plan(batch)
        outs[dtype] = backend.forward_mla(q_nope.to(dtype), q_rope.to(dtype), 0)
    assert outs[torch.bfloat16].dtype == torch.bfloat16
    # Only the final rounding to bf16 differs: the math runs in float32 either way.
    torch.testing.assert_close(outs[torch.bfloat16], outs[torch.float32].bfloat16(), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------
# 3. MHA_CHUNKED_KV (new tokens causally + prefix chunks, merged) == one-shot MHA


def test_chunked_prefix_equals_one_shot() -> None:
    gen = torch.Generator().manual_seed(3)
    seq_lens, extend_lens = [30, 12, 25], [5, 12, 7]  # request 1 has an empty prefix
    prefix_lens = [s - e for s, e in zip(seq_lens, extend_lens, strict=True)]
    layer = 0
    spec = mla_spec()
    chunked = prepare_attention(make_batch(ForwardMode.EXTEND, seq_lens, extend_lens, 4, gen),
                                chunked_prefix_cache_threshold=1, prefix_chunk_capacity=16)
    assert chunked.attn_method is AttnForwardMethod.MHA_CHUNKED_KV
    assert len(chunked.prefix_chunks) >= 3

    # The cache holds every position; prefix K/V come from the pool through each chunk's slots and
    # are de-compressed the way a model's kv_b_proj would.
    latents = [torch.randn(s, R, generator=gen) for s in seq_lens]
    ropes = [torch.randn(s, P, generator=gen) for s in seq_lens]
    fill_positions(chunked, layer, latents, ropes, seq_lens)
    w_uk = torch.randn(H, R, NOPE, generator=gen) / math.sqrt(R)
    w_uv = torch.randn(H, R, V, generator=gen) / math.sqrt(R)

    def decompress(latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_nope = torch.einsum("sr,hrn->shn", latent, w_uk)
        k = torch.cat([k_nope, rope[:, None, :].expand(-1, H, P)], dim=-1)
        return k, torch.einsum("sr,hrv->shv", latent, w_uv)

    q = torch.randn(chunked.num_tokens, H, NOPE + P, generator=gen)
    backend = TorchRefAttention(spec, CPU)
    backend.plan(chunked)

    k_new, v_new = decompress(torch.cat([lat[p:] for lat, p in zip(latents, prefix_lens, strict=True)]),
                              torch.cat([rope[p:] for rope, p in zip(ropes, prefix_lens, strict=True)]))
    out, lse = backend.forward_mha(q, k_new, v_new)
    for i, chunk in enumerate(chunked.prefix_chunks):
        rows = chunked.kv_pool.gather(layer, chunk.slots)
        k_chunk, v_chunk = decompress(rows[:, :R], rows[:, R:])
        out_chunk, lse_chunk = backend.forward_mha(q, k_chunk, v_chunk, prefix_chunk=i)
        # Request 1 has no prefix: its tokens see no key of any chunk.
        req1 = slice(extend_lens[0], extend_lens[0] + extend_lens[1])
        assert chunk.lens_cpu[1] == 0
        assert torch.all(out_chunk[req1] == 0) and torch.all(torch.isneginf(lse_chunk[req1]))
        out, lse = backend.merge_attn_states(out, lse, out_chunk, lse_chunk)

    one_shot = prepare_attention(
        ForwardBatch.build(ForwardMode.EXTEND, seq_lens, extend_lens, chunked.block_table, chunked.kv_pool),
        chunked_prefix_cache_threshold=1,
    )
    assert one_shot.attn_method is AttnForwardMethod.MHA
    backend.plan(one_shot)
    k_all, v_all = decompress(torch.cat(latents), torch.cat(ropes))
    want_out, want_lse = backend.forward_mha(q, k_all, v_all)
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, want_lse, atol=ATOL, rtol=RTOL)
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------------------
# 4. merge_attn_states


def test_merge_attn_states_matches_attention_over_union_and_handles_empty_sides() -> None:
    gen = torch.Generator().manual_seed(4)
    tokens, heads, dim, keys_a, keys_b = 6, 3, 8, 5, 7
    scores_a = torch.randn(tokens, heads, keys_a, generator=gen)
    scores_b = torch.randn(tokens, heads, keys_b, generator=gen)
    v_a = torch.randn(keys_a, dim, generator=gen)
    v_b = torch.randn(keys_b, dim, generator=gen)
    out_a, lse_a = torch.softmax(scores_a, -1) @ v_a, torch.logsumexp(scores_a, -1)
    out_b, lse_b = torch.softmax(scores_b, -1) @ v_b, torch.logsumexp(scores_b, -1)
    union = torch.softmax(torch.cat([scores_a, scores_b], -1), -1) @ torch.cat([v_a, v_b])
    union_lse = torch.logsumexp(torch.cat([scores_a, scores_b], -1), -1)

    # Token 1: side a saw no key; token 2: side b; token 3: neither. Their outs are garbage (NaN).
    for side_out, side_lse, rows in ((out_a, lse_a, [1, 3]), (out_b, lse_b, [2, 3])):
        side_lse[rows] = float("-inf")
        side_out[rows] = float("nan")

    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    full = [0, 4, 5]
    torch.testing.assert_close(out[full], union[full], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse[full], union_lse[full], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[1], out_b[1])
    torch.testing.assert_close(lse[1], lse_b[1])
    torch.testing.assert_close(out[2], out_a[2])
    torch.testing.assert_close(lse[2], lse_a[2])
    assert torch.all(out[3] == 0) and torch.all(torch.isneginf(lse[3]))

    # Symmetric, and merging with an empty side is the identity.
    swapped_out, swapped_lse = merge_attn_states(out_b, lse_b, out_a, lse_a)
    torch.testing.assert_close(swapped_out, out)
    torch.testing.assert_close(swapped_lse, lse)
    empty_out, empty_lse = torch.zeros_like(union), torch.full_like(union_lse, float("-inf"))
    same_out, same_lse = merge_attn_states(union, union_lse, empty_out, empty_lse)
    torch.testing.assert_close(same_out, union)
    torch.testing.assert_close(same_lse, union_lse)


# ----------------------------------------------------------------------------------------------------
# 5. set_kv, and the plugin hook


@pytest.mark.parametrize("page", [1, 16])
def test_set_kv_writes_at_the_slots_of_the_new_positions(page: int) -> None:
    gen = torch.Generator().manual_seed(5)
    seq_lens, extend_lens = [9, 20, 3], [2, 20, 1]
    batch = make_batch(ForwardMode.EXTEND, seq_lens, extend_lens, page, gen)
    backend = TorchRefAttention(mla_spec(), CPU)
    backend.plan(batch)
    latent = torch.randn(batch.num_tokens, R, generator=gen)
    rope = torch.randn(batch.num_tokens, P, generator=gen)
    backend.set_kv(1, batch.out_cache_loc, latent, rope)

    want_slots = [
        expected_slot(batch.block_table, b, pos, page)
        for b, (s, e) in enumerate(zip(seq_lens, extend_lens, strict=True))
        for pos in range(s - e, s)
    ]
    assert batch.out_cache_loc.tolist() == want_slots
    rows = batch.kv_pool.gather(1, torch.tensor(want_slots))
    torch.testing.assert_close(rows[:, :R], latent, atol=0, rtol=0)
    torch.testing.assert_close(rows[:, R:], rope, atol=0, rtol=0)
    # Nothing else was touched: no other slot of layer 1, nothing of layer 0.
    assert int(batch.kv_pool.buffer(1).abs().sum(-1).ne(0).sum()) == batch.num_tokens
    assert not batch.kv_pool.buffer(0).any()


def test_registry_finds_the_backend() -> None:
    registry = Registry(builtin=["plugserve.plugins.attention.torch_ref"], entry_points=False)
    assert registry.backends["attention"]["torch_ref"].cls is TorchRefAttention
    assert not registry.broken


def test_key_tiled_attention_gives_a_query_the_same_bits_whatever_the_call_holds():
    """Under batch_invariant (deterministic inference) a query's out and lse do not depend on how many keys past its
    own the call holds (a whole prefill, a chunk, decoding) nor on the queries beside it; and they match SDPA."""
    torch.manual_seed(0)
    keys, n, sm_scale = 150, 20, 0.3  # three key tiles, the last one partial
    q, k, v = torch.randn(keys, H, 8), torch.randn(keys, 1, 8), torch.randn(keys, 1, 6)
    with torch.inference_mode(), batch_invariant():
        # The last n tokens as one prefill over all keys, and each alone over only the keys it sees.
        out, lse = dense_attention(q[-n:], k, v, sm_scale, causal=True)
        for i in range(n):
            seen = keys - n + i + 1
            out_i, lse_i = dense_attention(q[seen - 1 : seen], k[:seen], v[:seen], sm_scale, causal=True)
            assert torch.equal(out_i[0], out[i]) and torch.equal(lse_i[0], lse[i])
    expected = F.scaled_dot_product_attention(
        q[-n:].transpose(0, 1), k.expand(-1, H, -1).transpose(0, 1), v.expand(-1, H, -1).transpose(0, 1),
        attn_mask=causal_mask(n, keys), scale=sm_scale).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    scores = torch.einsum("qhd,khd->hqk", q[-n:].double(), k.double()) * sm_scale
    expected_lse = scores.masked_fill(~causal_mask(n, keys), float("-inf")).logsumexp(-1).transpose(0, 1)
    torch.testing.assert_close(lse.double(), expected_lse, atol=ATOL, rtol=RTOL)
