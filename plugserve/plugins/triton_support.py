"""What every Triton backend asks of the machine, in one place."""

from __future__ import annotations

import os

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, Availability


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
