"""The model's element-wise ops between backend calls (RMSNorm with the residual add, rope, SiLU-and-mul,
absorbed MLA's norm + rope + KV cache write + W_UK absorption), as plain functions, eager or compiled.

At decode each is a handful of tiny kernels per layer whose fixed costs, at batch 1, outweigh the weight reads.
On CUDA `with_fused_kernels` swaps in one Triton kernel each (`triton_small_ops`) for the norms, SiLU-and-mul and
MLA's preparation; `--enable-torch-compile` compiles the others (rope's cos / sin, the MHA path's rope) for
inputs of at most `--torch-compile-max-bs` rows, larger ones running eagerly so that no prompt length
recompiles. The model's modules call the functions of the `SmallOps` they are given
(`DeepseekForCausalLM.use_small_ops`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

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
                slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA's new tokens: latent and rope key normed / rotated into the KV pool, q absorbed and rotated.

    kv_a [T, R + P] (latent, then rope key; activation dtype); q_nope [T, H, D] and q_rope [T, H, P]; w_kc
    [H, D, R] (W_UK); norm_weight [R] (kv_a_layernorm's) and its eps; cos / sin [T, P/2] float32
    (`rope_cos_sin`); buffer [num_slots, R + P] (one layer of the pool, its own dtype); slots [T] int64. Writes
    buffer[slots] = rms_norm(latent) ++ rope(k_rope), each computed as `rms_norm` / `apply_rope` do and then cast
    to the buffer's dtype (`kv_cache.store_rows`, as `MLAKVPool.write` stores them), and returns (`absorb_q`
    [T, H, R], q_rope rotated [T, H, P]) in q's dtype."""
    r = norm_weight.shape[0]
    latent, k_rope = kv_a.split([r, kv_a.shape[-1] - r], dim=-1)
    latent = rms_norm(latent, norm_weight, eps)
    q_rope, k_rope = apply_rope(q_rope, k_rope, cos, sin)
    store_rows(buffer, slots, latent, k_rope)
    return absorb_q(q_nope, w_kc), q_rope


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns, then up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
