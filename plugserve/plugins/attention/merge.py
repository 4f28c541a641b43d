"""Log-sum-exp merge of two attention states in Triton (`merge_attn_states`): the chunked prefix's passes
combined. Imported only once a backend is built: see `common`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugserve.plugins.attention.common import last_dim_contiguous


@triton.jit
def _merge_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr,
    stride_oa_t, stride_oa_h, stride_la_t, stride_la_h, stride_ob_t, stride_ob_h, stride_lb_t, stride_lb_h,
    stride_o_t, stride_o_h, stride_l_t, stride_l_h,
    num_heads,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    d = tl.arange(0, BLOCK_D)
    mask = head_mask[:, None] & (d[None, :] < D)
    lse_a = tl.load(lse_a_ptr + t * stride_la_t + heads * stride_la_h, mask=head_mask, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + t * stride_lb_t + heads * stride_lb_h, mask=head_mask, other=float("-inf"))
    top = tl.maximum(lse_a, lse_b)
    empty = top == float("-inf")
    shift = tl.where(empty, 0.0, top)
    weight_a = tl.exp(lse_a - shift)
    weight_b = tl.exp(lse_b - shift)
    # Both sides empty: total would be 0; 1 keeps log and division finite, the selects below set the result.
    total = tl.where(empty, 1.0, weight_a + weight_b)
    lse = tl.where(empty, float("-inf"), shift + tl.log(total))
    out_a = tl.load(out_a_ptr + t * stride_oa_t + heads[:, None] * stride_oa_h + d[None, :], mask=mask, other=0.0)
    out_b = tl.load(out_b_ptr + t * stride_ob_t + heads[:, None] * stride_ob_h + d[None, :], mask=mask, other=0.0)
    # A side with lse -inf saw no key: drop it with a select, since its out may hold NaN and 0 * NaN is NaN.
    out = tl.where((lse_a == float("-inf"))[:, None], 0.0, (weight_a / total)[:, None] * out_a.to(tl.float32))
    out += tl.where((lse_b == float("-inf"))[:, None], 0.0, (weight_b / total)[:, None] * out_b.to(tl.float32))
    tl.store(out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)
    tl.store(lse_ptr + t * stride_l_t + heads * stride_l_h, lse, mask=head_mask)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_* [T, H, D] (last dim contiguous), lse_* [T, H] float32 -> (out [T, H, D] in out_a's dtype,
    lse [T, H] float32): lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
    A side with lse -inf contributes nothing; both -inf gives out 0, lse -inf."""
    t, h, d = out_a.shape
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = torch.empty(t, h, dtype=torch.float32, device=out_a.device)
    if t == 0:
        return out, lse
    out_a, out_b = last_dim_contiguous(out_a), last_dim_contiguous(out_b)
    lse_a, lse_b = lse_a.float(), lse_b.float()
    block_h = min(16, triton.next_power_of_2(h))
    _merge_kernel[(t, triton.cdiv(h, block_h))](
        out_a, lse_a, out_b, lse_b, out, lse,
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
        out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        h, D=d, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d),
    )
    return out, lse
