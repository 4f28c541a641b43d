"""Checks behind `Capabilities.cuda_graph` for the GEMM and MoE backend tests.

- `no_host_reads()`: a dispatch mode that fails on every operation needing the host to see tensor contents:
  .item() / int() / bool() of a tensor, nonzero, unique, masked_select, boolean-mask indexing,
  repeat_interleave without output_size, tensors made from host data (torch.tensor, new_tensor: a
  host-to-device copy on CUDA), copies between devices. Under CUDA-graph capture each of these fails or is
  baked into the graph; on the CPU this mode is their stand-in. `outside_check(fn)` runs a library the
  backend calls (a stand-in for DeepGEMM, say) with the check off: the backend's code is under test, not it.
- `assert_replays(fn, inputs, new_inputs)` (CUDA only): fn captured in a CUDA graph on `inputs`, replayed
  on `new_inputs` copied into them, matches fn run eagerly on `new_inputs` (to the dtype's default tolerance).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten

# Ops whose result the host must read, or whose output size depends on tensor values.
_HOST_READS = {
    aten._local_scalar_dense: ".item() / int() / float() / bool() of a tensor",
    aten.is_nonzero: "bool() of a tensor",
    aten.nonzero: "nonzero (output size depends on values)",
    aten.argwhere: "argwhere (output size depends on values)",
    aten.masked_select: "masked_select (output size depends on values)",
    aten._unique: "unique", aten._unique2: "unique", aten.unique_dim: "unique",
    aten.unique_consecutive: "unique_consecutive", aten.unique_dim_consecutive: "unique_consecutive",
    aten.lift_fresh: "a tensor made from host data per call (a host-to-device copy on CUDA)",
}


class HostReadError(AssertionError):
    """A backend call read tensor contents on the host."""


def _reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    packet = func.overloadpacket
    if packet in _HOST_READS:
        return _HOST_READS[packet]
    if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int \
            and kwargs.get("output_size") is None:
        return "repeat_interleave by a tensor without output_size"
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            return "boolean-mask indexing"
    if packet is aten._to_copy and "device" in kwargs and kwargs["device"] is not None \
            and torch.device(kwargs["device"]) != args[0].device:
        return f"a copy from {args[0].device} to {kwargs['device']}"
    if packet is aten.copy_ and args[0].device != args[1].device:
        return f"a copy from {args[1].device} to {args[0].device}"
    return None


class no_host_reads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _reason(func, args, kwargs)
        if reason is not None:
            raise HostReadError(f"{func}: {reason}")
        return func(*args, **kwargs)


def outside_check(fn: Callable) -> Callable:
    """fn, run with every dispatch mode (so `no_host_reads`) off."""

    @functools.wraps(fn)
    def unchecked(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return unchecked


def assert_replays(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: Sequence[torch.Tensor],
    new_inputs: Sequence[torch.Tensor],
) -> None:
    """Capture fn(*inputs) in a CUDA graph (after a warm-up call that compiles and allocates), copy
    new_inputs into the captured inputs, replay, and compare with fn(*new_inputs) run eagerly."""
    static = [t.clone() for t in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*static)
    for target, value in zip(static, new_inputs, strict=True):
        target.copy_(value)
    graph.replay()
    expected = fn(*new_inputs)
    captured = captured if isinstance(captured, tuple) else (captured,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for replayed, eager in zip(captured, expected, strict=True):
        # Not bit for bit: a library may pick another algorithm under capture. Values left from the capture
        # (a host-side decision baked in) would be off by far more.
        torch.testing.assert_close(replayed, eager)
