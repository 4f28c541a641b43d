"""The symmetric-memory one-shot all-reduce: NCCL's sums on 2 GPUs, eagerly and in CUDA-graph replay, through the
chain `ParallelGroup.all_reduce` walks (by declared priority: no measured table); larger messages and other ops stay
with NCCL; a world without a measured size is not one it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plugserve.core.distributed import ParallelGroup
from plugserve.core.forward_batch import Phase
from plugserve.core.hardware import Hardware
from plugserve.core.specs import CommSpec
from plugserve.plugins.comm.symmetric_memory import ONE_SHOT_MAX_BYTES, SymmetricMemoryAllReduce
from plugserve.registry import TABLES_ENV
from plugserve.runtime.comm import build_comm
from plugserve.runtime.server_args import ServerArgs
from tests.multiprocess import needs_gpus, run_ranks


def test_it_runs_the_measured_worlds_of_one_node_on_gpus_only() -> None:
    caps = SymmetricMemoryAllReduce.capabilities
    assert 3 not in ONE_SHOT_MAX_BYTES
    assert "measured for worlds of 2, 4 ranks only, not 3" in caps.check(CommSpec(3), Phase.DECODE).reason
    assert "runs within one host, not over 2 nodes" in caps.check(CommSpec(2, nodes=2), Phase.DECODE).reason
    assert caps.check(CommSpec(2), Phase.DECODE)
    assert "runs on cuda, not cpu" in SymmetricMemoryAllReduce.availability(Hardware.detect("cpu")).reason


def _sums_as_nccl(group: ParallelGroup) -> None:
    device = torch.device("cuda", group.rank)
    comm, status = build_comm(ServerArgs(model_preset="tiny", tp_size=2), group, device, torch.bfloat16)
    assert [b.name for b in comm.chain] == ["symmetric_memory", "torch_ref"], status
    assert status == "symmetric_memory up to 2048 KiB, torch_ref (nccl) above, by declared priority"
    fast = comm.chain[0]
    group = group.with_comm(comm)
    generator = torch.Generator(device=device).manual_seed(group.rank)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 2048, device=device, generator=generator).bfloat16()
        want = x.clone()
        dist.all_reduce(want)
        assert fast.takes(x)
        got = group.all_reduce(x)
        assert got is not x and torch.equal(got, want)
    # Captured in a CUDA graph, replayed on new inputs.
    static = torch.zeros(8, 2048, device=device, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        group.all_reduce(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = group.all_reduce(static)
    for step in range(3):
        static.copy_(torch.full_like(static, float(group.rank + step)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(static, float(1 + 2 * step)))
    # Too large, another dtype or another op: NCCL, in place.
    large = torch.ones(ONE_SHOT_MAX_BYTES[2] // 2 + 1, device=device, dtype=torch.bfloat16)
    assert not fast.takes(large) and group.all_reduce(large) is large and bool((large == 2).all())
    single = torch.ones(4, device=device)
    assert group.all_reduce(single) is single and bool((single == 2).all())
    smallest = torch.tensor([5 - group.rank], device=device)
    assert group.all_reduce(smallest, dist.ReduceOp.MIN).item() == 4


@needs_gpus(2)
def test_one_shot_all_reduce_sums_as_nccl_in_and_out_of_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    monkeypatch.setenv(TABLES_ENV, str(tmp_path))  # no measured order: the declared chain (the ranks inherit it)
    run_ranks(_sums_as_nccl, device="cuda")
