"""The libraries behind the fa3 / fa3_mla backends, called directly on the inputs those backends get,
so that the shootout can measure what plugserve's wrapper costs. GPU only (imports the libraries)."""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import flash_attn_interface as fa3  # FlashAttention-3; the fa3 backend prefers it when installed
except ImportError:
    fa3 = None


def mha_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_kv: torch.Tensor,
    max_q: int, max_kv: int, sm_scale: float, causal: bool,
) -> Callable[[], torch.Tensor]:
    """Varlen forward with the log-sum-exp, as fa3's forward_mha runs it: q [T, H, 192], k [Tk, H, 192],
    v [Tk, H, 128], cu_q / cu_kv [B+1] int32 -> out [T, H, 128]. FA3 when installed, else flash_attn.cute."""
    if fa3 is not None:
        return lambda: fa3.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv, max_seqlen_q=max_q, max_seqlen_k=max_kv,
            softmax_scale=sm_scale, causal=causal, return_attn_probs=True,
        )[0]
    from flash_attn.cute import flash_attn_varlen_func

    return lambda: flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv, max_seqlen_q=max_q, max_seqlen_k=max_kv,
        softmax_scale=sm_scale, causal=causal, return_lse=True,
    )[0]


def mla_decode(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv_buffer: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, page_size: int, sm_scale: float,
) -> Callable[[], torch.Tensor]:
    """FA3's flash_attn_with_kvcache with qv, as fa3_mla's forward_mla runs it (needs flash_attn_interface):
    q_nope [B, H, R], q_rope [B, H, P], kv_buffer [num_slots, R + P], block_table [B, max_pages] int32,
    seq_lens [B] int32 -> out [B, H, R]. One query per request, passed varlen like the backend does."""
    if fa3 is None:
        raise ImportError("flash_attn_interface (FlashAttention-3) is not installed")
    rank = q_nope.shape[2]
    paged = kv_buffer.view(-1, page_size, kv_buffer.shape[1])
    k_rope, latent = paged[:, :, rank:].unsqueeze(2), paged[:, :, :rank].unsqueeze(2)
    cu_q = torch.arange(q_nope.shape[0] + 1, dtype=torch.int32, device=q_nope.device)
    return lambda: fa3.flash_attn_with_kvcache(
        q_rope, k_rope, latent, qv=q_nope, page_table=block_table, cache_seqlens=seq_lens, cu_seqlens_q=cu_q,
        max_seqlen_q=1, softmax_scale=sm_scale, causal=True,
    )
