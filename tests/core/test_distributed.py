"""ParallelGroup: no-ops at world size 1, gloo collectives on 2 spawned ranks, DP attention's groups on 4, a dead peer
failing fast."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from plugserve.core.distributed import (
    SINGLE,
    CommRoutes,
    ParallelGroup,
    default_backend,
    destroy_parallel_group,
    dp_groups,
    init_parallel_group,
    pick_free_port,
    rendezvous_store,
    spawn_joined,
    unpad_rows,
)
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import pages_needed
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.server_args import ServerArgs
from tests.multiprocess import COLLECTIVE_TIMEOUT_S, run_ranks


def test_world_size_one_collectives_return_their_input() -> None:
    x = torch.randn(3, 4)
    assert SINGLE.all_reduce(x) is x
    assert SINGLE.all_gather(x, dim=0) is x
    assert SINGLE.broadcast(x) is x
    assert SINGLE.broadcast_object(x) is x
    assert SINGLE.gather_rows(x, [3]) is x and SINGLE.own_rows(x, [3]) is x


def test_rendezvous_store_binds_port_zero_to_a_port_the_other_ranks_reach() -> None:
    """Rank 0 binds the port itself (no port picked free beforehand, which another process may take first)."""
    served = rendezvous_store("tcp://127.0.0.1:0", 0, 2, timeout_s=10)
    assert served.port != 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe, pytest.raises(OSError):
        probe.bind(("127.0.0.1", served.port))  # held from the start
    reached = rendezvous_store(f"tcp://127.0.0.1:{served.port}", 1, 2, timeout_s=10)
    served.set("hello", "rank 0")
    assert reached.get("hello") == b"rank 0"


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
    # Bytes: through the host's shared-memory channel (both ranks run here), or over gloo when too big for a slot.
    assert group.channel is not None
    for data in (b"header", b"", bytes(range(256)) * 2000, b"next"):
        assert group.broadcast_bytes(data if group.rank == 0 else None) == data
    # Variable row counts (rank 0: 3 rows, rank 1: 1 row; DP attention's tokens): padded to 3, then each keeps its own.
    counts = [3, 1]
    rows = torch.arange(counts[group.rank] * 2.0).view(-1, 2) + 10 * group.rank
    gathered = group.gather_rows(rows, counts)
    assert torch.equal(gathered, torch.tensor([[0.0, 1], [2, 3], [4, 5], [10, 11], [0, 0], [0, 0]]))
    assert torch.equal(group.own_rows(gathered, counts), rows)
    assert torch.equal(unpad_rows(gathered, counts), torch.tensor([[0.0, 1], [2, 3], [4, 5], [10, 11]]))


def test_all_reduce_all_gather_and_broadcast_over_gloo() -> None:
    run_ranks(_collectives)


def _dp_groups_of_two(group: ParallelGroup) -> None:
    """4 ranks as 2 DP groups of 2 (group 0: ranks 0, 1; group 1: ranks 2, 3)."""
    dp = dp_groups(group, 2)
    g, a = divmod(group.rank, 2)
    assert (dp.attention.rank, dp.attention.world_size, dp.rows.rank, dp.rows.world_size) == (a, 2, g, 2)
    # The attention's sums stay within a DP group: 1 + 2 in group 0, 3 + 4 in group 1.
    assert dp.attention.all_reduce(torch.tensor([group.rank + 1.0])).item() == [3.0, 7.0][g]
    # A group's ranks hold the same rows (group 0: 3 rows, group 1: 1 row): each group's gathered once, padded to 3,
    # the same on every rank; each rank keeps its group's.
    counts = [3, 1]
    rows = torch.arange(counts[g] * 2.0).view(-1, 2) + 10 * g
    gathered = dp.rows.gather_rows(rows, counts)
    assert torch.equal(gathered, torch.tensor([[0.0, 1], [2, 3], [4, 5], [10, 11], [0, 0], [0, 0]]))
    assert torch.equal(dp.rows.own_rows(gathered, counts), rows)


def test_dp_groups_sum_within_a_group_and_gather_each_groups_rows_once() -> None:
    run_ranks(_dp_groups_of_two, world_size=4)


def test_dp_groups_of_one_rank_need_no_subgroups() -> None:
    """One rank a group (--dp-size = --tp-size): the attention whole, the rows gathered over the world."""
    world = ParallelGroup(1, 2)
    assert dp_groups(world, 2).attention is SINGLE and dp_groups(world, 2).rows is world
    with pytest.raises(ValueError, match="4 ranks do not split into 3 DP attention groups"):
        dp_groups(ParallelGroup(0, 4), 3)


def _one_rank_leaves(group: ParallelGroup) -> None:
    if group.rank == 1:
        return  # leaves the world without joining the collective
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        group.all_reduce(torch.ones(4))
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT_S + 5


def test_a_collective_whose_peer_left_fails_rather_than_hangs() -> None:
    run_ranks(_one_rank_leaves)


def _last_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """One EXTEND of `ids` through `runner` -> the last position's logits [1, vocab] float32."""
    pages = runner.allocator.alloc(pages_needed(len(ids), runner.page_size))
    try:
        table = torch.tensor([pages], dtype=torch.int32, device=runner.device)
        batch = runner.prepare(ForwardBatch.build(ForwardMode.EXTEND, [len(ids)], [len(ids)], table, runner.pool))
        return runner.forward(torch.tensor(ids, device=runner.device), batch,
                              torch.tensor([len(ids) - 1], device=runner.device))
    finally:
        runner.allocator.free(pages)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU")
