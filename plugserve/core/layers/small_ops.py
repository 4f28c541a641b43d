"""The model's element-wise ops between backend calls (RMSNorm with the residual add, rope, SiLU-and-mul,
absorbed MLA's norm + rope + KV cache write + W_UK absorption), as plain functions, eager or compiled.

At decode each is a handful of tiny kernels per layer whose fixed costs, at batch 1, outweigh the weight reads.
On CUDA `with_fused_kernels` swaps in one Triton kernel each (`triton_small_ops`) for the norms, SiLU-and-mul and
MLA's preparation; `--enable-torch-compile` compiles the others (rope's cos / sin, the MHA path's rope) for
inputs of at most `--torch-compile-max-bs` rows, larger ones running eagerly so that no prompt length
recompiles. The model's modules call the functions of the `SmallOps` they are given
(`DeepseekForCausalLM.use_small_ops`). The eager functions live in
`eager_ops` (re-exported here), which the Triton kernels import too, so that the imports run one way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from plugserve.core.layers.eager_ops import (
    absorb_q,
    add_rms_norm,
    apply_rope,
    mla_prepare,
    rms_norm,
    rope_cos_sin,
    silu_and_mul,
)

__all__ = ["EAGER", "SmallOps", "absorb_q", "add_rms_norm", "apply_rope", "mla_prepare", "rms_norm", "rope_cos_sin",
           "silu_and_mul"]


@dataclass(frozen=True)
class SmallOps:
    rms_norm: Callable[..., torch.Tensor] = rms_norm
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rms_norm
    rope_cos_sin: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_cos_sin
    apply_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = apply_rope
    silu_and_mul: Callable[..., torch.Tensor] = silu_and_mul
    mla_prepare: Callable[..., tuple[torch.Tensor, torch.Tensor]] = mla_prepare

    @classmethod
    def compiled(cls, max_rows: int) -> SmallOps:
        """Every op through torch.compile for inputs of at most `max_rows` rows (first dimension), marked
        dynamic so that one compilation serves every batch size; eager above."""
        eager = cls()
        return cls(**{name: _compiled_up_to(getattr(eager, name), max_rows) for name in cls.__dataclass_fields__})

    def with_fused_kernels(self, device: torch.device) -> SmallOps:
        """These ops with the Triton kernels of `triton_small_ops` in place of those they replace (the norms,
        SiLU-and-mul, absorbed MLA's preparation), on CUDA with triton installed, also over compiled ops: each
        kernel is one launch like Inductor's, but for every batch size, with no compilation at start-up, and
        torch.compile fuses neither the KV pool write into the norm and rope nor W_UK's product into them.
        Unchanged elsewhere."""
        if device.type != "cuda":
            return self
        try:
            from plugserve.core.layers import triton_small_ops  # imports triton: only here, never at import
        except ImportError:
            return self
        return replace(self, rms_norm=triton_small_ops.rms_norm, add_rms_norm=triton_small_ops.add_rms_norm,
                       silu_and_mul=triton_small_ops.silu_and_mul, mla_prepare=triton_small_ops.mla_prepare)


def _compiled_up_to(function: Callable[..., Any], max_rows: int) -> Callable[..., Any]:
    compiled = torch.compile(function, dynamic=True)

    def run(first: torch.Tensor, *args: Any) -> Any:
        return compiled(first, *args) if first.shape[0] <= max_rows else function(first, *args)

    run.__name__ = f"compiled_{function.__name__}"
    return run


EAGER = SmallOps()
