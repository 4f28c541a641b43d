"""How the Triton matmul kernels' programs share out their work: the grouped order in which they take their output
tiles, and split-K's arrival counts and its sum of the slices in split order (the FP8 GEMM's, the MoE's and the
batch-invariant dense matmul's).

Imported lazily with the kernels (as `plugserve.core.triton_pdl` is): `triton.jit` reads TRITON_INTERPRET when a
function is defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program `pid`'s output tile (row tile, column tile) of an [M, N] product in grouped order: GROUP_M row tiles
    sweep the column tiles together, so that the programs running at once share B's tiles in L2. Only which program
    computes which tile; never a tile's sums."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (pid % pids_per_group) % group_rows, (pid % pids_per_group) // group_rows


@triton.jit
def split_k_arrive(count_ptr):
    """Count this program in at count_ptr (int32) once every thread's slice of the split-K workspace is stored;
    returns the count before it: SPLIT_K - 1 for the last program, which then adds the slices (`split_k_sum`) and
    sets the count back to 0. The counts come from `split_k_arrivals`."""
    tl.debug_barrier()  # every thread's stores before one thread's release makes them visible to the last program
    return tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def split_k_sum(ptrs, stride_split, mask, SPLIT_K: tl.constexpr):
    """The float32 slices at ptrs + s * stride_split, s = 0 ... SPLIT_K - 1, added in split order (the result does
    not depend on which program arrived last)."""
    total = tl.zeros(ptrs.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        # .cg: from L2, where the other programs' slices are, never a stale line of this SM's L1.
        total += tl.load(ptrs + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
    return total


# Split-K arrival counts (int32, zero between launches) of each device and stream, shared by every kernel that cuts
# K: kernels on two streams at once (the shared experts' beside the routed ones) must not count into the same slots;
# kernels on one stream run one after the other, each leaving its counts at zero.
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
