"""The backend registry: pluggy hooks, plugin loading, availability, selection and its explanation.

Every backend, built-in or third-party, arrives through the one hook `plugserve_backends`. Built-in
plugin modules are registered by module name; third-party ones through setuptools entry points of
the group "plugserve". A plugin that raises on import or in its hook is recorded as broken and
skipped. `select` picks a backend per kind, phase and batch size: the requested name if usable,
else the measured ranking stored for this device (plugserve/tables/<device>.json, or the closest
measured GPU's of its compute capability: plugserve.core.device_match), else the highest declared
priority for this GPU architecture. `build` constructs the first of those that passes its start-up
self-check, falling back to the next and saying why.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
import torch
from pydantic import BaseModel

from plugserve.core.device_match import DeviceMatch, closest_measured
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import BACKEND_BASES, OK, Availability, Backend
from plugserve.core.specs import KINDS, SPEC_TYPES, Kind

logger = logging.getLogger(__name__)

PROJECT = "plugserve"
ENTRY_POINT_GROUP = "plugserve"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

BUILTIN_PLUGINS = (
    "plugserve.plugins.attention.torch_ref",
    "plugserve.plugins.gemm.torch_ref",
    "plugserve.plugins.moe.torch_ref",
    "plugserve.plugins.comm.torch_ref",
    "plugserve.plugins.attention.triton",
    "plugserve.plugins.gemm.triton",
    "plugserve.plugins.moe.triton",
    "plugserve.plugins.attention.flashinfer_mla",
    "plugserve.plugins.attention.fa3",
    "plugserve.plugins.attention.cutlass_mla",
    "plugserve.plugins.attention.flashmla",
    "plugserve.plugins.gemm.torch_scaled_mm",
    "plugserve.plugins.gemm.cutlass",
    "plugserve.plugins.gemm.deepgemm",
    "plugserve.plugins.moe.deepgemm",
    "plugserve.plugins.comm.symmetric_memory",
    "plugserve.plugins.comm.gather_sum",
)
# Upper edges of the batch-size (token count) buckets that selection tables and --explain use.
BATCH_BUCKETS = (1, 8, 64, 512, 4096)
TABLES_ENV = "PLUGSERVE_TABLES_DIR"


class HookSpecs:
    @hookspec
    def plugserve_backends(self) -> list[type[Backend]]:  # type: ignore[empty-body]
        """Return the backend classes this plugin contributes (subclasses of AttentionBackend,
        Fp8GemmBackend or MoEBackend, each with a unique `name`)."""


class RegistryError(Exception):
    """The set of installed plugins is inconsistent (two backends with one name)."""


class SelectionError(ValueError):
    """A requested backend is unknown or unusable, or nothing is usable; the message lists why."""


@dataclass(frozen=True)
class BackendEntry:
    cls: type[Backend]
    plugin: str  # the plugin module or entry point that contributed it
    package: str  # the distribution that ships it

    @property
    def name(self) -> str:
        return self.cls.name


@dataclass(frozen=True)
class BrokenPlugin:
    plugin: str
    package: str
    error: str


@dataclass(frozen=True)
class Selection:
    kind: Kind
    phase: Phase
    backend: type[Backend]
    reason: str


@dataclass(frozen=True)
class BackendStatus:
    entry: BackendEntry
    availability: Availability  # on this machine, for the phase and spec asked about


class RankedBucket(BaseModel):
    max_batch_size: int
    order: list[str]  # fastest first


class CommBucket(BaseModel):
    """All-reduces of up to `max_bytes` bytes (and above the previous bucket's): comm backend names, fastest first."""

    max_bytes: int
    order: list[str]


class SelectionTable(BaseModel):
    """What the shootout measured on one device: per kind and phase, batch buckets in increasing
    `max_batch_size`, each with backend names fastest first. A batch beyond the last bucket uses it.
    `tp_size` / `ep_size`: the parallelism whose per-rank shapes were measured (heads / tp, sliced GEMMs,
    experts of width I / tp or n / ep whole ones). Attention's ranking depends on the heads a rank runs
    (FlashInfer's MLA has a fixed cost that a 16-head decode of a few hundred keys does not hide, where
    Triton's splits do): `rankings["attention"]` was measured at `attention_heads` per rank, and
    `attention_by_heads` holds the phases measured at other head counts (`shootout.py --heads H
    --merge-into TABLE`); a problem takes the measured head count nearest its own (by ratio). `comm`: per world
    size, all-reduce buckets in increasing `max_bytes` (`shootout.py --kinds comm`); a table without it ranks no
    comm backend, and the runtime chains them by declared priority."""

    device_name: str
    source: str = ""
    tp_size: int = 1
    ep_size: int = 1
    attention_heads: int = 128
    rankings: dict[str, dict[str, list[RankedBucket]]]
    attention_by_heads: dict[int, dict[str, list[RankedBucket]]] = {}
    comm: dict[int, list[CommBucket]] = {}

    def comm_buckets(self, world_size: int) -> list[CommBucket]:
        """The all-reduce buckets measured at `world_size` ranks, in increasing max_bytes ([] where not measured)."""
        return sorted(self.comm.get(world_size, []), key=lambda b: b.max_bytes)

    def measured_heads(self, num_heads: int) -> int:
        """Of the head counts attention was measured at, the nearest to `num_heads` by ratio (ties: more heads)."""
        measured = {self.attention_heads, *self.attention_by_heads}
        return min(measured, key=lambda h: (abs(math.log2(h / num_heads)), -h))

    def order(self, kind: Kind, phase: Phase, batch_size: int, num_heads: int | None = None) -> list[str]:
        """Backend names fastest first for `batch_size` (attention: measured at the nearest head count to
        `num_heads`, when given)."""
        by_phase = self.rankings.get(kind, {})
        if kind == "attention" and num_heads is not None:
            heads = self.measured_heads(num_heads)
            if heads != self.attention_heads:
                by_phase = self.attention_by_heads[heads]
        buckets = sorted(by_phase.get(phase.value, []), key=lambda b: b.max_batch_size)
        if not buckets:
            return []
        edges = [b.max_batch_size for b in buckets]
        return buckets[min(bisect.bisect_left(edges, batch_size), len(buckets) - 1)].order

    def bucket_bounds(self, kind: Kind, phase: Phase, up_to: int) -> list[int]:
        """Sizes at which the ranking may change, ascending: each bucket's max_batch_size below
        `up_to`, then `up_to` (every size in (previous bound, bound] ranks like the bound)."""
        buckets = self.rankings.get(kind, {}).get(phase.value, [])
        bounds = {b.max_batch_size for b in buckets if b.max_batch_size < up_to}
        return [*sorted(bounds), up_to]


def size_name(n_bytes: int) -> str:
    """A message size as people read it: "14 KiB", or bytes where not a whole KiB."""
    return f"{n_bytes >> 10} KiB" if n_bytes % 1024 == 0 else f"{n_bytes} B"


def merged_neighbours(buckets: Iterable[tuple[int, Sequence[str]]]) -> list[tuple[int, tuple[str, ...]]]:
    """(max_bytes, names fastest first) buckets in increasing size, a bucket of its lower neighbour's order merged
    into it (one bucket, up to the larger size)."""
    merged: list[tuple[int, tuple[str, ...]]] = []
    for edge, order in buckets:
        if merged and merged[-1][1] == tuple(order):
            merged[-1] = (edge, merged[-1][1])
        else:
            merged.append((edge, tuple(order)))
    return merged


def comm_order_line(buckets: Iterable[tuple[int, Sequence[str]]]) -> str:
    """(max_bytes, names fastest first) buckets in increasing size as one line, buckets of one order merged: e.g.
    'up to 1792 KiB: symmetric_memory > torch_ref; above: torch_ref' (the last bucket's order holds above it)."""
    merged = merged_neighbours(buckets)
    parts = [f"up to {size_name(edge)}: {' > '.join(order)}" for edge, order in merged[:-1]]
    last = " > ".join(merged[-1][1]) if merged else ""
    return "; ".join([*parts, f"above: {last}" if parts else f"any size: {last}"])


def tables_dir() -> Path:
    return Path(os.environ.get(TABLES_ENV, Path(__file__).parent / "tables"))


def selection_table_match(hardware: Hardware) -> DeviceMatch:
    """Which of the tables in `tables_dir()` `auto` reads on this device: its own, else the closest measured
    GPU's of its compute capability (plugserve.core.device_match), and why."""
    return closest_measured(hardware, (p.stem for p in tables_dir().glob("*.json")), "selection table")


def load_selection_table(hardware: Hardware) -> tuple[SelectionTable, Path, DeviceMatch] | None:
    """The table `auto` reads on this device (see selection_table_match), its path and why; None without one."""
    match = selection_table_match(hardware)
    if match.key is None:
        return None
    path = tables_dir() / f"{match.key}.json"
    return SelectionTable.model_validate(json.loads(path.read_text())), path, match


class Registry:
    """All backends contributed by the registered plugins, by kind and name."""

    def __init__(self, builtin: Iterable[str] = BUILTIN_PLUGINS, entry_points: bool = True) -> None:
        self.plugin_manager = pluggy.PluginManager(PROJECT)
        self.plugin_manager.add_hookspecs(HookSpecs)
        self.backends: dict[Kind, dict[str, BackendEntry]] = {kind: {} for kind in KINDS}
        self.broken: list[BrokenPlugin] = []
        self._availability: dict[tuple[type[Backend], Hardware], Availability] = {}
        for module_name in builtin:
            self._load(module_name, PROJECT, lambda name=module_name: importlib.import_module(name))
        if entry_points:
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                package = ep.dist.name if ep.dist is not None else "unknown"
                self._load(ep.name, package, ep.load)

    # -- loading -------------------------------------------------------------------------------------

    def _load(self, plugin: str, package: str, load) -> None:
        try:
            module = load()
        except Exception as exc:  # a broken plugin must never take the registry down
            self.broken.append(BrokenPlugin(plugin, package, f"import failed: {type(exc).__name__}: {exc}"))
            return
        self.register(module, plugin, package)

    def register(self, plugin_object: ModuleType | object, plugin: str, package: str) -> None:
        """Register a plugin (a module or object with `plugserve_backends` hookimpls) and collect
        its backends. Raises RegistryError when a backend name is already taken."""
        try:
            self.plugin_manager.register(plugin_object, name=plugin)
        except ValueError as exc:  # pluggy: already registered, or not a valid plugin
            self.broken.append(BrokenPlugin(plugin, package, f"registration failed: {exc}"))
            return
        # Each plugin's hook runs on its own so that one failing plugin cannot hide the others.
        for impl in self.plugin_manager.hook.plugserve_backends.get_hookimpls():
            if impl.plugin is not plugin_object:
                continue
            try:
                contributed = list(impl.function())
                for cls in contributed:
                    _validate_backend_class(cls)
            except Exception as exc:
                self.plugin_manager.unregister(plugin_object)
                self.broken.append(BrokenPlugin(plugin, package, f"{type(exc).__name__}: {exc}"))
                return
            for cls in contributed:
                self._add(BackendEntry(cls, plugin, package))

    def _add(self, entry: BackendEntry) -> None:
        kind = entry.cls.kind
        taken = self.backends[kind].get(entry.name)
        if taken is not None:
            raise RegistryError(
                f"two {kind} backends are named {entry.name!r}: one from package {taken.package!r} "
                f"(plugin {taken.plugin}), one from package {entry.package!r} (plugin {entry.plugin}); "
                "uninstall one of them"
            )
        self.backends[kind][entry.name] = entry

    # -- availability --------------------------------------------------------------------------------

    def get(self, kind: Kind, name: str) -> BackendEntry:
        try:
            return self.backends[kind][name]
        except KeyError:
            known = ", ".join(sorted(self.backends[kind])) or "none"
            raise SelectionError(f"unknown {kind} backend {name!r}; registered: {known}") from None

    def availability(self, cls: type[Backend], hardware: Hardware) -> Availability:
        """cls.availability(hardware), asked once per process (it may import heavy packages)."""
        key = (cls, hardware)
        if key not in self._availability:
            try:
                self._availability[key] = cls.availability(hardware)
            except Exception as exc:
                self._availability[key] = Availability.no(f"availability check raised {type(exc).__name__}: {exc}")
        return self._availability[key]

    def kernels(self, kind: Kind, name: str, hardware: Hardware) -> str:
        """The registered backend's `kernels(hardware)` line, "" where it is not available here; a hook that
        raises is reported in the line instead."""
        cls = self.get(kind, name).cls
        if not self.availability(cls, hardware):
            return ""
        try:
            return cls.kernels(hardware)
        except Exception as exc:
            return f"kernels() raised {type(exc).__name__}: {exc}"

    def usability(self, cls: type[Backend], phase: Phase, hardware: Hardware, spec: object) -> Availability:
        """Runs on this machine, and fits this phase and problem."""
        available = self.availability(cls, hardware)
        if not available:
            return available
        return cls.capabilities.check(spec, phase)

    def statuses(self, kind: Kind, phase: Phase, hardware: Hardware, spec: object | None = None) -> list[BackendStatus]:
        spec = spec if spec is not None else SPEC_TYPES[kind]()
        return [
            BackendStatus(entry, self.usability(entry.cls, phase, hardware, spec))
            for entry in sorted(self.backends[kind].values(), key=lambda e: e.name)
        ]

    # -- selection -----------------------------------------------------------------------------------

    def candidates(
        self,
        kind: Kind,
        phase: Phase,
        batch_size: int,
        hardware: Hardware,
        requested: str = "auto",
        spec: object | None = None,
    ) -> list[Selection]:
        """The usable backends for `kind` in `phase` at `batch_size` tokens, in the order `auto` tries
        them (the device's measured table, then priority), each with why; only the requested one when
        `requested` is a name. Raises SelectionError when `requested` is unknown or unusable, or when no
        backend is usable."""
        statuses = self.statuses(kind, phase, hardware, spec)
        usable = {s.entry.name: s.entry for s in statuses if s.availability}
        if requested != "auto":
            entry = self.get(kind, requested)
            if requested not in usable:
                reason = next(s.availability.reason for s in statuses if s.entry.name == requested)
                raise SelectionError(
                    f"{kind} backend {requested!r} cannot run {phase.value} here: {reason}. "
                    + _describe_choices(statuses)
                )
            return [Selection(kind, phase, entry.cls, "requested")]
        if not usable:
            raise SelectionError(f"no {kind} backend can run {phase.value} here. " + _describe_choices(statuses))
        ranked: list[Selection] = []
        loaded = load_selection_table(hardware)
        if loaded is not None:
            table, path, match = loaded
            stand_in = "" if match.exact else f"; {match.reason}"
            heads = getattr(spec, "num_heads", None) if kind == "attention" else None
            at_heads = f", {table.measured_heads(heads)} heads" if heads is not None else ""
            ranked += [
                Selection(kind, phase, usable[name].cls,
                          f"fastest usable backend measured on {table.device_name} for {phase.value} at "
                          f"batch size {batch_size}{at_heads} ({path.name}{stand_in})")
                for name in table.order(kind, phase, batch_size, heads) if name in usable
            ]
        measured = {s.backend.name for s in ranked}
        no_table = "" if loaded is not None else f"{selection_table_match(hardware).reason}; "
        by_priority = sorted(usable.values(), key=lambda e: (e.cls.priority_on(hardware), e.name), reverse=True)
        ranked += [
            Selection(kind, phase, e.cls, f"{no_table}highest priority on {hardware.arch} "
                                          f"({e.cls.priority_on(hardware)}) among usable: {', '.join(sorted(usable))}")
            for e in by_priority if e.name not in measured
        ]
        return ranked

    def select(
        self,
        kind: Kind,
        phase: Phase,
        batch_size: int,
        hardware: Hardware,
        requested: str = "auto",
        spec: object | None = None,
    ) -> Selection:
        """The first of `candidates`: what `auto` (or the request) picks before any self-check."""
        return self.candidates(kind, phase, batch_size, hardware, requested, spec)[0]

    def build(
        self,
        kind: Kind,
        phase: Phase,
        batch_size: int,
        device: torch.device,
        spec: object,
        requested: str = "auto",
        fit_spec: Callable[[type[Backend], Any], Any] | None = None,
        built: Mapping[str, Backend] | None = None,
        *,
        check: Callable[[Backend, Phase], None],
    ) -> tuple[Backend, Selection]:
        """Construct the first candidate that passes `check(backend, phase)`, the start-up self-check (the
        runtime passes `plugserve.conformance.self_check.self_check`), and return it with its selection; the
        reason names every candidate that failed before it, and why. Each candidate is built with
        `fit_spec(cls, spec)` (a decode backend may force the page size). A candidate named in `built` (instances
        passed before, e.g. for another batch size) is returned as it is. A requested backend that fails raises
        SelectionError: there is nothing to fall back to."""
        hardware = Hardware.detect(device)
        failures: list[str] = []
        for selection in self.candidates(kind, phase, batch_size, hardware, requested, spec):
            cls = selection.backend
            if built is not None and cls.name in built:
                backend = built[cls.name]
            else:
                try:
                    backend = cls(fit_spec(cls, spec) if fit_spec else spec, device)  # type: ignore[call-arg]
                    check(backend, phase)
                except Exception as exc:
                    failures.append(f"{cls.name}: self-check failed: {type(exc).__name__}: {str(exc).strip()[:300]}")
                    logger.warning("%s %s backend %s failed its self-check: %s", kind, phase.value, cls.name, exc)
                    continue
            if failures:
                selection = dataclasses.replace(selection, reason=f"{selection.reason}; fell back from "
                                                + "; ".join(failures))
            return backend, selection
        raise SelectionError(f"no {kind} backend passed its start-up self-check for {phase.value}: "
                             + "; ".join(failures))


def _describe_choices(statuses: list[BackendStatus]) -> str:
    usable = [s.entry.name for s in statuses if s.availability]
    unusable = [f"{s.entry.name} ({s.availability.reason})" for s in statuses if not s.availability]
    return f"Usable: {', '.join(usable) or 'none'}. Not usable: {'; '.join(unusable) or 'none'}."


def _validate_backend_class(cls: object) -> None:
    if not (inspect.isclass(cls) and issubclass(cls, Backend)):
        raise TypeError(f"{cls!r} is not a Backend subclass")
    base = BACKEND_BASES.get(getattr(cls, "kind", None))  # type: ignore[arg-type]
    if base is None or not issubclass(cls, base):
        bases = ", ".join(b.__name__ for b in BACKEND_BASES.values())
        raise TypeError(f"{cls.__qualname__} must subclass one of {bases}")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"{cls.__qualname__} does not implement {missing}")
    cls.check_declaration()


@functools.cache
def get_registry() -> Registry:
    """The process-wide registry of every installed plugin."""
    return Registry()


def select(
    kind: Kind,
    phase: Phase,
    batch_size: int,
    hardware: Hardware,
    requested: str = "auto",
    spec: object | None = None,
) -> Selection:
    return get_registry().select(kind, phase, batch_size, hardware, requested, spec)


__all__ = [
    "BATCH_BUCKETS",
    "OK",
    "BackendEntry",
    "BackendStatus",
    "BrokenPlugin",
    "CommBucket",
    "Registry",
    "RegistryError",
    "Selection",
    "SelectionError",
    "SelectionTable",
    "comm_order_line",
    "get_registry",
    "hookimpl",
    "load_selection_table",
    "merged_neighbours",
    "select",
    "selection_table_match",
    "size_name",
]
