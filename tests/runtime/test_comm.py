"""The all-reduce chain of a tensor-parallel group over gloo: the comm backends auto ranks, each checked on every
rank (one that fails on any rank is dropped on all), a sum going to the first that takes it; a named one alone; per
message size as the selection table's comm buckets order them, where it has the group's world size."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from plugserve.core.distributed import CommRoutes, ParallelGroup
from plugserve.core.interfaces import CommCapabilities
from plugserve.core.specs import CommSpec
from plugserve.plugins.comm.torch_ref import TorchDistributedAllReduce
from plugserve.registry import TABLES_ENV, SelectionError, get_registry, hookimpl
from plugserve.runtime.comm import build_comm, sum_mismatch
from plugserve.runtime.server_args import ServerArgs
from tests.multiprocess import run_ranks

BOUNDED = CommCapabilities(dtypes=frozenset({torch.float32}), devices=frozenset({"cpu"}), max_bytes={2: 64 << 10})
SUMMED: list[str] = []  # this rank's fake backends that summed, in order


class SmallSums(TorchDistributedAllReduce):
    """A correct out-of-place sum of messages up to 64 KiB, recording its calls."""

    name: ClassVar[str] = "small_sums"
    capabilities: ClassVar[CommCapabilities] = BOUNDED
    priority: ClassVar[dict[str, int]] = {"cpu": 100}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        SUMMED.append(self.name)
        return super().all_reduce(x.clone())


class Roomy(SmallSums):
    """Sums up to 1 MiB, below small_sums in declared priority."""

    name: ClassVar[str] = "roomy"
    capabilities: ClassVar[CommCapabilities] = CommCapabilities(
        dtypes=frozenset({torch.float32}), devices=frozenset({"cpu"}), max_bytes={2: 1 << 20})
    priority: ClassVar[dict[str, int]] = {"cpu": 50}


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


class RoomyPlugin:
    @staticmethod
    @hookimpl
    def plugserve_backends() -> list[type]:
        return [Roomy]


def _chain(group: ParallelGroup) -> None:
    get_registry().register(Plugin, "test_comm", "tests")
    comm, status = build_comm(ServerArgs(model_preset="tiny", tp_size=2), group, torch.device("cpu"), torch.float32)
    assert [b.name for b in comm.chain] == ["small_sums", "torch_ref"]
    assert status.startswith("small_sums up to 64 KiB, torch_ref (gloo) above, by declared priority; "
                             "wrong_on_rank_one: self-check failed")
    group = group.with_comm(comm)
    # 16 KiB to it; 128 KiB past its bound, to torch_ref
    assert [_summed_by(group, 16), _summed_by(group, 128)] == ["small_sums", "torch_ref"]
    named, status = build_comm(ServerArgs(model_preset="tiny", tp_size=2, all_reduce_backend="torch_ref"), group,
                               torch.device("cpu"), torch.float32)
    assert [b.name for b in named.chain] == ["torch_ref"]
    assert status == "torch_ref (gloo), as --all-reduce-backend names"
    with pytest.raises(SelectionError, match="--all-reduce-backend wrong_on_rank_one: self-check failed"):
        build_comm(ServerArgs(model_preset="tiny", tp_size=2, all_reduce_backend="wrong_on_rank_one"), group,
                   torch.device("cpu"), torch.float32)


def test_the_chain_takes_checked_backends_in_rank_order_and_ends_at_any_size() -> None:
    run_ranks(_chain)


def test_one_rank_has_no_chain() -> None:
    assert build_comm(ServerArgs(model_preset="tiny"), ParallelGroup(), torch.device("cpu"), torch.float32) == (
        CommRoutes(), "one rank: no all-reduce")


def _summed_by(group: ParallelGroup, kib: int) -> str:
    """Which backend summed a message of `kib` KiB (checking the sum): a fake's name, or torch_ref (in place)."""
    x = torch.full((kib, 256), group.rank + 1.0)
    before = len(SUMMED)
    out = group.all_reduce(x)
    assert bool((out == 3.0).all())
    return SUMMED[-1] if len(SUMMED) > before else "torch_ref" if out is x else "?"


