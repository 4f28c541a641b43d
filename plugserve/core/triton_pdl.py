"""Programmatic dependent launch (PDL) of the Triton kernels on Hopper and newer GPUs.

A kernel launched as a programmatic dependent (Triton's `launch_pdl`) is scheduled while the kernel before it
still runs. Each such kernel starts with `programmatic_prologue`: it waits for the previous kernel's writes
(griddepcontrol.wait), then lets the next kernel launch (griddepcontrol.launch_dependents), which waits in turn.
A chain of them (quantization, GEMM; the MoE's alignment, quantizations and grouped GEMMs; MLA's decode and its
split merge) keeps at most two grids resident and hides part of each launch's latency behind the previous
kernel's tail. A kernel launched the usual way waits for the whole previous kernel, whether that one let
dependents launch or not.

Imported lazily with the kernels (see plugserve.plugins.gemm.triton_kernels): `triton.jit` reads TRITON_INTERPRET
when a function is defined. In the interpreter, and on older GPUs, kernels run with PDL off; `PLUGSERVE_PDL=0` turns
it off everywhere, for a profile whose kernel times do not include their wait for the kernel before
(`benchmarks/dev/profile_decode.py --no-pdl`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def programmatic_prologue(PDL: tl.constexpr):
    """The first statement of a kernel that may launch as a programmatic dependent (PDL from `launch_options`)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch_options(x: torch.Tensor) -> dict[str, bool]:
    """The PDL constexpr of a kernel working on x, with the launch option that goes with it where it is on."""
    return {"PDL": True, "launch_pdl": True} if programmatic_launch(x) else {"PDL": False}


def programmatic_launch(x: torch.Tensor) -> bool:
    """Whether kernels working on x launch as programmatic dependents: on a GPU of compute capability 9.0 or newer
    with a Triton that offers the launch option, kernels compiled (the interpreter has no griddepcontrol)."""
    return x.is_cuda and not triton.knobs.runtime.interpret and _programmatic_launch_on(x.device.index)


@functools.cache
def _programmatic_launch_on(device_index: int | None) -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    if os.environ.get("PLUGSERVE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0) and "launch_pdl" in CUDAOptions.__dataclass_fields__
