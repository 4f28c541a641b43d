"""ParallelGroup: no-ops at world size 1, gloo collectives on 2 spawned ranks, a dead peer failing fast."""

from __future__ import annotations

import time

import pytest
import torch

from plugserve.core.distributed import SINGLE, ParallelGroup, default_backend
from tests.multiprocess import COLLECTIVE_TIMEOUT_S, run_ranks


def test_world_size_one_collectives_return_their_input() -> None:
    x = torch.randn(3, 4)
    assert SINGLE.all_reduce(x) is x
    assert SINGLE.all_gather(x, dim=0) is x
    assert SINGLE.broadcast(x) is x
    assert SINGLE.broadcast_object(x) is x


def test_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside a world of size 2"):
        ParallelGroup(rank=2, world_size=2)


def test_default_backend_is_nccl_on_cuda_and_gloo_elsewhere() -> None:
    assert default_backend("cuda:1") == "nccl"
    assert default_backend("cpu") == "gloo"


def _collectives(group: ParallelGroup) -> None:
    assert group.world_size == 2
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.full((2, 3), group.rank + 1.0, dtype=dtype)
        assert group.all_reduce(x) is x
        assert torch.equal(x, torch.full((2, 3), 3.0, dtype=dtype))
    # Rank r's tensor [2, 3, 4] holds 10 r + its flat index: gathered along each dim, as torch.cat would.
    mine = torch.arange(24.0).view(2, 3, 4) + 10 * group.rank
    both = [torch.arange(24.0).view(2, 3, 4), torch.arange(24.0).view(2, 3, 4) + 10]
    for dim in (0, 1, -1):
        assert torch.equal(group.all_gather(mine, dim=dim), torch.cat(both, dim=dim))
    smallest = torch.tensor([5 - group.rank])
    assert torch.equal(group.all_reduce(smallest, torch.distributed.ReduceOp.MIN), torch.tensor([4]))
    # Rank 0's values, whatever the others hold.
    assert torch.equal(group.broadcast(torch.full((3,), float(group.rank))), torch.zeros(3))
    assert group.broadcast_object(("batch", [group.rank])) == ("batch", [0])


def test_all_reduce_all_gather_and_broadcast_over_gloo() -> None:
    run_ranks(_collectives)


def _one_rank_leaves(group: ParallelGroup) -> None:
    if group.rank == 1:
        return  # leaves the world without joining the collective
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        group.all_reduce(torch.ones(4))
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT_S + 5


def test_a_collective_whose_peer_left_fails_rather_than_hangs() -> None:
    run_ranks(_one_rank_leaves)