def _by_table(group: ParallelGroup, ranked: str, unranked: str) -> None:
    registry = get_registry()
    registry.register(Plugin, "test_comm", "tests")
    registry.register(RoomyPlugin, "test_comm_roomy", "tests")
    args, cpu = ServerArgs(model_preset="tiny", tp_size=2), torch.device("cpu")
    os.environ[TABLES_ENV] = ranked
    routes, status = build_comm(args, group, cpu, torch.float32)
    # Built in declared-priority order, only those the table ranks (and torch_ref); the failing one dropped.
    assert [b.name for b in routes.chain] == ["small_sums", "roomy", "torch_ref"]
    assert status.startswith("measured order (cpu.json, 2 ranks): up to 16 KiB: roomy > small_sums > torch_ref "
                             "(gloo); up to 256 KiB: small_sums > roomy > torch_ref (gloo); above: roomy > torch_ref "
                             "(gloo); wrong_on_rank_one: self-check failed"), status
    group = group.with_comm(routes)
    # bucket 1 its first; bucket 2 its first, or the next where small_sums does not take it; above the last bucket,
    # its order; past every bound, torch_ref.
    assert [_summed_by(group, kib) for kib in (8, 16, 32, 100, 768, 2048)] == [
        "roomy", "roomy", "small_sums", "roomy", "roomy", "torch_ref"]
    os.environ[TABLES_ENV] = unranked  # a table without world 2: declared priority
    routes, status = build_comm(args, group, cpu, torch.float32)
    assert [b.name for b in routes.chain] == ["small_sums", "roomy", "torch_ref"]
    assert status.startswith("small_sums up to 64 KiB, roomy up to 1024 KiB, torch_ref (gloo) above, by declared "
                             "priority; wrong_on_rank_one"), status
    group = group.with_comm(routes)
    assert [_summed_by(group, kib) for kib in (8, 100, 2048)] == ["small_sums", "roomy", "torch_ref"]


def _table(directory: Path, comm: dict[int, list[dict]]) -> str:
    directory.mkdir()
    (directory / "cpu.json").write_text(json.dumps({"device_name": "cpu", "rankings": {}, "comm": comm}))
    return str(directory)


def test_a_table_with_the_worlds_comm_buckets_routes_each_size_by_its_order(tmp_path: Path) -> None:
    ranked = _table(tmp_path / "ranked", {2: [
        {"max_bytes": 16 << 10, "order": ["wrong_on_rank_one", "roomy", "small_sums", "torch_ref"]},
        {"max_bytes": 256 << 10, "order": ["small_sums", "roomy", "torch_ref"]},
        {"max_bytes": 512 << 10, "order": ["roomy", "torch_ref"]}]})
    unranked = _table(tmp_path / "unranked", {4: [{"max_bytes": 1 << 20, "order": ["torch_ref"]}]})
    run_ranks(_by_table, ranked, unranked)


def _nudged(group: ParallelGroup) -> None:
    spec = CommSpec(group.world_size, torch.bfloat16, group=group.group)
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(group.rank)).bfloat16()
    x[0, 0] = 0.0  # the sum's first element is 0: no elementwise room there
    assert sum_mismatch(Nudged(spec, torch.device("cpu")), x, spec) == ""
    assert sum_mismatch(Nudged(spec, torch.device("cpu"), by=1.0), x, spec) == (
        "its sum differs from the group's own all-reduce's")


class Nudged(TorchDistributedAllReduce):
    """torch_ref's sum, its first element moved by `by` (a partial sum's bf16 rounding: 1/32 near 4)."""

    def __init__(self, spec: CommSpec, device: torch.device, by: float = 1 / 32) -> None:
        super().__init__(spec, device)
        self.by = by

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = super().all_reduce(x)
        out[0, 0] += self.by
        return out


def test_beyond_two_ranks_a_sum_may_differ_by_a_rounding_of_its_largest_partial_not_more() -> None:
    """Three ranks: a bf16 sum that cancels to zero keeps its partials' rounding (1/32) in another order; within 2 %
    of the sum's largest magnitude it is the same sum, an element off by 1 is not."""
    run_ranks(_nudged, world_size=3)
