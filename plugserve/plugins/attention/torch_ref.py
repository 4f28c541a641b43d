"""The torch reference attention backend: plain torch for every method,
itself checked against the kit's float64 oracle (plugserve/conformance/oracle.py).

Plain eager PyTorch, one request at a time, all math in float32. It is slow on purpose: each step is
the textbook formula, so that a mismatch with a fast kernel points at the kernel. The math lives in
module-level functions that tests and other backends may reuse:

    dense_attention          one request, MHA or MQA, optionally causal -> (out, lse) float32
    ragged_attention         many requests packed request-major (varlen), as the backends take them
    mla_attention_reference  absorbed MLA: MQA over latent ++ rope keys with the latent as values
    merge_attn_states        log-sum-exp merge of attention over two disjoint key sets

Causality is bottom-right aligned (the new tokens are the last q_len of kv_len keys), and a query
that sees no key gets out = 0 and lse = -inf, as `AttentionBackend` specifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from plugserve.core import batch_invariant
from plugserve.core.batch_invariant import KEY_TILE
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch
from plugserve.core.interfaces import AttentionBackend, AttentionCapabilities
from plugserve.core.kv_cache import sequence_slots
from plugserve.registry import hookimpl

NEG_INF = float("-inf")

# ----------------------------------------------------------------------------------------------------
# The math


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[q_len, kv_len] bool, True where new token i may see key j: j <= kv_len - q_len + i.

    Bottom-right alignment: the q_len queries are the last q_len positions of the kv_len keys. When
    kv_len < q_len the first queries see nothing (a whole row of False)."""
    i = torch.arange(q_len, device=device).unsqueeze(1)
    j = torch.arange(kv_len, device=device).unsqueeze(0)
    return j <= kv_len - q_len + i


