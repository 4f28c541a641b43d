"""What every Triton backend asks of the machine, in one place."""

from __future__ import annotations

import os

import torch

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, Availability
from plugserve.core.moved import moved_names


def triton_availability(hardware: Hardware) -> Availability:
    """OK on a GPU with triton importable; on the CPU only under TRITON_INTERPRET=1.

    The variable is checked before triton is imported: an import without it defines Triton's own library
    functions (tl.max, ...) for the GPU, and kernels interpreted later in the process cannot call them."""
    if hardware.device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return Availability.no("triton kernels run on the CPU only under TRITON_INTERPRET=1 (slow; for tests)")
    try:
        import triton  # noqa: F401  (the probe: is the package importable here?)
    except ImportError as exc:
        return Availability.no(f"triton is not installed ({exc}); pip install triton")
    return OK


def tma_source(x: torch.Tensor) -> bool:
    """Can the 2-D tensor x be read through a TMA descriptor (TensorDescriptor.from_tensor): unit stride along its
    last dim, its rows and its base 16-byte aligned."""
    return x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0


__getattr__ = moved_names(__name__)
