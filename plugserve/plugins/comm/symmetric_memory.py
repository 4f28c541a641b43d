"""Small all-reduces in one kernel over NVLink, through torch's symmetric memory (`torch.distributed.
_symmetric_memory`): every rank copies its x into a buffer the other GPUs of the node can read, and one
kernel per rank sums all the ranks' buffers ("one-shot"). A decode step's all-reduces are a few KiB to a
few hundred KiB, where NCCL's ring protocol costs more than the data; this costs one launch and one
barrier, and is captured in CUDA graphs like any kernel. Larger messages go to the next backend of the chain.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, Availability, CommBackend, CommCapabilities
from plugserve.core.specs import CommSpec
from plugserve.registry import hookimpl

# The largest message (bytes) the one-shot kernel takes, by the number of ranks, where measured: up to it one-shot
# beat NCCL in CUDA-graph replay over NVLink on two and on four H200s (benchmarks/dev/bench_allreduce.py;
# docs/kernels.md). Worlds not measured yet are not taken.
ONE_SHOT_MAX_BYTES = {2: 2 << 20, 4: 2 << 20}


class SymmetricMemoryAllReduce(CommBackend):
    """Sums of tensors up to `ONE_SHOT_MAX_BYTES` bytes, out of place, through a buffer of that size made and
    exchanged (a collective) when the backend is built."""

    name: ClassVar[str] = "symmetric_memory"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[CommCapabilities] = CommCapabilities(
        # torch's symmetric-memory kernels dispatch float32 and bfloat16 only (AT_DISPATCH_FLOAT_AND_BFLOAT16): the
        # comm kit's float16 cases failed on H200s.
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        devices=frozenset({"cuda"}),
        min_capability=(8, 0),
        cuda_graph=True,
        max_bytes=ONE_SHOT_MAX_BYTES,
        batch_invariant_note="not checked across message sizes; it takes only some (gather_sum is batch-invariant)",
    )
    priority: ClassVar[dict[str, int]] = {"cuda": 50}

    def __init__(self, spec: CommSpec, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(spec, device)
        group = spec.group or dist.group.WORLD
        self.group_name = group.group_name
        largest = self.capabilities.largest(spec.world_size)
        element = torch.empty(0, dtype=spec.dtype).element_size()
        self.buffer = symm_mem.empty(largest // element, dtype=spec.dtype, device=device)  # type: ignore[operator]
        symm_mem.rendezvous(self.buffer, self.group_name)

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = super().availability(hardware)
        if not available:
            return available
        try:
            import torch.distributed._symmetric_memory
        except ImportError as exc:
            return Availability.no(f"this torch has no symmetric memory ({exc})")
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
            return Availability.no("this torch has no symm_mem.one_shot_all_reduce_copy kernel")
        return OK

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] -> a new tensor of its shape: the sum of every rank's x. The kernel moves whole 4-byte words: a
        2-byte x of an odd number of elements is summed with one zero after it."""
        flat = x.reshape(-1)
        if flat.numel() * flat.element_size() % 4:
            flat = torch.cat([flat, flat.new_zeros(1)])
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffer[: flat.numel()], flat, "sum", self.group_name)
        return out[: x.numel()].view(x.shape)


@hookimpl
def plugserve_backends() -> list[type[CommBackend]]:
    return [SymmetricMemoryAllReduce]
