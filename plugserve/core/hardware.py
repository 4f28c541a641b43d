"""The machine a backend would run on: GPU name, compute capability and memory, or the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hardware:
    """One device as backends see it.

    `capability` is the CUDA compute capability (major, minor), None on the CPU.
    """

    device_type: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None
    total_memory_bytes: int
    multiprocessors: int

    @classmethod
    def detect(cls, device: torch.device | str | None = None) -> Hardware:
        """Describe `device`, or the current CUDA device, or the CPU when there is no GPU."""
        device = torch.device(device) if device is not None else None
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            return cls(
                device_type="cuda",
                name=props.name,
                capability=(props.major, props.minor),
                total_memory_bytes=props.total_memory,
                multiprocessors=props.multi_processor_count,
            )
        if device.type != "cpu":
            raise ValueError(f"unsupported device type {device.type!r}: plugserve runs on 'cuda' or 'cpu'")
        return cls(
            device_type="cpu",
            name="cpu",
            capability=None,
            total_memory_bytes=_physical_memory_bytes(),
            multiprocessors=os.cpu_count() or 1,
        )

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def arch(self) -> str:
        """"sm90" for compute capability 9.0, "cpu" on the CPU."""
        if self.capability is None:
            return "cpu"
        return f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def device_key(self) -> str:
        """The device name as tuned-config and results file names spell it: "NVIDIA_H100_80GB_HBM3"."""
        return self.name.replace(" ", "_")

    def describe(self) -> str:
        memory = f"{self.total_memory_bytes / 2**30:.0f} GiB"
        if self.capability is None:
            return f"CPU ({self.multiprocessors} cores, {memory})"
        return f"{self.name} ({self.arch}, {self.multiprocessors} SMs, {memory})"


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
