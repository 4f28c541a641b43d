"""W_UV's product in fixed token tiles: `forward_mla_projected`'s second step under batch invariance
(--enable-deterministic-inference), where a bmm's kernel, and so its summation order, would follow the batch's size.
Compiled on a GPU, interpreted on the CPU (TRITON_INTERPRET=1); imported lazily with the Triton backend's kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugserve.core.triton_pdl import launch_options, programmatic_prologue
from plugserve.plugins.attention.common import input_precision, last_dim_contiguous, pow2_at_least

# `mla_project`'s tile at every token count (batch invariance): 16 tokens, tl.dot's least M, hold a decode batch of up
# to 16 in one tile (64: W_UV read four times, from L2 after the first); 64 of V's 128 columns, so that batch 1 at 128
# heads has 256 programs; the latent in 64-wide steps of the K loop.
MLA_PROJECT_BLOCK_T = 16
MLA_PROJECT_BLOCK_V = 64
MLA_PROJECT_BLOCK_R = 64


@triton.jit(do_not_specialize_on_alignment=["num_tokens"])
def _mla_project_kernel(
    latent_ptr, w_ptr, out_ptr, num_tokens,
    stride_l_t, stride_l_h, stride_w_h, stride_w_r, stride_o_t, stride_o_h,
    R: tl.constexpr, V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    # Program (token tile, head, column block): out[t, h, v] = latent[t, h, :] @ w[h, :, v] for BLOCK_T tokens and
    # BLOCK_V columns, float32 accumulation over R in BLOCK_R steps; rows past num_tokens are masked.
    programmatic_prologue(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    token_ok, column_ok = t < num_tokens, v < V
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for r0 in tl.static_range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        latent = tl.load(latent_ptr + t[:, None] * stride_l_t + h * stride_l_h + r[None, :],
                         mask=token_ok[:, None] & (r < R)[None, :], other=0.0)
        w = tl.load(w_ptr + h * stride_w_h + r[:, None] * stride_w_r + v[None, :],
                    mask=(r < R)[:, None] & column_ok[None, :], other=0.0)
        acc = tl.dot(latent, w, acc, input_precision=INPUT_PRECISION)
    tl.store(out_ptr + t[:, None] * stride_o_t + h * stride_o_h + v[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=token_ok[:, None] & column_ok[None, :])


def mla_project(latent: torch.Tensor, w_vc: torch.Tensor) -> torch.Tensor:
    """latent [T, H, R] (forward_mla's output), w_vc [H, R, V] (W_UV) of one dtype -> [T, H, V] in it: each head's
    product in tiles of MLA_PROJECT_BLOCK_T tokens whatever T, so a token's row is the same bits alone or in any
    batch (a bmm's kernel, and its summation order, follows T). Batch-invariant forward_mla_projected's second step."""
    t, h, r = latent.shape
    v = w_vc.shape[2]
    if tuple(w_vc.shape[:2]) != (h, r) or w_vc.dtype != latent.dtype:
        raise ValueError(f"w_vc must be [{h}, {r}, V] of {latent.dtype}, got {tuple(w_vc.shape)} of {w_vc.dtype}")
    out = torch.empty(t, h, v, dtype=latent.dtype, device=latent.device)
    if t == 0:
        return out
    latent, w_vc = last_dim_contiguous(latent), last_dim_contiguous(w_vc)
    grid = (triton.cdiv(t, MLA_PROJECT_BLOCK_T), h, triton.cdiv(v, MLA_PROJECT_BLOCK_V))
    _mla_project_kernel[grid](
        latent, w_vc, out, t, latent.stride(0), latent.stride(1), w_vc.stride(0), w_vc.stride(1), out.stride(0),
        out.stride(1), R=r, V=v, BLOCK_T=MLA_PROJECT_BLOCK_T, BLOCK_R=min(MLA_PROJECT_BLOCK_R, pow2_at_least(r)),
        BLOCK_V=MLA_PROJECT_BLOCK_V, INPUT_PRECISION=input_precision(latent.dtype), **launch_options(latent),
    )
    return out
