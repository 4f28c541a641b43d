"""RMSNorm as DeepSeek computes it: in float32, the result cast back to the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from plugserve.core.layers.small_ops import EAGER, SmallOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.ops: SmallOps = EAGER

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden] in x's dtype."""
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, hidden] -> (forward(x + residual), x + residual), fused when compiled."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
