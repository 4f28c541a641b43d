"""The model's element-wise ops in plain torch (eager): the reference of every fused or compiled version that
`small_ops.SmallOps` swaps in, and what it runs where none applies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugserve.core.kv_cache import store_rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek's RMSNorm: x [..., D] normalized in float32, cast back to x's dtype, times weight [D]."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm of a decoder block and its new residual."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64, inv_freq [P/2] float32 -> cos, sin [T, P/2] float32, times the YaRN scale."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos() * scale, angles.sin() * scale


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def apply_rope(q_rope: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's interleaved rope: q_rope [T, H, P], k_rope [T, P] rotated pairwise (x0, x1), (x2, x3)...
    by cos / sin [T, P/2]. Same shapes and dtypes out, computed in float32."""
    return _rotate(q_rope, cos[:, None, :], sin[:, None, :]), _rotate(k_rope, cos, sin)


def absorb_q(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """W_UK absorbed into q: q_nope [T, H, D] @ w_kc [H, D, R] per head -> [T, H, R] (a view of [H, T, R])."""
    return torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)


def mla_prepare(kv_a: torch.Tensor, q_nope: torch.Tensor, q_rope: torch.Tensor, w_kc: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, buffer: torch.Tensor,
                slots: torch.Tensor, kv_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA's new tokens: latent and rope key normed / rotated into the KV pool, q absorbed and rotated.

    kv_a [T, R + P] (latent, then rope key; activation dtype); q_nope [T, H, D] and q_rope [T, H, P]; w_kc
    [H, D, R] (W_UK); norm_weight [R] (kv_a_layernorm's) and its eps; cos / sin [T, P/2] float32
    (`rope_cos_sin`); buffer [num_slots, R + P] (one layer of the pool, its own dtype); slots [T] int64. Writes
    buffer[slots] = rms_norm(latent) ++ rope(k_rope), each computed as `rms_norm` / `apply_rope` do and then cast
    to the buffer's dtype (`kv_cache.store_rows`, as `MLAKVPool.write` stores them: an fp8 buffer holds
    value / kv_scale, the pool's `scale`), and returns (`absorb_q`
    [T, H, R], q_rope rotated [T, H, P]) in q's dtype."""
    r = norm_weight.shape[0]
    latent, k_rope = kv_a.split([r, kv_a.shape[-1] - r], dim=-1)
    latent = rms_norm(latent, norm_weight, eps)
    q_rope, k_rope = apply_rope(q_rope, k_rope, cos, sin)
    store_rows(buffer, slots, latent, k_rope, kv_scale)
    return absorb_q(q_nope, w_kc), q_rope


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns, then up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