def test_one_nccl_rank_runs_the_model_as_one_process_does() -> None:
    """World size 1 over NCCL (what one lent GPU allows): the model built on a torch.distributed group gives the
    one-process logits, and a collective really runs on NCCL."""
    group = init_parallel_group(0, 1, f"tcp://127.0.0.1:{pick_free_port()}", "cuda")
    try:
        x = torch.ones(4, device="cuda")
        torch.distributed.all_reduce(x, group=group.group)
        assert torch.distributed.get_backend(group.group) == "nccl" and torch.equal(x, torch.ones(4, device="cuda"))
        args = ServerArgs(model_preset="tiny", device="cuda", max_total_tokens=256, disable_cuda_graph=True)
        ids = list(range(5, 40))
        assert torch.equal(_last_logits(ModelRunner(args, group), ids), _last_logits(ModelRunner(args), ids))
    finally:
        destroy_parallel_group()


def _objects_outwait_the_collective_timeout(group: ParallelGroup) -> None:
    if group.rank == 0:
        time.sleep(IDLE_S)  # a server with nothing to do
    assert group.broadcast_object(["next batch"] if group.rank == 0 else None) == ["next batch"]
    x = torch.full((2,), group.rank + 1.0)
    assert torch.equal(group.all_reduce(x), torch.full((2,), 3.0))  # the collectives still run


IDLE_S = 8.0  # its half, the collectives' timeout, also bounds the rendezvous of ranks slow to start


def test_a_worker_waits_for_the_next_batch_longer_than_the_collective_timeout() -> None:
    """Workers wait for rank 0's next batch as long as the server idles: objects go over the `control` group,
    whose timeout is not the collectives' (a rank failing at the timeout killed an idle server)."""
    run_ranks(_objects_outwait_the_collective_timeout, timeout_s=IDLE_S / 2)


def test_comm_routes_pick_the_order_of_the_smallest_bucket_that_holds_the_size() -> None:
    small, large, reference = object(), object(), object()  # stand-ins: routing never calls them
    routes = CommRoutes((small, large, reference), (16, 64),  # type: ignore[arg-type]
                        ((small, reference), (large, reference)))  # type: ignore[arg-type]
    assert [routes.backends(n)[0] for n in (1, 16, 17, 64, 1 << 30)] == [small, small, large, large, large]
    assert CommRoutes.declared((small, reference)).backends(1 << 30) == (small, reference)  # type: ignore[arg-type]
    assert CommRoutes().backends(8) == ()
    with pytest.raises(ValueError, match="2 size edges need as many orders, not 1"):
        CommRoutes((small,), (16, 64), ((small,),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must increase"):
        CommRoutes((small,), (64, 16), ((small,), (small,)))  # type: ignore[arg-type]


def _sleep(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def _raise(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke")


def test_spawned_processes_that_outlast_their_time_are_killed_and_a_raise_reaches_the_caller() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"sleepers still running after 3\.0 s"):
        spawn_joined(_sleep, (60.0,), 2, 3.0, "sleepers")
    assert time.monotonic() - start < 30  # killed, not waited for
    with pytest.raises(Exception, match="rank 1 broke"):
        spawn_joined(_raise, (), 2, 60.0, "raisers")
