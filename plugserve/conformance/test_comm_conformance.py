"""Comm backends against the oracle: sums over two ranks the kit spawns (gloo on the CPU; NCCL, rank r on cuda:r,
where two GPUs are visible), every shape the backend takes, its declared bound honoured, graphs replayed."""

from __future__ import annotations

import pytest
import torch

from plugserve.conformance.comm_ranks import WORLD, check_sums, run_ranks
from plugserve.conformance.plugin import Target, require_available
from plugserve.core.forward_batch import Phase
from plugserve.core.specs import CommSpec


def test_all_reduce(comm_target: Target, plugserve_hardware, plugserve_device):
    require_available(comm_target, plugserve_hardware)
    fits = comm_target.cls.capabilities.check(CommSpec(WORLD, comm_target.dtype), Phase.DECODE)
    if not fits:
        pytest.skip(f"{comm_target.entry.name}: {fits.reason}")
    if plugserve_device.type == "cuda" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"the comm kit needs {WORLD} GPUs, {torch.cuda.device_count()} visible")
    run_ranks(check_sums, comm_target.entry.name, str(comm_target.dtype).removeprefix("torch."),
              device_type=plugserve_device.type)
