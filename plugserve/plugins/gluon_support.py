"""What the Gluon kernels (attention/gluon_mla.py, attention/gluon_mha.py, gemm/gluon_gemm.py) share: the TMA
load and store under either Triton's name, and a warp-specialized consumer's release of a ring slot."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# Triton 3.9 names the TMA copies async_load / async_store (the older names raise there); 3.6 has only the latter.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def release(bar):
    """Arrive on `bar` (an empty barrier counting one arrival per consumer partition) once every warp of this
    partition is past its wait on the wgmmas that read the slot: `gl.thread_barrier` and the arrive (one thread)
    are the partition's own, never the whole CTA's."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)
