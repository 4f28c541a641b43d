"""Batch-invariant torch matmuls: a row's result does not depend on how many rows share the call.

torch picks a matmul's blocking from its shape (on the CPU a single row runs a GEMV and more rows a GEMM that
accumulates in another order; cuBLAS picks kernels and split-K by M), so a token's activations move in the last bits
with the batch around it, and a greedy near-tie can flip. Row-wise reductions move too (torch's CPU sum over a short
last dim vectorizes across rows when there are many, along the row when there are few), and so do transcendental
element-wise ops (an element past the last whole vector takes the scalar exp / sigmoid, whose last bit differs from
the vector one's: where it falls depends on the tensor's size). Inside `BatchInvariantMode` every mm / addmm / bmm /
baddbmm on this thread runs one row at a time (one batched call) on the CPU, and on CUDA through one Triton kernel
with one tile and one split of K at every M (`batch_invariant_matmul`, `matmul_path`), and every sum / mean / softmax
/ log-softmax over the last dim in fixed blocks of `REDUCE_BLOCK` rows (the last block zero-padded), and every exp /
log / sigmoid / silu / tanh / erf / gelu on a copy zero-padded to whole `VECTOR_PAD` element groups (every element
through the vector path): every row goes through one kernel of one shape, whatever the number of rows. Attention's
reduction over keys is tiled at absolute key positions in blocks of `KEY_TILE` by the batch-invariant attention
backends (`active()` tells them the mode is on).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REDUCE_BLOCK = 256
VECTOR_PAD = 64  # a multiple of every CPU vector loop's step (2 x 16 float32 lanes on AVX-512)
KEY_TILE = 64

_state = threading.local()
_aten = torch.ops.aten


def row_invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N], each row its own [1, K] @ [K, N] product of one batched call (b broadcast, not
    copied): no row shares a kernel tile with another, so none sees where it sits or how many rows there are."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(0).expand(a.shape[0], *b.shape)).squeeze(1)


def row_invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, K, N] -> [Bt, M, N], each batch entry through `row_invariant_mm`."""
    return torch.stack([row_invariant_mm(a[i], b[i]) for i in range(a.shape[0])])


def row_blocked_reduce(func: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """func(x, *args, **kwargs), a reduction or normalization over x's last dim (keepdim for a reduction), run on
    REDUCE_BLOCK rows [REDUCE_BLOCK, L] at a time (x [..., L], zero-padded to whole blocks) -> func's result."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    padded = max(1, -(-m // REDUCE_BLOCK)) * REDUCE_BLOCK
    rows = torch.cat([rows, rows.new_zeros(padded - m, rows.shape[1])]) if padded != m else rows.contiguous()
    out = torch.cat([func(rows[i : i + REDUCE_BLOCK], *args, **kwargs) for i in range(0, padded, REDUCE_BLOCK)])
    return out[:m].reshape(*x.shape[:-1], out.shape[-1])


def vector_padded(func: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """func(x, ...), an element-wise op, on x flattened and zero-padded to a whole number of VECTOR_PAD elements."""
    flat = x.reshape(-1)
    pad = -flat.numel() % VECTOR_PAD
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return func(flat.contiguous(), *args, **kwargs)[: x.numel()].reshape(x.shape)


def _reduces_last_dim(x: torch.Tensor, dims: Any) -> bool:
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return x.is_floating_point() and x.dim() >= 1 and [d % x.dim() for d in dims] == [x.dim() - 1]


class BatchInvariantMode(TorchDispatchMode):
    """Routes this thread's matmuls, last-dim reductions and transcendentals through the row-invariant versions above
    (the same values up to rounding, rounded the same way for a row wherever it sits). A composite op that becomes
    one of those (matmul, linear, einsum, softmax: seen whole under inference mode) is decomposed with the mode on,
    so that its parts come back here."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _REDUCTIONS and _reduces_last_dim(args[0], args[1]):
            x, _, *rest = args
            if func in (_aten._softmax.default, _aten._log_softmax.default):
                return row_blocked_reduce(func, x, -1, *rest, **kwargs)
            keepdim = bool(rest[0]) if rest else False
            out = row_blocked_reduce(func, x, [-1], True, **kwargs)
            return out if keepdim else out.squeeze(-1)
        if func in _ELEMENTWISE and args[0].is_floating_point() and args[0].device.type == "cpu":
            return vector_padded(func, *args, **kwargs)
        if func in _ELEMENTWISE_INPLACE and args[0].is_floating_point() and args[0].device.type == "cpu":
            return args[0].copy_(vector_padded(_ELEMENTWISE_INPLACE[func], *args, **kwargs))
        if func in _COMPOSITE:
            with self:
                return func.decompose(*args, **kwargs)
        if func in _MATMULS:
            return _matmul(func, args, kwargs)
        return func(*args, **kwargs)


_COMPOSITE = (_aten.matmul.default, _aten.linear.default, _aten.einsum.default, _aten.softmax.int,
              _aten.log_softmax.int, _aten.tensordot.default, _aten.rms_norm.default)
_TRANSCENDENTAL = ("exp", "exp2", "expm1", "log", "log1p", "log2", "sigmoid", "silu", "tanh", "erf", "gelu", "sin",
                   "cos")
_ELEMENTWISE = tuple(getattr(_aten, name).default for name in _TRANSCENDENTAL)
_ELEMENTWISE_INPLACE = {getattr(_aten, f"{name}_").default: getattr(_aten, name).default for name in _TRANSCENDENTAL}
_REDUCTIONS = (_aten.sum.dim_IntList, _aten.mean.dim, _aten._softmax.default, _aten._log_softmax.default)


_MATMULS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)
TRITON = "triton"
ROWS = "rows"


