"""The all-reduces of one rank's tensor-parallel group: the comm backends `auto` ranks (or `--all-reduce-backend`
names), each built by every rank at once and checked against the group's own all-reduce on random data, kept only
where every rank's check passed. Where this GPU's selection table ranks comm backends for the group's world size
(`shootout.py --kinds comm`), a sum of b bytes goes to the first of its size bucket's order that takes it, else to
torch_ref; without one, the chain follows declared priority, a sum going to the first backend that takes it, the
chain ending at the first backend that takes every size. Under --enable-deterministic-inference only
batch-invariant backends (gather_sum) take part, in declared priority. Every rank reads the same table and builds
the same chain, so every rank sends a message of one size to the same backend."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from plugserve.core.distributed import CommRoutes, ParallelGroup
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import CommBackend
from plugserve.core.specs import CommSpec
from plugserve.registry import CommBucket, SelectionError, comm_order_line, get_registry, load_selection_table
from plugserve.runtime.server_args import ServerArgs, flag

logger = logging.getLogger(__name__)

CHECK_BYTES = 32 << 10  # the check's message: a decode step's size, within every measured one-shot bound
SUM_RTOL = 2e-2  # beyond two ranks, how far a sum may stray from the group's own (sum_mismatch): bf16's rounding


def requested_backend(args: ServerArgs) -> str:
    """--all-reduce-backend, or torch_ref under --disable-custom-all-reduce (SGLang's flag)."""
    return "torch_ref" if args.disable_custom_all_reduce else args.all_reduce_backend


def build_comm(args: ServerArgs, group: ParallelGroup, device: torch.device, dtype: torch.dtype
               ) -> tuple[CommRoutes, str]:
    """Every rank of `group` at once: which comm backends sum a message of each size of `dtype`, and a line saying
    what sums what and where that order comes from (for the log and /server_info)."""
    if group.world_size == 1:
        return CommRoutes(), "one rank: no all-reduce"
    requested = requested_backend(args)
    spec = CommSpec(group.world_size, dtype, nodes=args.nnodes, batch_invariant=args.enable_deterministic_inference,
                    group=group.group)
    hardware = Hardware.detect(device)
    try:
        candidates = get_registry().candidates("comm", Phase.DECODE, 1, hardware, requested, spec)
    except SelectionError as exc:
        name = "disable_custom_all_reduce" if args.disable_custom_all_reduce else "all_reduce_backend"
        raise SelectionError(f"{flag(name)}: {exc}") from None
    # A measured order ends every size at torch_ref, whose sums are not batch-invariant.
    measured = measured_order(hardware, group.world_size) if requested == "auto" and not spec.batch_invariant else None
    ranked = None if measured is None else {name for bucket in measured[1] for name in bucket.order}
    chain: list[CommBackend] = []
    failures: list[str] = []
    for selection in candidates:
        if ranked is not None and selection.backend.name not in ranked:
            continue  # the table did not rank it: no sum would go to it
        backend, error = build_checked(selection.backend, spec, device, group)
        if backend is None:
            if requested != "auto":
                raise SelectionError(f"{flag('all_reduce_backend')} {requested}: {error}")
            failures.append(f"{selection.backend.name}: {error}")
            continue
        chain.append(backend)
        if ranked is None and backend.capabilities.largest(spec.world_size) is None:
            break
    if (all(b.name != _reference().name for b in chain) if ranked is not None
            else not chain or chain[-1].capabilities.largest(spec.world_size) is not None):
        chain.append(build_checked(_reference(), spec, device, group)[0])  # type: ignore[arg-type]
    notes = "".join(f"; {failure}" for failure in failures)
    if measured is None:
        source = "as --all-reduce-backend names" if requested != "auto" else "by declared priority"
        return CommRoutes.declared(tuple(chain)), f"{describe(chain, spec)}, {source}{notes}"
    path, buckets = measured
    routes = measured_routes(tuple(chain), buckets)
    lines = [(edge, [_label(b, spec) for b in order]) for edge, order in zip(routes.edges, routes.orders, strict=True)]
    return routes, (f"measured order ({path}, {group.world_size} ranks): {comm_order_line(lines)}{notes}")


def measured_order(hardware: Hardware, world_size: int) -> tuple[str, list[CommBucket]] | None:
    """This GPU's selection table's name and its all-reduce buckets at `world_size` ranks; None where it has none."""
    loaded = load_selection_table(hardware)
    if loaded is None or not loaded[0].comm_buckets(world_size):
        return None
    table, path, _ = loaded
    return path.name, table.comm_buckets(world_size)


def measured_routes(chain: tuple[CommBackend, ...], buckets: list[CommBucket]) -> CommRoutes:
    """Per bucket, the built backends in its measured order, torch_ref after them (the last resort of every size)."""
    built = {backend.name: backend for backend in chain}
    reference = built[_reference().name]
    orders = []
    for bucket in buckets:
        order = [built[name] for name in bucket.order if name in built and name != reference.name]
        orders.append((*order, reference))
    return CommRoutes(chain, tuple(b.max_bytes for b in buckets), tuple(orders))


def describe(chain: list[CommBackend], spec: CommSpec) -> str:
    """e.g. 'symmetric_memory up to 2048 KiB, torch_ref (nccl) above'."""
    parts = []
    for backend in chain:
        largest = backend.capabilities.largest(spec.world_size)
        parts.append(_label(backend, spec) + (f" up to {largest >> 10} KiB" if largest is not None else ""))
    return ", ".join([*parts[:-1], parts[-1] + (" above" if len(parts) > 1 else "")])


def _label(backend: CommBackend, spec: CommSpec) -> str:
    """Its name, torch_ref's with the group's own collective library."""
    return backend.name + (f" ({dist.get_backend(spec.group)})" if backend.name == "torch_ref" else "")


def _reference() -> type[CommBackend]:
    return get_registry().get("comm", "torch_ref").cls  # type: ignore[return-value]


def agreed(error: str, device: torch.device, group: ParallelGroup) -> str:
    """Every rank at once: '' where every rank's `error` is '', else this rank's error or 'on another rank' (so that
    every rank takes the same branch after it)."""
    failed = torch.tensor([bool(error)], dtype=torch.int32, device=device)
    dist.all_reduce(failed, group=group.group)
    return (error or "on another rank") if failed.item() else ""


def build_checked(cls: type[CommBackend], spec: CommSpec, device: torch.device, group: ParallelGroup
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
    error = agreed(error, device, group)
    return (None, f"self-check failed ({error})") if error else (backend, "")


def sum_mismatch(backend: CommBackend, x: torch.Tensor, spec: CommSpec) -> str:
    """'' when the backend sums x (this rank's, `takes(x)`) as the group's own all-reduce does, else what differs. x
    is left as it was. Two ranks' sum has one order: bit for bit. On more, within SUM_RTOL of each element plus
    SUM_RTOL of the sum's largest magnitude: orders differ (a ring rounds each hop's partial sum to the dtype, a
    one-shot kernel rounds once), and an element that cancels to near zero keeps its partials' rounding."""
    want = x.clone()
    dist.all_reduce(want, group=spec.group)
    got = backend.all_reduce(x.clone())
    if spec.world_size == 2:
        same = torch.equal(got, want)
    else:
        got64, want64 = got.double(), want.double()
        bound = SUM_RTOL * (want64.abs() + want64.abs().max())
        same = got.shape == want.shape and bool(((got64 - want64).abs() <= bound).all())
    return "" if same else "its sum differs from the group's own all-reduce's"


def _mismatch(backend: CommBackend, spec: CommSpec, device: torch.device, group: ParallelGroup) -> str:
    """`sum_mismatch` of a random [rows, 1024] tensor of CHECK_BYTES (or the backend's bound, where smaller)."""
    largest = backend.capabilities.largest(spec.world_size)
    element = torch.empty(0, dtype=spec.dtype).element_size()
    rows = max(1, min(CHECK_BYTES, largest or CHECK_BYTES) // (1024 * element))
    generator = torch.Generator(device=device).manual_seed(group.rank)
    x = torch.randn(rows, 1024, device=device, generator=generator).to(spec.dtype)
    if not backend.takes(x):
        return f"it does not take a [{rows}, 1024] {spec.dtype} tensor within its own bound"
    return sum_mismatch(backend, x, spec)
