"""What every Triton backend asks of the machine, in one place."""

from __future__ import annotations

import os

import torch

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


def tma_source(x: torch.Tensor) -> bool:
    """Can the 2-D tensor x be read through a TMA descriptor (TensorDescriptor.from_tensor): unit stride along its
    last dim, its rows and its base 16-byte aligned."""
    return x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0


# Split-K arrival counts (int32, zero between launches) of each device and stream, shared by the GEMM and MoE kernels
# that cut K: kernels on two streams at once (the shared experts' beside the routed ones) must not count into the
# same slots; kernels on one stream run one after the other, each leaving its counts at zero.
_arrivals: dict[tuple[int | None, int], torch.Tensor] = {}


def split_k_arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` arrival counts for split-K kernels on `device`'s current stream, zero at every kernel
    boundary (each launch re-arms the counts it used). The warm-up before a capture allocates them on the capture's
    stream; a capture that still grows them allocates in the graph's pool and zeroes them in the graph too."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    arrivals = _arrivals.get(key)
    if arrivals is None or arrivals.numel() < tiles:
        arrivals = _arrivals[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return arrivals
