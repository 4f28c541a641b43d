"""The order in which the Triton matmul kernels' programs take their output tiles.

Imported lazily with the kernels (as `plugserve.core.triton_pdl` is): `triton.jit` reads TRITON_INTERPRET when a
function is defined.
"""

from __future__ import annotations

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
