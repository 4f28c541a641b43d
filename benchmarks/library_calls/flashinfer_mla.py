"""FlashInfer called directly on the inputs the flashinfer_mla backend gets, so that the shootout can
measure what plugserve's wrapper costs. GPU only (imports flashinfer). Planning happens here, once;
the returned callables only run the planned wrapper, as the backend's forward_* do."""

from __future__ import annotations

from collections.abc import Callable

import flashinfer
import torch


def _kernel(device: torch.device) -> str:
    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"


def _workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(128 << 20, dtype=torch.uint8, device=device)


def mla_decode(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv_buffer: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, page_size: int, sm_scale: float,
) -> Callable[[], torch.Tensor]:
    """BatchMLAPagedAttentionWrapper on q_nope [B, H, R], q_rope [B, H, P], kv_buffer [num_slots, R + P],
    block_table [B, max_pages] int32, seq_lens [B] int32 (cuda), one query per request -> out [B, H, R]."""
    device, rank = q_nope.device, q_nope.shape[2]
    lens = seq_lens.tolist()
    pages = [-(-n // page_size) for n in lens]
    kv_indices = torch.cat([block_table[b, :n] for b, n in enumerate(pages)])
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(pages).cumsum(0)
    wrapper = flashinfer.BatchMLAPagedAttentionWrapper(_workspace(device), backend=_kernel(device))
    wrapper.plan(
        metadata=flashinfer.mla.MLAPlanMetadata.csr(
            qo_indptr=torch.arange(len(lens) + 1, dtype=torch.int32), kv_indptr=kv_indptr,
            kv_indices=kv_indices, kv_len_arr=seq_lens.cpu(),
        ),
        num_heads=q_nope.shape[1], head_dim_ckv=rank, head_dim_kpe=q_rope.shape[2], page_size=page_size,
        causal=False, sm_scale=sm_scale, q_data_type=q_nope.dtype, kv_data_type=kv_buffer.dtype,
        query_layout="split", kv_cache_layout="split",
    )
    paged = kv_buffer.view(-1, page_size, kv_buffer.shape[1])
    kv_cache = (paged[..., :rank], paged[..., rank:])
    return lambda: wrapper.run(query=(q_nope, q_rope), kv_cache=kv_cache)


def mha_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_kv: torch.Tensor,
    max_q: int, max_kv: int, sm_scale: float, causal: bool,
) -> Callable[[], torch.Tensor]:
    """BatchPrefillWithRaggedKVCacheWrapper with the natural-log lse: q [T, H, 192], k [Tk, H, 192],
    v [Tk, H, 128], cu_q / cu_kv [B+1] int32 -> out [T, H, 128] (max_q / max_kv unused: FlashInfer
    reads the offsets)."""
    heads = q.shape[1]
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), "NHD", backend=_kernel(q.device))
    wrapper.plan(
        qo_indptr=cu_q.cpu(), kv_indptr=cu_kv.cpu(), num_qo_heads=heads, num_kv_heads=heads,
        head_dim_qk=q.shape[2], head_dim_vo=v.shape[2], causal=causal, sm_scale=sm_scale,
        q_data_type=q.dtype, kv_data_type=k.dtype,
    )
    return lambda: wrapper.run(q, k, v, return_lse=True, lse_base="ln")[0]
