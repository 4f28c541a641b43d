"""The gather-then-sum all-reduce over gloo on the CPU: sums as a float64 oracle does, each element's bits the same
whatever message it travels in (batch invariance), and the chain that --enable-deterministic-inference builds: it
alone, where every other backend says why not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plugserve.core.distributed import ParallelGroup
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.specs import CommSpec
from plugserve.plugins.comm.gather_sum import GatherSumAllReduce
from plugserve.registry import SelectionError, get_registry
from plugserve.runtime.comm import build_comm
from plugserve.runtime.server_args import ServerArgs
from tests.multiprocess import run_ranks

CPU = torch.device("cpu")


def _sums_as_the_oracle_and_invariantly(group: ParallelGroup, dtype: torch.dtype) -> None:
    backend = GatherSumAllReduce(CommSpec(group.world_size, dtype), CPU)
    generator = torch.Generator().manual_seed(7)
    everyone = [torch.randn(64, 96, generator=generator).to(dtype) for _ in range(group.world_size)]
    mine = everyone[group.rank]
    got = backend.all_reduce(mine.clone())
    oracle = torch.stack([x.double() for x in everyone]).sum(0)
    assert got.dtype == dtype and got.shape == mine.shape
    torch.testing.assert_close(got.double(), oracle, rtol=torch.finfo(dtype).eps, atol=1e-6)
    # Rows 5-8 alone, inside the whole message, and inside messages of other sizes: the same bits.
    for rows in (slice(5, 9), slice(0, 9), slice(3, 41)):
        part = backend.all_reduce(mine[rows].clone())
        start = 5 - rows.start
        assert torch.equal(part[start:start + 4], got[5:9])
    assert torch.equal(backend.all_reduce(mine[5:9, 10:20].contiguous()), got[5:9, 10:20])
    assert torch.equal(mine, everyone[group.rank])  # its input as it was


def test_it_sums_as_a_float64_oracle_and_each_element_alike_in_any_message() -> None:
    # float32: three bf16 values add exactly in float32 in any order, so only float32 shows a size-dependent order.
    run_ranks(_sums_as_the_oracle_and_invariantly, torch.float32, world_size=3)


def _deterministic_chain(group: ParallelGroup) -> None:
    args = ServerArgs(model_preset="tiny", device="cpu", tp_size=3, enable_deterministic_inference=True)
    comm, status = build_comm(args, group, CPU, torch.float32)
    assert [b.name for b in comm.chain] == ["gather_sum"], status
    assert status == "gather_sum, by declared priority"
    x = torch.full((2, 8), float(group.rank + 1))
    assert torch.equal(group.with_comm(comm).all_reduce(x), torch.full((2, 8), 6.0))
    default, _ = build_comm(ServerArgs(model_preset="tiny", device="cpu", tp_size=3), group, CPU, torch.float32)
    assert [b.name for b in default.chain] == ["torch_ref"]  # auto keeps NCCL / gloo without the flag
    named = ServerArgs(model_preset="tiny", device="cpu", tp_size=3, enable_deterministic_inference=True,
                       all_reduce_backend="torch_ref")
    with pytest.raises(SelectionError, match=r"--all-reduce-backend: .*not batch-invariant"):
        build_comm(named, group, CPU, torch.float32)
    dist.barrier()


def test_deterministic_inference_sums_through_it_alone() -> None:
    run_ranks(_deterministic_chain, world_size=3)


def test_the_others_say_why_they_do_not_serve_deterministic_inference() -> None:
    spec = CommSpec(3, torch.float32, batch_invariant=True)
    reference = get_registry().get("comm", "torch_ref").cls
    assert "order of summation follows the message's size" in reference.capabilities.check(spec, Phase.DECODE).reason
    assert GatherSumAllReduce.capabilities.check(spec, Phase.DECODE)
    assert GatherSumAllReduce.availability(Hardware.detect(CPU))