def matmul_path(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> str:
    """How the mode runs a matmul of operands on `device` with `dtypes`: TRITON (`batch_invariant_matmul`, one fixed
    tile at every M) for one floating dtype on CUDA, where a row-at-a-time product re-reads the weight per row; else
    ROWS (`row_invariant_mm`): on the CPU a batched GEMV per row is cheap and torch's own."""
    one_float = len(set(dtypes)) == 1 and dtypes[0] in (torch.float16, torch.bfloat16, torch.float32)
    return TRITON if device.type == "cuda" and one_float else ROWS


def _matmul(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """mm(a, b) / addmm(bias, a, b) / bmm(a, b) / baddbmm(bias, a, b) (beta, alpha in kwargs) on `matmul_path`'s
    path."""
    with_bias = func in (_aten.addmm.default, _aten.baddbmm.default)
    bias, a, b = args if with_bias else (None, *args)
    if matmul_path(a.device, tuple(t.dtype for t in args)) == TRITON and (kernels := _triton_matmul()) is not None:
        matmul = kernels.mm if a.dim() == 2 else kernels.bmm
        return matmul(a, b, bias, kwargs.get("beta", 1), kwargs.get("alpha", 1))
    product = row_invariant_mm(a, b) if a.dim() == 2 else row_invariant_bmm(a, b)
    return _scaled(product, bias, kwargs) if with_bias else product


@functools.cache
def _triton_matmul() -> Any:
    """The `batch_invariant_matmul` module, imported on first use (it imports triton); None without triton."""
    try:
        from plugserve.core import batch_invariant_matmul
    except ImportError:
        return None
    return batch_invariant_matmul


def _scaled(product: torch.Tensor, bias: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """beta * bias + alpha * product, as addmm / baddbmm define them."""
    alpha, beta = kwargs.get("alpha", 1), kwargs.get("beta", 1)
    if alpha != 1:
        product = product * alpha
    return product if beta == 0 else product + (bias if beta == 1 else beta * bias)


def active() -> bool:
    """Whether this thread runs inside `batch_invariant()`."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """This thread's matmuls batch-invariant (and `active()` true) inside the block; nothing when not `enabled` or
    already inside one."""
    if not enabled or active():
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with BatchInvariantMode():
            yield
    finally:
        _state.depth -= 1
