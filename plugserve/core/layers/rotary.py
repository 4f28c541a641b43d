"""DeepSeek's rotary embedding over the rope part of q and k, with YaRN context extension.

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... of the rope dims (GPT-J style, not
NeoX halves), each pair by position * inv_freq[pair]. YaRN blends interpolated and original
frequencies over a ramp between the `beta_fast` and `beta_slow` rotation counts and scales cos/sin
by mscale(factor, mscale) / mscale(factor, mscale_all_dim).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plugserve.core.config import RopeScaling, yarn_mscale


def _correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The rope dim whose wavelength fits `num_rotations` times into `max_positions`."""
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(dim: int, base: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """inv_freq [dim / 2] float32 and the cos/sin scale (1 without YaRN)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extrapolated = 1.0 / base**exponents
    if scaling is None:
        return extrapolated, 1.0
    interpolated = extrapolated / scaling.factor
    low = max(math.floor(_correction_dim(scaling.beta_fast, dim, base, scaling.original_max_position_embeddings)), 0)
    high = min(math.ceil(_correction_dim(scaling.beta_slow, dim, base, scaling.original_max_position_embeddings)),
               dim - 1)
    # 0 below `low` (fast-rotating dims keep their frequency), 1 above `high` (slow ones interpolate).
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = extrapolated * (1 - ramp) + interpolated * ramp
    cos_sin_scale = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return inv_freq, cos_sin_scale


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float, scaling: RopeScaling | None, device: torch.device | str) -> None:
        super().__init__()
        inv_freq, self.cos_sin_scale = rope_inv_freq(dim, base, scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q_rope: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; q_rope [T, H, P]; k_rope [T, P]. Returns both rotated, same shapes and dtypes.
        Angles are computed in float32 from the positions (no length-limited cache)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, P/2]
        cos, sin = angles.cos() * self.cos_sin_scale, angles.sin() * self.cos_sin_scale
        return _rotate(q_rope, cos[:, None, :], sin[:, None, :]), _rotate(k_rope, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(-2).to(x.dtype)
