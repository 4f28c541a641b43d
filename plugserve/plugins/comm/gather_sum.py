"""The batch-invariant all-reduce that `--enable-deterministic-inference` takes beside `--tp-size` > 1: every rank's
x gathered whole (a copy, so exact), then summed on each rank in rank order in float32 and rounded once to x's
dtype. Each element's sum is then one fixed expression whatever the message's size and whatever rows share it,
which NCCL's all-reduce does not promise beyond two ranks (its channels and chunks follow the message's size). It
moves world_size times the message into every rank, so `auto` takes it only where batch invariance is asked for."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from plugserve.core.interfaces import CommBackend, CommCapabilities
from plugserve.registry import hookimpl

# torch 2.13 names it all_gather_single (the old name warns); torch 2.11's has only all_gather_into_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherSumAllReduce(CommBackend):
    name: ClassVar[str] = "gather_sum"
    verified: ClassVar[str] = "cpu"
    capabilities: ClassVar[CommCapabilities] = CommCapabilities(
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        devices=frozenset({"cuda", "cpu"}),
        cuda_graph=True,  # NCCL's all-gather is captured like a kernel
        multi_node=True,
        batch_invariant=True,
    )
    priority: ClassVar[dict[str, int]] = {"default": -10}  # below torch_ref: the slower sum, for determinism only

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] -> a new tensor of x's shape and dtype: the ranks' x summed in rank order, in float32."""
        gathered = x.new_empty((self.spec.world_size, x.numel()))
        all_gather_single(gathered.view(-1), x.reshape(-1), group=self.spec.group)
        total = gathered[0].float()
        for part in gathered[1:]:
            total += part.float()
        return total.to(x.dtype).view(x.shape)


@hookimpl
def plugserve_backends() -> list[type[CommBackend]]:
    return [GatherSumAllReduce]
