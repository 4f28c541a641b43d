"""Decode's few-row matrix products as one Triton kernel that streams the weight: GEMVs of up to MAX_ROWS rows.

At batch 1 the 16-bit projections of a layer and absorbed MLA's two per-head products are matrix-vector
products whose time is the weight read. torch runs them through cuBLAS, whose kernels tile 64 output rows a
block: DeepSeek-V2-Lite's o_proj (N = 2048) then runs on 32 of an H100's 132 SMs, at about half the read
bandwidth. `gemv` tiles BLOCK_N (8-32) rows a program, so every SM streams its share.

Whether it wins depends on the shape and the GPU, so it runs only where a measured table says so:
`gemv_configs/device_name=<device key>,dtype=16bit.json`, written on the GPU by `benchmarks/tune_gemv.py`, maps each
shape "B,N,K" to {rows: [BLOCK_N, BLOCK_K, num_warps, num_stages]} for the row counts at which the kernel beat
torch. A GPU without its own file takes the closest measured one (`device_match.closest_measured`); none: torch.

Imported only by `SmallOps.with_fused_kernels` (on CUDA), the tuner and tests (see `triton_small_ops`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from plugserve.core.device_match import DeviceMatch, closest_measured, measured_device_keys
from plugserve.core.hardware import Hardware

# Rows the kernel takes: each program holds a [rows, BLOCK_N, BLOCK_K] product in registers.
MAX_ROWS = 4
CONFIG_DIR = Path(__file__).with_name("gemv_configs")


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: output rows per program, K chunk per step, and Triton's num_warps / num_stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"n{self.block_n}-k{self.block_k}-w{self.num_warps}-s{self.num_stages}"


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, rows, N, K,
    stride_x_t, stride_x_b, stride_w_b, stride_w_n, stride_w_k, stride_y_t, stride_y_b,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (n block, b): y[:, b, n block] = x[:, b, :] . W[b, n block, :]^T, float32 accumulation."""
    b = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + b * stride_w_b + n[:, None].to(tl.int64) * stride_w_n
    x_rows = x_ptr + b * stride_x_b + t[:, None] * stride_x_t
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        w = tl.load(w_rows + kk[None, :] * stride_w_k, mask=(n < N)[:, None] & (kk < K)[None, :], other=0.0)
        x = tl.load(x_rows + kk[None, :], mask=(t < rows)[:, None] & (kk < K)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    y = y_ptr + b * stride_y_b + t[:, None] * stride_y_t + n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(t < rows)[:, None] & (n < N)[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """x [T, B, K] (T <= MAX_ROWS; last dim contiguous), weight [B, N, K] (any strides) -> y [T, B, N] in
    x's dtype: y[t, b] = weight[b] @ x[t, b]. Grid (N / BLOCK_N, B), no allocation but y, no host sync."""
    t, b, k = x.shape
    n = weight.shape[1]
    if t > MAX_ROWS or weight.shape[0] != b or weight.shape[2] != k:
        raise ValueError(f"gemv takes x [T <= {MAX_ROWS}, B, K] and weight [B, N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(t, b, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    _gemv_kernel[(triton.cdiv(n, config.block_n), b)](
        x, weight, y, t, n, k, x.stride(0), x.stride(1), *weight.stride(), y.stride(0), y.stride(1),
        ROWS=triton.next_power_of_2(t), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y


def config_file_name(device_key: str) -> str:
    return f"device_name={device_key},dtype=16bit.json"


@dataclass(frozen=True)
class GemvTable:
    """One GPU's measured wins: {(B, N, K): {rows: GemvConfig}}, and whose measurements they are."""

    shapes: dict[tuple[int, int, int], dict[int, GemvConfig]]
    match: DeviceMatch

    @classmethod
    def read(cls, hardware: Hardware, directory: Path = CONFIG_DIR) -> GemvTable:
        match = closest_measured(hardware, measured_device_keys(directory, config_file_name), "GEMV table")
        if match.key is None:
            return cls({}, match)
        raw = json.loads((directory / config_file_name(match.key)).read_text())
        shapes = {tuple(int(v) for v in shape.split(",")): {int(rows): GemvConfig(*c) for rows, c in by_rows.items()}
                  for shape, by_rows in raw["shapes"].items()}
        return cls(shapes, match)  # type: ignore[arg-type]

    def config(self, b: int, n: int, k: int, rows: int) -> GemvConfig | None:
        """The config measured at the fewest rows >= `rows` where the kernel won, else None (torch's turn)."""
        won = self.shapes.get((b, n, k), {})
        fits = [r for r in won if r >= rows]
        return won[min(fits)] if fits and rows <= MAX_ROWS else None


def linear_op(table: Callable[[], GemvTable]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`SmallOps.linear` through `gemv` where `table()` (read at the first product, not before: selecting the op
    touches no GPU) has the shape at x's row count, else F.linear."""
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        config = table().config(1, weight.shape[0], weight.shape[1], rows) if rows else None
        if config is None:
            return torch.nn.functional.linear(x, weight)
        return gemv(x.reshape(rows, 1, -1), weight[None], config).view(*x.shape[:-1], -1)

    return linear


def absorb_op(table: Callable[[], GemvTable]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`SmallOps.absorb` through `gemv` where `table()` has the shape at x's row count, else the batched GEMM."""
    from plugserve.core.layers.small_ops import absorb

    def absorb_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        config = table().config(weight.shape[0], weight.shape[2], weight.shape[1], x.shape[0])
        if config is None:
            return absorb(x, weight)
        return gemv(x, weight.transpose(1, 2), config)

    return absorb_gemv


@functools.cache
def table_for(device: torch.device) -> GemvTable:
    """The table of `device`'s GPU (or the closest measured), read once."""
    return GemvTable.read(Hardware.detect(device))
