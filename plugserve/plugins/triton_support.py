"""What every Triton backend asks of the machine, in one place."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, Availability

if TYPE_CHECKING:
    import torch


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


def programmatic_launch(x: torch.Tensor) -> bool:
    """Whether kernels working on x launch as programmatic dependents (PDL, `launch_pdl`): on a GPU of compute
    capability 9.0 or newer (Hopper's griddepcontrol) with a Triton that offers the launch option. Such a kernel
    is launched while the previous one still runs and waits inside (`tl.extra.cuda.gdc_wait`) before it reads
    what that one wrote, so the launch latency between the two hides behind the first's tail."""
    return x.is_cuda and _programmatic_launch_on(x.device.index)


@functools.cache
def _programmatic_launch_on(device_index: int | None) -> bool:
    import torch
    from triton.backends.nvidia.compiler import CUDAOptions

    return torch.cuda.get_device_capability(device_index) >= (9, 0) and "launch_pdl" in CUDAOptions.__dataclass_fields__
