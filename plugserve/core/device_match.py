"""Whose measurements a GPU uses: its own, else those of the closest measured GPU of its compute capability.

`auto`'s selection tables (plugserve/tables/<device key>.json) and the Triton backends' tuned launch configs
(`...device_name=<device key>...json`) are measured per GPU model, and torch names each memory size and form
factor apart ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA GH200 480GB"). Those of
one family run the same kernels best, so a GPU without its own file takes the closest measured one: its own
family first, then the families `FAMILIES` lists as nearest, never one of another compute capability. Both
lookups go through `closest_measured`, which says which file it took and why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from plugserve.core.hardware import Hardware

# Family -> (its compute capability, the families whose measurements stand in for it, nearest first).
# H200 and GH200 are the H100's silicon with more, faster HBM3e (about 4.8 TB/s, the H100 SXM's 3.35): they
# stand in for each other before the H100 does, and the H100 takes them only when no H100 was measured.
FAMILIES: dict[str, tuple[tuple[int, int], tuple[str, ...]]] = {
    "H100": ((9, 0), ("H100", "H200", "GH200")),
    "H200": ((9, 0), ("H200", "GH200", "H100")),
    "GH200": ((9, 0), ("GH200", "H200", "H100")),
}
_DEVICE_IN_FILE_NAME = re.compile(r"device_name=([^,]+)")


@dataclass(frozen=True)
class DeviceMatch:
    """The device key whose file to use (None: no measured file fits this GPU), whether it is this GPU's
    own, and why, in words."""

    key: str | None
    exact: bool
    reason: str


def _tokens(name: str) -> list[str]:
    """ "NVIDIA_H100_80GB_HBM3" or "NVIDIA H100 80GB HBM3" -> ["NVIDIA", "H100", "80GB", "HBM3"]."""
    return [t for t in re.split(r"[\s_]+", name.upper()) if t]


def gpu_family(name: str) -> str | None:
    """The `FAMILIES` entry a device name or key belongs to ("NVIDIA H100 PCIe" -> "H100"), or None."""
    return next((t for t in _tokens(name) if t in FAMILIES), None)


def closest_measured(hardware: Hardware, measured: Iterable[str], what: str) -> DeviceMatch:
    """Of the device keys that have a measured `what` ("selection table", "tuned config ..."), the one this
    GPU should use: its own; else one of its family, else of the nearest family of the same compute
    capability (within a family, the name sharing most words with this GPU's, e.g. "NVL" or "94GB"); else
    none. Every answer's reason names what it took or that nothing fits."""
    keys = sorted(set(measured))
    own = hardware.device_key
    if own in keys:
        return DeviceMatch(own, True, f"measured on {hardware.name}")
    family = gpu_family(own)
    nearest = FAMILIES[family][1] if family is not None and FAMILIES[family][0] == hardware.capability else ()
    ranked = sorted(
        (nearest.index(f), -len(set(_tokens(own)) & set(_tokens(key))), key)
        for key in keys
        if (f := gpu_family(key)) in nearest
    )
    if not ranked:
        others = f" (measured: {', '.join(keys)})" if keys else ""
        return DeviceMatch(None, False, f"no {what} for {hardware.name}, nor for another GPU known to share its "
                                        f"compute capability ({hardware.arch}){others}")
    _, _, key = ranked[0]
    used = gpu_family(key)
    why = (f"same {hardware.arch} family, {family}" if used == family
           else f"{used}: the nearest measured family to the {family}, same {hardware.arch}")
    return DeviceMatch(key, False, f"no {what} for {hardware.name}; using {key}, the closest measured ({why})")


def measured_device_keys(directory: Path, file_name: Callable[[str], str]) -> list[str]:
    """The device keys K for which `directory` holds `file_name(K)` (a tuned-config name of one shape)."""
    if not directory.is_dir():
        return []
    keys = []
    for path in directory.iterdir():
        found = _DEVICE_IN_FILE_NAME.search(path.name)
        if found and file_name(found[1]) == path.name:
            keys.append(found[1])
    return keys
