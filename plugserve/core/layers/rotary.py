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
from plugserve.core.layers.small_ops import EAGER, SmallOps


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
    """cos / sin of the positions (once per forward, shared by every layer) and their application."""

    def __init__(self, dim: int, base: float, scaling: RopeScaling | None, device: torch.device | str) -> None:
        super().__init__()
        inv_freq, self.cos_sin_scale = rope_inv_freq(dim, base, scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.ops: SmallOps = EAGER

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, P/2] float32, computed from the positions (no length-limited
        cache)."""
        return self.ops.rope_cos_sin(positions, self.inv_freq, self.cos_sin_scale)

    def forward(self, q_rope: torch.Tensor, k_rope: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_rope [T, H, P]; k_rope [T, P]; cos_sin from `cos_sin`. Returns both rotated, same shapes and dtypes."""
        return self.ops.apply_rope(q_rope, k_rope, *cos_sin)
