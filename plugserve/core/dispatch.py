"""How each batch runs MLA: MHA over de-compressed K/V, MHA with the prefix in chunks, or absorbed MLA.

The rule (SGLang's, for DeepSeek-V3): with no cached prefix, prefill is plain MHA on the
new tokens, which is cheaper than MQA over 576-wide latents. With a long cached prefix, re-expanding
the prefix through kv_b_proj pays off too, so MHA stays, one shot when everything fits one chunk of
de-compressed K/V, otherwise chunk by chunk merged by log-sum-exp. With a short prefix, absorbed MLA
over the paged latent cache wins. Every mode over the paged cache but EXTEND is absorbed MLA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plugserve.core import forward_batch as fb
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import sequence_slots, token_slots
from plugserve.core.moved import moved_names

DEFAULT_CHUNKED_PREFIX_CACHE_THRESHOLD = 8192
# Tokens of de-compressed prefix K/V held at once: 16384 x 128 heads x (192 + 128) x 2 bytes = 1.3 GB.
DEFAULT_PREFIX_CHUNK_CAPACITY = 16384


def choose_attn_forward_method(
    mode: ForwardMode,
    prefix_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    chunked_prefix_cache_threshold: int = DEFAULT_CHUNKED_PREFIX_CACHE_THRESHOLD,
    prefix_chunk_capacity: int = DEFAULT_PREFIX_CHUNK_CAPACITY,
    prefill_supports_mla: bool = True,
    deterministic: bool = False,
) -> tuple[fb.AttnForwardMethod, str]:
    """The method for one batch and why. `prefill_supports_mla=False` (an MHA-only prefill backend)
    sends short-prefix batches through MHA as well. `deterministic`: absorbed MLA for every batch, so that a token
    runs the same arithmetic cold, after a cached prefix, in a chunk or decoding."""
    if mode is not ForwardMode.EXTEND:
        return fb.AttnForwardMethod.MLA, f"{mode.name} always runs absorbed MLA over the paged cache"
    if deterministic:
        if not prefill_supports_mla:
            raise ValueError("deterministic inference runs prefill as absorbed MLA: the prefill backend has none")
        return fb.AttnForwardMethod.MLA, "deterministic inference: one path for every prefill"
    prefix_sum = sum(prefix_lens)
    if prefix_sum == 0:
        return fb.AttnForwardMethod.MHA, "no cached prefix"
    if prefix_sum < chunked_prefix_cache_threshold and prefill_supports_mla:
        return (
            fb.AttnForwardMethod.MLA,
            f"cached prefix {prefix_sum} < --chunked-prefix-cache-threshold {chunked_prefix_cache_threshold}",
        )
    why = (
        f"cached prefix {prefix_sum} >= --chunked-prefix-cache-threshold {chunked_prefix_cache_threshold}"
        if prefill_supports_mla
        else "the prefill backend has no absorbed MLA"
    )
    if sum(seq_lens) <= prefix_chunk_capacity:
        return fb.AttnForwardMethod.MHA, f"{why}; all {sum(seq_lens)} tokens fit one chunk"
    chunked = fb.AttnForwardMethod.MHA_CHUNKED_KV
    return chunked, f"{why}; {sum(seq_lens)} tokens > chunk capacity {prefix_chunk_capacity}"


def plan_prefix_chunks(batch: ForwardBatch, prefix_chunk_capacity: int) -> list[fb.PrefixChunk]:
    """Split every request's cached prefix into position windows holding at most
    `prefix_chunk_capacity` tokens in all (each request gets an equal share of a chunk)."""
    prefix_lens = batch.prefix_lens_cpu
    with_prefix = sum(1 for p in prefix_lens if p > 0)
    if with_prefix == 0:
        return []
    window = max(1, prefix_chunk_capacity // with_prefix)
    device = batch.block_table.device
    chunks = []
    for start in range(0, max(prefix_lens), window):
        lens = [max(0, min(window, p - start)) for p in prefix_lens]
        starts = [start] * len(prefix_lens)
        req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
        pos = torch.cat([torch.arange(start, start + n) for n in lens]).to(device)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        slots = token_slots(batch.block_table, req, pos, batch.kv_pool.page_size)
        chunks.append(fb.PrefixChunk(starts, lens, cu.to(device), slots))
    return chunks


def prepare_attention(
    batch: ForwardBatch,
    *,
    chunked_prefix_cache_threshold: int = DEFAULT_CHUNKED_PREFIX_CACHE_THRESHOLD,
    prefix_chunk_capacity: int = DEFAULT_PREFIX_CHUNK_CAPACITY,
    prefill_supports_mla: bool = True,
    deterministic: bool = False,
) -> ForwardBatch:
    """Fill `batch.attn_method` (and `batch.prefix_chunks` for MHA_CHUNKED_KV) before backends plan."""
    method, _ = choose_attn_forward_method(
        batch.mode,
        batch.prefix_lens_cpu,
        batch.seq_lens_cpu,
        chunked_prefix_cache_threshold=chunked_prefix_cache_threshold,
        prefix_chunk_capacity=prefix_chunk_capacity,
        prefill_supports_mla=prefill_supports_mla,
        deterministic=deterministic,
    )
    batch.attn_method = method
    batch.prefix_chunks = (
        plan_prefix_chunks(batch, prefix_chunk_capacity) if method is fb.AttnForwardMethod.MHA_CHUNKED_KV else []
    )
    has_prefix = any(batch.prefix_lens_cpu)
    batch.sequence_slots = (
        sequence_slots(batch.block_table, batch.seq_lens_cpu, batch.kv_pool.page_size)
        if method is fb.AttnForwardMethod.MHA and has_prefix
        else None
    )
    return batch

__getattr__ = moved_names(__name__)
