"""Block-FP8 quantization utilities: DeepSeek's e4m3 weights in (bn, bk) blocks with float32 scales,
and activations in 1 x bk token groups. Used by the loader (quantize-on-load, dequantizing kv_b_proj
for the absorbed path) and by the reference GEMM."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Floors the scale of an all-zero block so that x / scale stays 0 rather than NaN.
SCALE_EPS = 1e-10


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_grid(rows: int, cols: int, block_shape: tuple[int, int]) -> tuple[int, int]:
    """Shape of the scale grid of a rows x cols tensor in block_shape blocks."""
    return ceil_div(rows, block_shape[0]), ceil_div(cols, block_shape[1])


def _quantize_blocks(x: torch.Tensor, block_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] float -> (x_q [R, C] e4m3, scales [ceil(R/br), ceil(C/bc)] float32), one scale
    max(amax, eps) / 448 per block; edge blocks are shorter (zero padding does not change amax)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    br, bc = block_shape
    gr, gc = scale_grid(rows, cols, block_shape)
    padded = torch.nn.functional.pad(x.float(), (0, gc * bc - cols, 0, gr * br - rows))
    blocks = padded.view(gr, br, gc, bc)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    # Divide by a tensor: CUDA turns "tensor / python float" into a multiply by the reciprocal, one bit off.
    # A filled one, not one made from host data: that would be a host-to-device copy, which a CUDA graph
    # cannot capture.
    scales = amax.clamp(min=SCALE_EPS) / torch.full_like(amax, FP8_MAX)
    x_q = (blocks / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.view(gr * br, gc * bc)[:rows, :cols].contiguous(), scales.view(gr, gc)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation quantization: x [M, K] (any float dtype) -> (x_q [M, K] float8_e4m3fn,
    scales [M, ceil(K/group_size)] float32), scale = max(amax of the 1 x group_size group, eps) / 448,
    x ~= x_q * scale. K need not be a multiple of group_size: the last group is shorter."""
    return _quantize_blocks(x, (1, group_size))


def quantize_block_fp8(
    w: torch.Tensor, block_shape: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight quantization: w [N, K] (any float dtype) -> (w_q [N, K] float8_e4m3fn,
    scale_inv [ceil(N/bn), ceil(K/bk)] float32), scale_inv = max(amax of the block, eps) / 448.
    The inverse of `dequantize_block_fp8` up to e4m3 rounding."""
    return _quantize_blocks(w, block_shape)


def dequantize_block_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block_shape: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """w [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32 -> w * scale of its block,
    [N, K] float32. N and K need not be multiples of the block."""
    rows, cols = w.shape
    expected = scale_grid(rows, cols, block_shape)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scales of a {rows}x{cols} tensor in {block_shape} blocks must have shape {expected}, "
            f"got {tuple(scale_inv.shape)}"
        )
    bn, bk = block_shape
    out = w.float()
    # Row scales [rows, ceil(K/bk)]; each applied in place to its run of bk columns (the last run may be shorter).
    scales = scale_inv.float().repeat_interleave(bn, dim=0)[:rows]
    whole = cols // bk
    out[:, : whole * bk].view(rows, whole, bk).mul_(scales[:, :whole, None])
    if whole * bk < cols:
        out[:, whole * bk :].mul_(scales[:, whole:])
    return out


