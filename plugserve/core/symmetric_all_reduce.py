"""Small all-reduces in one kernel over NVLink, through torch's symmetric memory (`torch.distributed.
_symmetric_memory`): every rank copies its x into a buffer the other GPUs of the node can read, and one
kernel per rank sums all the ranks' buffers ("one-shot"). A decode step's all-reduces are a few KiB to a
few hundred KiB, where NCCL's ring protocol costs more than the data; this costs one launch and one
barrier, and is captured in CUDA graphs like any kernel. Larger messages stay with NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# The largest message (bytes) the one-shot kernel takes, by the number of ranks, where measured: up to it one-shot
# beat NCCL in CUDA-graph replay over NVLink (benchmarks/dev/bench_allreduce.py; docs/kernels.md). Worlds not
# measured yet use NCCL.
ONE_SHOT_MAX_BYTES = {2: 2 << 20}


class SymmetricAllReduce:
    """Sums of tensors in `dtype` of at most `max_bytes` over the ranks of `group` (all on this node's GPUs),
    out of place. Built by every rank of the group at once (the buffer's rendezvous is a collective)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype, self.max_bytes = dtype, max_bytes
        self.group_name = group.group_name
        element = torch.empty(0, dtype=dtype).element_size()
        self.buffer = symm_mem.empty(max_bytes // element, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def applies(self, x: torch.Tensor) -> bool:
        """Whether x goes through the one-shot kernel (else NCCL): on the GPU, in `dtype`, small enough, whole
        4-byte words (the kernel's smallest vector)."""
        size = x.numel() * x.element_size()
        return x.is_cuda and x.dtype == self.dtype and size <= self.max_bytes and size % 4 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] (any shape, `applies`) -> a new tensor of its shape: the sum of every rank's x."""
        flat = x.reshape(-1)
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffer[: flat.numel()], flat, "sum", self.group_name)
        return out.view(x.shape)


def build_symmetric_all_reduce(group: dist.ProcessGroup, world_size: int, device: torch.device, dtype: torch.dtype
                               ) -> tuple[SymmetricAllReduce | None, str]:
    """Every rank of `group` at once: the one-shot all-reduce, checked against NCCL's sum on random data, or
    None where it is unavailable or disagrees; with the reason, for the log and `/server_info`."""
    max_bytes = ONE_SHOT_MAX_BYTES.get(world_size)
    if max_bytes is None:
        return None, f"no measured one-shot size for {world_size} ranks: NCCL for every all-reduce"
    try:
        fast: SymmetricAllReduce | None = SymmetricAllReduce(group, device, dtype, max_bytes)
        generator = torch.Generator(device=device).manual_seed(dist.get_rank(group))
        x = torch.randn(16, 1024, device=device, generator=generator).to(dtype)
        got = fast(x)  # type: ignore[misc]
        dist.all_reduce(x, group=group)
        # Two ranks add in the same order either way; more may not.
        agrees = torch.equal(got, x) if world_size == 2 else torch.allclose(got, x, rtol=2e-2, atol=2e-2)
        error = None if agrees else "its sum differs from NCCL's"
    except Exception as exception:
        fast, error = None, f"{type(exception).__name__}: {exception}"
    # Every rank must take the same path: one that failed makes them all use NCCL.
    failed = torch.tensor([error is not None], device=device, dtype=torch.int32)
    dist.all_reduce(failed, group=group)
    if failed.item():
        return None, f"symmetric-memory one-shot all-reduce unavailable ({error or 'on another rank'}): NCCL"
    return fast, f"symmetric-memory one-shot all-reduce up to {max_bytes >> 10} KiB, NCCL above"
