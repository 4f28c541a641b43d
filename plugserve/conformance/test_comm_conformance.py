"""Comm backends against the oracle: sums over two and four ranks the kit spawns (gloo on the CPU, where two show
the code, and four for a batch-invariant backend in float32; NCCL, rank r on cuda:r, where that many GPUs are
visible), every shape the backend takes, its declared bound honoured, each element's bits the same in any message
where it declares batch invariance, graphs replayed."""

from __future__ import annotations

import pytest
import torch

from plugserve.conformance.comm_ranks import WORLDS, check_sums, run_ranks
from plugserve.conformance.plugin import Target, require_available
from plugserve.core.forward_batch import Phase
from plugserve.core.specs import CommSpec


@pytest.mark.parametrize("world", WORLDS, ids=[f"world{w}" for w in WORLDS])
def test_all_reduce(comm_target: Target, plugserve_hardware, plugserve_device, world: int):
    require_available(comm_target, plugserve_hardware)
    fits = comm_target.cls.capabilities.check(CommSpec(world, comm_target.dtype), Phase.DECODE)
    if not fits:
        pytest.skip(f"{comm_target.entry.name}: {fits.reason}")
    if plugserve_device.type == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"the comm kit at {world} ranks needs {world} GPUs, {torch.cuda.device_count()} visible")
    # A batch-invariant backend's order of summation shows from three ranks on, in float32 (bf16 / fp16 values add
    # exactly in float32): it runs at four too.
    shows_order = comm_target.cls.capabilities.batch_invariant and comm_target.dtype == torch.float32
    if plugserve_device.type == "cpu" and world > min(WORLDS) and not shows_order:
        pytest.skip(f"on the CPU the kit spawns {min(WORLDS)} gloo ranks: more run the same code on the same cores")
    run_ranks(check_sums, world, comm_target.entry.name, str(comm_target.dtype).removeprefix("torch."),
              device_type=plugserve_device.type)
