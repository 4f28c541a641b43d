"""`plugserve backends`: what is installed, what is usable here and why, what `auto` picks (a table or JSON)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from plugserve.core.dispatch import (
    DEFAULT_CHUNKED_PREFIX_CACHE_THRESHOLD,
    DEFAULT_PREFIX_CHUNK_CAPACITY,
    choose_attn_forward_method,
)
from plugserve.core.forward_batch import AttnForwardMethod, ForwardMode, Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import VERIFIED
from plugserve.core.specs import KINDS, CommSpec, Kind
from plugserve.registry import (
    BATCH_BUCKETS,
    Registry,
    SelectionError,
    comm_order_line,
    get_registry,
    load_selection_table,
    selection_table_match,
)

# (mode, prefix lengths, new-token lengths) that show each branch of the MLA dispatch rule.
DISPATCH_EXAMPLES: list[tuple[ForwardMode, list[int], list[int]]] = [
    (ForwardMode.EXTEND, [0, 0], [2048, 512]),
    (ForwardMode.EXTEND, [1024, 300], [128, 64]),
    (ForwardMode.EXTEND, [8192], [1024]),
    (ForwardMode.EXTEND, [65536, 8192], [2048, 512]),
    (ForwardMode.DECODE, [4096] * 32, [1] * 32),
    (ForwardMode.TARGET_VERIFY, [4096] * 8, [4] * 8),
    (ForwardMode.DRAFT_EXTEND, [4096] * 8, [2] * 8),
]


def describe(registry: Registry, hardware: Hardware, kinds: Sequence[Kind], explain: bool) -> dict[str, Any]:
    """Everything `plugserve backends` prints, as plain data (the --json output)."""
    backends, auto = [], []
    for kind in kinds:
        by_phase = {phase: registry.statuses(kind, phase, hardware) for phase in Phase}
        for i, entry in enumerate(sorted(registry.backends[kind].values(), key=lambda e: e.name)):
            available = registry.availability(entry.cls, hardware)
            backends.append({
                "kind": kind,
                "name": entry.name,
                "package": entry.package,
                "plugin": entry.plugin,
                "available": available.ok,
                "reason": available.reason,
                "cuda_graph": cuda_graph_support(entry.cls),
                "verified": entry.cls.verified,
                # --kv-cache-dtype: the KV cache dtypes an attention backend reads, and why no other
                "kv_cache": entry.cls.capabilities.kv_cache_dtype_names() if kind == "attention" else None,
                # --enable-deterministic-inference: batch-invariant, or why not
                "batch_invariant": batch_invariance(entry.cls),
                "kernels": registry.kernels(kind, entry.name, hardware),
                "phases": {
                    phase.value: {"usable": by_phase[phase][i].availability.ok,
                                  "reason": by_phase[phase][i].availability.reason}
                    for phase in Phase
                },
            })
        if kind == "comm":
            continue  # a chain by message size (`comm_chain`), not a pick per phase and batch
        for phase in Phase:
            for bucket in BATCH_BUCKETS:
                row: dict[str, Any] = {"kind": kind, "phase": phase.value, "max_batch_size": bucket}
                try:
                    selection = registry.select(kind, phase, bucket, hardware)
                    row |= {"backend": selection.backend.name, "reason": selection.reason}
                except SelectionError as exc:
                    row |= {"backend": None, "reason": str(exc)}
                auto.append(row)
    result: dict[str, Any] = {
        "hardware": {"device_type": hardware.device_type, "name": hardware.name, "arch": hardware.arch,
                     "memory_gib": round(hardware.total_memory_bytes / 2**30, 1)},
        "backends": backends,
        "broken_plugins": [{"plugin": b.plugin, "package": b.package, "error": b.error} for b in registry.broken],
        "selection_table": _table_used(hardware),
        "auto": auto,
    }
    if "comm" in kinds:
        result["comm_chain"] = comm_chain(registry, hardware)
        result["comm_measured"] = comm_measured(registry, hardware)
    if explain and {"gemm", "moe"} & set(kinds):
        result["gemm_moe_rows"] = ROW_RULE
    if explain and "attention" in kinds:
        result["mla_dispatch"] = _dispatch_table(registry, hardware)
    return result


# How serve applies the gemm and moe rows above (plugserve.runtime.row_buckets).
ROW_RULE = ("gemm and moe: serve runs a call of M rows (tokens) on the decode pick for M up to "
            "--max-running-requests, on the prefill pick above it (one pack of the weights per backend in use)")


def comm_chain(registry: Registry, hardware: Hardware) -> list[dict[str, Any]]:
    """The usable comm backends in the order `auto` chains them: each all-reduce goes to the first that takes its
    size (`runtime/comm.py`), the first that takes any size ending the chain."""
    chain = []
    for selection in registry.candidates("comm", Phase.DECODE, 1, hardware):
        bounds = selection.backend.capabilities.max_bytes  # type: ignore[attr-defined]
        chain.append({"backend": selection.backend.name, "reason": selection.reason,
                      "max_bytes": None if bounds is None else {str(w): b for w, b in sorted(bounds.items())}})
        if bounds is None:
            break
    return chain


def comm_measured(registry: Registry, hardware: Hardware) -> dict[str, Any]:
    """The all-reduce orders this device's selection table measured (`runtime/comm.py` follows them): its file, and
    per world size the buckets of max_bytes with the backends usable here fastest first, torch_ref last (every
    size's last resort); `reason` says why a world not listed, or every world, chains by declared priority."""
    loaded = load_selection_table(hardware)
    if loaded is None:
        return {"table": None, "worlds": {}, "reason": selection_table_match(hardware).reason}
    table, path, _ = loaded
    if not table.comm:
        return {"table": path.name, "worlds": {}, "reason": f"{path.name} ranks no all-reduce"}
    worlds = {}
    for world in sorted(table.comm):
        spec = CommSpec(world)
        usable = {s.entry.name for s in registry.statuses("comm", Phase.DECODE, hardware, spec) if s.availability}
        worlds[str(world)] = [{"max_bytes": b.max_bytes,
                               "order": [*(n for n in b.order if n in usable and n != "torch_ref"), "torch_ref"]}
                              for b in table.comm_buckets(world)]
    return {"table": path.name, "worlds": worlds,
            "reason": f"{path.name} ranks all-reduces at {', '.join(worlds)} ranks only"}


def _table_used(hardware: Hardware) -> dict[str, Any]:
    """The measured table `auto` reads here (its path, None without one), why that one, and the parallelism
    whose per-rank shapes it measured."""
    loaded = load_selection_table(hardware)
    if loaded is None:
        return {"path": None, "reason": selection_table_match(hardware).reason}
    table, path, match = loaded
    return {"path": str(path), "reason": match.reason, "tp_size": table.tp_size, "ep_size": table.ep_size}


def batch_invariance(cls: type) -> str:
    """Whether --enable-deterministic-inference may use the backend, and why not."""
    caps = cls.capabilities
    return "yes" if caps.batch_invariant else f"no: {caps.batch_invariant_note or 'not declared'}"


def cuda_graph_support(cls: type) -> str:
    """What a backend runs under CUDA graphs: the modes an attention backend declares, or yes / no."""
    caps = cls.capabilities
    if hasattr(caps, "graph_modes"):
        return ", ".join(sorted(m.name for m in caps.graph_modes)) or "no (runs eagerly)"
    return "yes" if caps.cuda_graph else "no (decode runs eagerly)"


def _dispatch_table(registry: Registry, hardware: Hardware) -> dict[str, Any]:
    try:
        prefill = registry.select("attention", Phase.PREFILL, 1, hardware).backend
        prefill_supports_mla = AttnForwardMethod.MLA in prefill.capabilities.methods  # type: ignore[attr-defined]
    except SelectionError:
        prefill_supports_mla = True
    rows = []
    for mode, prefix_lens, extend_lens in DISPATCH_EXAMPLES:
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        method, why = choose_attn_forward_method(mode, prefix_lens, seq_lens, prefill_supports_mla=prefill_supports_mla)
        rows.append({"mode": mode.name, "requests": len(seq_lens), "prefix_tokens": sum(prefix_lens),
                     "new_tokens": sum(extend_lens), "method": method.name, "reason": why})
    return {"chunked_prefix_cache_threshold": DEFAULT_CHUNKED_PREFIX_CACHE_THRESHOLD,
            "prefix_chunk_capacity": DEFAULT_PREFIX_CHUNK_CAPACITY, "examples": rows}


def print_report(report: dict[str, Any], explain: bool, console: Console) -> None:
    hw = report["hardware"]
    console.print(f"[bold]Device:[/] {hw['name']} ({hw['arch']}, {hw['memory_gib']} GiB)")
    table = Table("kind", "backend", "package", "prefill", "decode", "CUDA graphs", "verified",
                  *(["kernels"] if explain else []), title="Registered backends")
    for b in report["backends"]:
        cells = [
            "[green]usable[/]" if p["usable"] else f"[red]no[/]: {p['reason']}" for p in b["phases"].values()
        ]
        verified = b["verified"] if b["verified"] != "stand-ins" else "[yellow]stand-ins only[/]"
        table.add_row(b["kind"], b["name"], b["package"], *cells, b["cuda_graph"], verified,
                      *([b["kernels"]] if explain else []))
    console.print(table)
    console.print("verified: " + "; ".join(f"{key}: {meaning}" for key, meaning in VERIFIED.items()
                                           if any(b["verified"] == key for b in report["backends"])))
    kv = Table("backend", "reads the KV cache in", title="--kv-cache-dtype")
    for b in report["backends"]:
        if b["kv_cache"] is not None:
            kv.add_row(b["name"], b["kv_cache"])
    if kv.row_count:
        console.print(kv)
    invariant = Table("kind", "backend", "batch-invariant", title="--enable-deterministic-inference")
    for b in report["backends"]:
        invariant.add_row(b["kind"], b["name"], b["batch_invariant"])
    console.print(invariant)
    for broken in report["broken_plugins"]:
        console.print(f"[red]broken plugin[/] {broken['plugin']} ({broken['package']}): {broken['error']}")
    if explain:
        used = report["selection_table"]
        shapes = f", per-rank shapes of tp {used['tp_size']}, ep {used['ep_size']}" if used["path"] else ""
        console.print(f"[bold]Selection table:[/] {used['path'] or 'none'} ({used['reason']}{shapes})")
    auto = Table("kind", "phase", "batch size", "auto picks", *(["why"] if explain else []), title="auto selection")
    for (kind, phase, backend, reason), rows in itertools.groupby(
        report["auto"], key=lambda r: (r["kind"], r["phase"], r["backend"], r["reason"])
    ):
        sizes = [r["max_batch_size"] for r in rows]  # consecutive buckets with one pick share a row
        auto.add_row(kind, phase, _span(sizes[0], sizes[-1]), backend or "[red]none[/]",
                     *([reason] if explain else []))
    if auto.row_count:
        console.print(auto)
    if "comm_chain" in report:
        links = [f"{c['backend']} (" + (", ".join(f"{w} ranks up to {b >> 10} KiB" for w, b in c["max_bytes"].items())
                                        if c["max_bytes"] else "any size") + ")" for c in report["comm_chain"]]
        measured = report["comm_measured"]
        for world, buckets in measured["worlds"].items():
            line = comm_order_line((b["max_bytes"], b["order"]) for b in buckets)
            console.print(f"all-reduce order at {world} ranks, measured ({measured['table']}): {line}")
        console.print(f"all-reduce chain{' of other worlds' if measured['worlds'] else ''} (auto, by declared "
                      f"priority: {measured['reason']}; --all-reduce-backend names one): " + " -> ".join(links))
    if "gemm_moe_rows" in report:
        console.print(report["gemm_moe_rows"])
    if "mla_dispatch" in report:
        d = report["mla_dispatch"]
        dispatch = Table("mode", "requests", "prefix tokens", "new tokens", "method", "why",
                         title=f"MLA dispatch (--chunked-prefix-cache-threshold {d['chunked_prefix_cache_threshold']},"
                               f" prefix chunk capacity {d['prefix_chunk_capacity']})")
        for r in d["examples"]:
            dispatch.add_row(r["mode"], str(r["requests"]), str(r["prefix_tokens"]), str(r["new_tokens"]),
                             r["method"], r["reason"])
        console.print(dispatch)


def _span(first_edge: int, last_edge: int) -> str:
    """Token counts covered by the buckets from `first_edge` to `last_edge` (the last bucket is open)."""
    index = BATCH_BUCKETS.index(first_edge)
    low = BATCH_BUCKETS[index - 1] + 1 if index else 1
    high = "" if last_edge == BATCH_BUCKETS[-1] else str(last_edge)
    return f"{low}+" if not high else (f"{low}" if str(low) == high else f"{low}-{high}")


def report_backends(args: argparse.Namespace) -> int:
    kinds: list[Kind] = [args.kind] if args.kind else list(KINDS)
    try:
        hardware = Hardware.detect(args.device)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"plugserve backends: --device {args.device!r}: {exc}") from None
    report = describe(get_registry(), hardware, kinds, args.explain)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        # Piped output gets room for the reasons instead of rich's 80-column default.
        print_report(report, args.explain, Console(width=None if sys.stdout.isatty() else 180))
    return 0