def _zero_where_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    # Shifting by -inf would turn exp(-inf - (-inf)) into NaN; shifting those rows by 0 keeps every
    # weight of a query that sees no key at exp(-inf) = 0 instead.
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def tree_visible(tree_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[n, kv_len] bool of a request whose last n keys are draft-tree nodes (tree_mask [n, n] bool: node i sees
    node j): every node sees the kv_len - n keys before the tree, and its ancestors and itself in it."""
    n = tree_mask.shape[0]
    return torch.cat([tree_mask.new_ones(n, kv_len - n), tree_mask], dim=1)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one request, in float32.

    q [n, H, Dqk]; k [m, Hk, Dqk]; v [m, Hk, Dv], any float dtype, with Hk = H (MHA) or Hk = 1 (MQA:
    one key/value head shared by all query heads, broadcast without copying). visible [n, m] bool, when
    given, replaces the causal mask.
    Returns out [n, H, Dv] float32 and lse [n, H] float32 (natural log of the sum of exp(scores));
    a query with no visible key gets out = 0, lse = -inf. Under `batch_invariant` the keys are reduced in tiles
    at absolute key positions (`key_tiled_attention`).
    """
    if batch_invariant.active():
        if visible is None:
            visible = causal_mask(q.shape[0], k.shape[0], q.device) if causal else q.new_ones(q.shape[0], k.shape[0],
                                                                                              dtype=torch.bool)
        return key_tiled_attention(q, k, v, sm_scale, visible)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * sm_scale  # [H, n, m]
    if visible is not None:
        scores = scores.masked_fill(~visible, NEG_INF)
    elif causal:
        scores = scores.masked_fill(~causal_mask(q.shape[0], k.shape[0], q.device), NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]; -inf for rows with no visible key (and m = 0)
    probs = torch.exp(scores - _zero_where_neg_inf(lse).unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", probs, v.float())
    return out, lse.transpose(0, 1)


def key_tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, visible: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`dense_attention` with every sum over keys taken KEY_TILE keys at a time from key 0, tile after tile: a
    query's result is the same whatever number of keys (visible to it or not) the call holds, so a token computes
    the same values in a whole prefill, a chunk of one, after a cached prefix, or decoding. Shapes as
    `dense_attention`'s, visible [n, m] bool."""
    n, m = q.shape[0], k.shape[0]
    padded = -(-m // KEY_TILE) * KEY_TILE
    k = torch.cat([k.float(), k.new_zeros(padded - m, *k.shape[1:], dtype=torch.float32)])
    v = torch.cat([v.float(), v.new_zeros(padded - m, *v.shape[1:], dtype=torch.float32)])
    visible = torch.cat([visible, visible.new_zeros(n, padded - m)], dim=1)
    tiles = range(0, padded, KEY_TILE)
    scores = [torch.einsum("qhd,khd->hqk", q.float(), k[t : t + KEY_TILE]).mul_(sm_scale)
              .masked_fill_(~visible[:, t : t + KEY_TILE], NEG_INF) for t in tiles]  # each [H, n, KEY_TILE]
    top = _zero_where_neg_inf(torch.stack([s.amax(dim=-1) for s in scores]).amax(dim=0)).unsqueeze(-1)  # [H, n, 1]
    total = torch.zeros_like(top)
    out = torch.zeros(q.shape[1], n, v.shape[2], dtype=torch.float32, device=q.device)  # [H, n, Dv]
    for t, s in zip(tiles, scores, strict=True):
        probs = torch.exp(s - top)
        total += probs.sum(dim=-1, keepdim=True)
        out += torch.einsum("hqk,khd->hqd", probs, v[t : t + KEY_TILE])
    lse = (top + torch.log(total)).squeeze(-1)  # [H, n]; -inf where nothing is visible
    out = torch.where(total > 0, out / total, 0.0)
    return out.transpose(0, 1), lse.transpose(0, 1)


def _offsets(lens: Sequence[int]) -> list[int]:
    """Exclusive prefix sum [0, l0, l0 + l1, ...] as Python ints (no device sync)."""
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    return offsets


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    sm_scale: float,
    causal: bool,
    tree_masks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention over requests packed request-major.

    q [sum(q_lens), H, Dqk]; k [sum(kv_lens), Hk, Dqk]; v [sum(kv_lens), Hk, Dv] with Hk = H or 1.
    Request b's queries are q rows [sum(q_lens[:b]), +q_lens[b]) and attend only to its own keys,
    k/v rows [sum(kv_lens[:b]), +kv_lens[b]); causal masks bottom-right (see `causal_mask`). tree_masks
    [B, n, n] bool, when given, makes every request's n queries draft-tree nodes instead (see `tree_visible`).
    Returns out [sum(q_lens), H, Dv] in q's dtype and lse [sum(q_lens), H] float32.
    Raises ValueError when the shapes disagree with the lengths.
    """
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"q_lens has {len(q_lens)} requests but kv_lens has {len(kv_lens)}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    q_off, kv_off = _offsets(q_lens), _offsets(kv_lens)
    if q.shape[0] != q_off[-1]:
        raise ValueError(f"q has {q.shape[0]} rows but the query lengths {list(q_lens)} sum to {q_off[-1]}")
    if k.shape[0] != kv_off[-1] or v.shape[0] != kv_off[-1]:
        raise ValueError(f"k has {k.shape[0]} rows and v {v.shape[0]}, but the key lengths {list(kv_lens)} "
                         f"sum to {kv_off[-1]}")
    num_heads = q.shape[1]
    if k.shape[1] not in (1, num_heads) or v.shape[1] != k.shape[1]:
        raise ValueError(f"k and v need the same head count, 1 or q's {num_heads}; got {k.shape[1]} and "
                         f"{v.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")

    # Rows of requests that are never written (no queries) or see no key keep out = 0, lse = -inf.
    out = torch.zeros(q.shape[0], num_heads, v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], num_heads), NEG_INF, dtype=torch.float32, device=q.device)
    for b in range(len(q_lens)):
        qs, ks = slice(q_off[b], q_off[b + 1]), slice(kv_off[b], kv_off[b + 1])
        visible = None if tree_masks is None else tree_visible(tree_masks[b], kv_lens[b])
        out[qs], lse[qs] = dense_attention(q[qs], k[ks], v[ks], sm_scale, causal, visible)
    return out.to(q.dtype), lse


def mla_attention_reference(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    sm_scale: float,
    causal: bool = True,
    tree_masks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA over contiguous per-request keys.

    q_nope [T, H, R] (already multiplied by W_UK), q_rope [T, H, P]; latent [Tk, R], k_rope [Tk, P]
    with T = sum(q_lens), Tk = sum(kv_lens), request-major. Each head scores
    (q_nope . latent + q_rope . k_rope) * sm_scale and averages the latent: MQA with keys
    latent ++ k_rope and values latent, one KV head shared by all query heads; tree_masks as
    `ragged_attention` takes them. Returns out [T, H, R] in q_nope's dtype and lse [T, H] float32.
    """
    if latent.dim() != 2 or k_rope.dim() != 2 or latent.shape[0] != k_rope.shape[0]:
        raise ValueError(f"latent [Tk, R] and k_rope [Tk, P] must have the same rows, got {tuple(latent.shape)} "
                         f"and {tuple(k_rope.shape)}")
    if q_nope.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} and q_rope {tuple(q_rope.shape)} differ in tokens or heads")
    # (q_nope ++ q_rope) . (latent ++ k_rope) is exactly the sum of the two dot products.
    q = torch.cat([q_nope.float(), q_rope.float()], dim=-1)
    k = torch.cat([latent.float(), k_rope.float()], dim=-1).unsqueeze(1)  # [Tk, 1, R + P]
    out, lse = ragged_attention(q, k, latent.unsqueeze(1), q_lens, kv_lens, sm_scale, causal, tree_masks)
    return out.to(q_nope.dtype), lse


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the attention over each.

    out_* [T, H, D], lse_* [T, H] float32. lse = log(exp(lse_a) + exp(lse_b)) and
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b, in float32.
    A side with lse = -inf (no key) contributes nothing, whatever its out holds (even NaN);
    both -inf gives out = 0, lse = -inf. Returns out in out_a's dtype and lse float32.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:2]:
        raise ValueError(f"cannot merge out {tuple(out_a.shape)} / lse {tuple(lse_a.shape)} with out "
                         f"{tuple(out_b.shape)} / lse {tuple(lse_b.shape)}")
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    shift = _zero_where_neg_inf(lse)

    def weighted(out: torch.Tensor, side_lse: torch.Tensor) -> torch.Tensor:
        weight = torch.exp(side_lse - shift).unsqueeze(-1)
        # 0 * NaN is NaN: an empty side's out is unspecified in some kernels, so drop it explicitly.
        return torch.where(torch.isneginf(side_lse).unsqueeze(-1), 0.0, weight * out.float())

    out = weighted(out_a, lse_a) + weighted(out_b, lse_b)
    return out.to(out_a.dtype), lse


# ----------------------------------------------------------------------------------------------------
# The backend


@dataclass(frozen=True)
class TorchRefPlan:
    """kv_slots [sum(seq_lens)] int64: the pool slots of every request's cached keys, request-major."""

    kv_slots: torch.Tensor


class TorchRefAttention(AttentionBackend):
    """Reference MLA attention: every method and forward mode, any head dims and page size, CPU or CUDA.

    Computes in float32 (the KV cache, of any dtype, read as `MLAKVPool.read` dequantizes it); outputs in q's
    dtype, lse float32. The slowest backend everywhere but the only one on the CPU."""

    name: ClassVar[str] = "torch_ref"
    verified: ClassVar[str] = "cpu"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        devices=frozenset({"cpu", "cuda"}),
        # Any KV cache dtype: the rows are upcast to float32 (fp8 ones times the pool's scale) before the math.
        kv_cache_dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn}),
        tree_verify=True,
        batch_invariant=True,  # fixed row blocks and key tiles (core/batch_invariant.py) under the spec's flag
    )
    priority: ClassVar[dict[str, int]] = {"default": 0, "cpu": 10}
    plan_state: TorchRefPlan

    def plan(self, batch: ForwardBatch) -> None:
        """Keep the batch and the slots of every request's cached keys, which all layers share."""
        super().plan(batch)
        self.plan_state = TorchRefPlan(sequence_slots(batch.block_table, batch.seq_lens_cpu, batch.kv_pool.page_size))

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q_nope [T, H, R], q_rope [T, H, P] -> [T, H, R] in q_nope's dtype, attending causally to
        positions 0..seq_len-1 of each request's paged cache (the new tokens included), or through the
        batch's draft-tree mask."""
        batch = self.batch
        pool = batch.kv_pool
        self.check_mla_inputs(q_nope, q_rope)
        rows = pool.read(layer_id, self.plan_state.kv_slots, torch.float32)  # [sum(seq_lens), R + P]
        latent, k_rope = rows[:, : pool.kv_lora_rank], rows[:, pool.kv_lora_rank :]
        with batch_invariant.batch_invariant(self.spec.batch_invariant):
            out, _ = mla_attention_reference(
                q_nope, q_rope, latent, k_rope, batch.extend_lens_cpu, batch.seq_lens_cpu, self.spec.softmax_scale,
                tree_masks=None if batch.tree is None else batch.tree.mask,
            )
        return out

    def _mha_kv_lens(self, batch: ForwardBatch, prefix_chunk: int | None) -> tuple[list[int], bool, str]:
        """Per-request key counts of this forward_mha call, whether it is causal, and what k/v hold."""
        if prefix_chunk is not None:
            if not 0 <= prefix_chunk < len(batch.prefix_chunks):
                raise ValueError(f"prefix_chunk {prefix_chunk} out of range: the batch has "
                                 f"{len(batch.prefix_chunks)} prefix chunks")
            return batch.prefix_chunks[prefix_chunk].lens_cpu, False, f"prefix chunk {prefix_chunk}"
        if batch.attn_method is AttnForwardMethod.MHA_CHUNKED_KV:
            return batch.extend_lens_cpu, True, "the new tokens (MHA_CHUNKED_KV: extend_lens)"
        if batch.attn_method is AttnForwardMethod.MLA:
            raise ValueError("forward_mha called on a batch planned for absorbed MLA (batch.attn_method is MLA)")
        # MHA, or a batch prepare_attention never saw: k/v hold whole sequences, prefix included.
        return batch.seq_lens_cpu, True, "whole sequences (MHA: seq_lens)"

    def forward_mha(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged MHA: q [T, H, Dqk]; k [Tk, H, Dqk], v [Tk, H, Dv] -> out [T, H, Dv] in q's dtype,
        lse [T, H] float32. Tk is sum(seq_lens) (MHA), sum(extend_lens) (MHA_CHUNKED_KV, causal part)
        or the chunk's total (prefix_chunk i, non-causal)."""
        batch = self.batch
        kv_lens, causal, what = self._mha_kv_lens(batch, prefix_chunk)
        total = sum(kv_lens)
        if k.shape[0] != total or v.shape[0] != total:
            raise ValueError(f"forward_mha over {what}: k/v must have {total} rows ({kv_lens}), got "
                             f"k {tuple(k.shape)} and v {tuple(v.shape)}")
        if q.shape[0] != batch.num_tokens:
            raise ValueError(f"forward_mha: q must have {batch.num_tokens} rows (the new tokens), got {tuple(q.shape)}")
        with batch_invariant.batch_invariant(self.spec.batch_invariant):
            return ragged_attention(q, k, v, batch.extend_lens_cpu, kv_lens, self.spec.softmax_scale, causal)

    def merge_attn_states(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See the module-level `merge_attn_states`."""
        return merge_attn_states(out_a, lse_a, out_b, lse_b)


@hookimpl
def plugserve_backends() -> list[type[AttentionBackend]]:
    return [TorchRefAttention]
