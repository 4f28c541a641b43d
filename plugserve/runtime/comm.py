"""The all-reduces of one rank's tensor-parallel group: the comm backends `auto` ranks (or `--all-reduce-backend`
names), each built by every rank at once and checked against the group's own all-reduce on random data, kept only
where every rank's check passed. A sum walks the chain to the first backend that takes it; the chain ends at the
first backend that takes every size."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from plugserve.core.distributed import ParallelGroup
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import CommBackend
from plugserve.core.specs import CommSpec
from plugserve.registry import SelectionError, get_registry
from plugserve.runtime.server_args import ServerArgs, flag

logger = logging.getLogger(__name__)

CHECK_BYTES = 32 << 10  # the check's message: a decode step's size, within every measured one-shot bound


def requested_backend(args: ServerArgs) -> str:
    """--all-reduce-backend, or torch_ref under --disable-custom-all-reduce (SGLang's flag)."""
    return "torch_ref" if args.disable_custom_all_reduce else args.all_reduce_backend


def build_comm(args: ServerArgs, group: ParallelGroup, device: torch.device, dtype: torch.dtype
               ) -> tuple[tuple[CommBackend, ...], str]:
    """Every rank of `group` at once: the chain of comm backends for its sums of `dtype`, and a line saying what sums
    what (for the log and /server_info)."""
    if group.world_size == 1:
        return (), "one rank: no all-reduce"
    requested = requested_backend(args)
    spec = CommSpec(group.world_size, dtype, nodes=args.nnodes, group=group.group)
    hardware = Hardware.detect(device)
    try:
        candidates = get_registry().candidates("comm", Phase.DECODE, 1, hardware, requested, spec)
    except SelectionError as exc:
        name = "disable_custom_all_reduce" if args.disable_custom_all_reduce else "all_reduce_backend"
        raise SelectionError(f"{flag(name)}: {exc}") from None
    chain: list[CommBackend] = []
    failures: list[str] = []
    for selection in candidates:
        backend, error = _built_and_checked(selection.backend, spec, device, group)
        if backend is None:
            if requested != "auto":
                raise SelectionError(f"{flag('all_reduce_backend')} {requested}: {error}")
            failures.append(f"{selection.backend.name}: {error}")
            continue
        chain.append(backend)
        if backend.capabilities.largest(spec.world_size) is None:
            break
    if not chain or chain[-1].capabilities.largest(spec.world_size) is not None:
        chain.append(_built_and_checked(_reference(), spec, device, group)[0])  # type: ignore[arg-type]
    return tuple(chain), describe(chain, spec, failures)


def describe(chain: list[CommBackend], spec: CommSpec, failures: list[str]) -> str:
    """e.g. 'symmetric_memory up to 2048 KiB, torch_ref (nccl) above'."""
    parts = []
    for backend in chain:
        largest = backend.capabilities.largest(spec.world_size)
        name = backend.name
        if backend.name == "torch_ref":
            name += f" ({dist.get_backend(spec.group)})"
        parts.append(name + (f" up to {largest >> 10} KiB" if largest is not None else ""))
    line = ", ".join([*parts[:-1], parts[-1] + (" above" if len(parts) > 1 else "")])
    return line + "".join(f"; {failure}" for failure in failures)


def _reference() -> type[CommBackend]:
    return get_registry().get("comm", "torch_ref").cls  # type: ignore[return-value]


def _built_and_checked(cls: type[CommBackend], spec: CommSpec, device: torch.device, group: ParallelGroup
                       ) -> tuple[CommBackend | None, str]:
    """`cls` built on every rank (a collective) and its sum of random data compared with the group's own
    all-reduce's, or None and why: failed on any rank means failed on all, so every rank keeps the same chain."""
    backend: CommBackend | None = None
    error = ""
    try:
        backend = cls(spec, device)  # type: ignore[call-arg]
        if cls.name != "torch_ref":  # the reference sums with the group's own collective: nothing to compare
            error = _mismatch(backend, spec, device, group)
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    failed = torch.tensor([bool(error)], dtype=torch.int32, device=device)
    dist.all_reduce(failed, group=spec.group)
    if failed.item():
        return None, f"self-check failed ({error or 'on another rank'})"
    return backend, ""


def _mismatch(backend: CommBackend, spec: CommSpec, device: torch.device, group: ParallelGroup) -> str:
    """'' when the backend sums a random [rows, 1024] tensor as the group's own all-reduce does (bit for bit on two
    ranks, whose sum has one order; within a rounding on more), else what differs."""
    largest = backend.capabilities.largest(spec.world_size)
    element = torch.empty(0, dtype=spec.dtype).element_size()
    rows = max(1, min(CHECK_BYTES, largest or CHECK_BYTES) // (1024 * element))
    generator = torch.Generator(device=device).manual_seed(group.rank)
    x = torch.randn(rows, 1024, device=device, generator=generator).to(spec.dtype)
    if not backend.takes(x):
        return f"it does not take a [{rows}, 1024] {spec.dtype} tensor within its own bound"
    want = x.clone()
    dist.all_reduce(want, group=spec.group)
    got = backend.all_reduce(x)
    same = torch.equal(got, want) if spec.world_size == 2 else torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    return "" if same else "its sum differs from the group's own all-reduce's"
