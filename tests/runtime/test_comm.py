"""The all-reduce chain of a tensor-parallel group over gloo: the comm backends auto ranks, each checked on every
rank (one that fails on any rank is dropped on all), a sum going to the first that takes it; a named one alone."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from plugserve.core.distributed import ParallelGroup
from plugserve.core.interfaces import CommCapabilities
from plugserve.plugins.comm.torch_ref import TorchDistributedAllReduce
from plugserve.registry import SelectionError, get_registry, hookimpl
from plugserve.runtime.comm import build_comm
from plugserve.runtime.server_args import ServerArgs
from tests.multiprocess import run_ranks

BOUNDED = CommCapabilities(dtypes=frozenset({torch.float32}), devices=frozenset({"cpu"}), max_bytes={2: 64 << 10})


class SmallSums(TorchDistributedAllReduce):
    """A correct out-of-place sum of messages up to 64 KiB, counting its calls."""

    name: ClassVar[str] = "small_sums"
    capabilities: ClassVar[CommCapabilities] = BOUNDED
    priority: ClassVar[dict[str, int]] = {"cpu": 100}
    calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        SmallSums.calls += 1
        return super().all_reduce(x.clone())


class WrongOnRankOne(SmallSums):
    """Ranked first, but its sum is off on rank 1 only: the ranks must still agree to drop it."""

    name: ClassVar[str] = "wrong_on_rank_one"
    priority: ClassVar[dict[str, int]] = {"cpu": 200}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = super().all_reduce(x)
        return out + 1 if torch.distributed.get_rank() == 1 else out


class Plugin:
    @staticmethod
    @hookimpl
    def plugserve_backends() -> list[type]:
        return [SmallSums, WrongOnRankOne]


def _chain(group: ParallelGroup) -> None:
    get_registry().register(Plugin, "test_comm", "tests")
    comm, status = build_comm(ServerArgs(model_preset="tiny", tp_size=2), group, torch.device("cpu"), torch.float32)
    assert [b.name for b in comm] == ["small_sums", "torch_ref"]
    assert status.startswith("small_sums up to 64 KiB, torch_ref (gloo) above; wrong_on_rank_one: self-check failed")
    group = group.with_comm(comm)
    before = SmallSums.calls
    small = torch.full((4, 1024), group.rank + 1.0)  # 16 KiB
    assert torch.equal(group.all_reduce(small), torch.full((4, 1024), 3.0)) and SmallSums.calls == before + 1
    large = torch.full((32, 1024), group.rank + 1.0)  # 128 KiB: past its bound, to torch_ref in place
    assert group.all_reduce(large) is large and bool((large == 3.0).all()) and SmallSums.calls == before + 1
    named, status = build_comm(ServerArgs(model_preset="tiny", tp_size=2, all_reduce_backend="torch_ref"), group,
                               torch.device("cpu"), torch.float32)
    assert [b.name for b in named] == ["torch_ref"] and status == "torch_ref (gloo)"
    with pytest.raises(SelectionError, match="--all-reduce-backend wrong_on_rank_one: self-check failed"):
        build_comm(ServerArgs(model_preset="tiny", tp_size=2, all_reduce_backend="wrong_on_rank_one"), group,
                   torch.device("cpu"), torch.float32)


def test_the_chain_takes_checked_backends_in_rank_order_and_ends_at_any_size() -> None:
    run_ranks(_chain)


def test_one_rank_has_no_chain() -> None:
    assert build_comm(ServerArgs(model_preset="tiny"), ParallelGroup(), torch.device("cpu"), torch.float32) == (
        (), "one rank: no all-reduce")
