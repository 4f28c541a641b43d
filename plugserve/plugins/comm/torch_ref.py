"""The reference all-reduce: `torch.distributed.all_reduce` on the group's own backend (NCCL on GPUs, gloo on the
CPU), in place. It takes every size, so it ends every chain of comm backends."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from plugserve.core.interfaces import CommBackend, CommCapabilities
from plugserve.registry import hookimpl


class TorchDistributedAllReduce(CommBackend):
    name: ClassVar[str] = "torch_ref"
    verified: ClassVar[str] = "cpu"
    capabilities: ClassVar[CommCapabilities] = CommCapabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        devices=frozenset({"cuda", "cpu"}),
        cuda_graph=True,  # NCCL's all-reduce is captured like a kernel
        multi_node=True,
        batch_invariant_note="NCCL's order of summation follows the message's size (gather_sum is batch-invariant)",
    )
    priority: ClassVar[dict[str, int]] = {"default": 0}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] -> x, summed over the ranks in place."""
        dist.all_reduce(x, group=self.spec.group)
        return x


@hookimpl
def plugserve_backends() -> list[type[CommBackend]]:
    return [TorchDistributedAllReduce]
