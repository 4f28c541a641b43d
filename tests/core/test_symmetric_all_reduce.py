"""The symmetric-memory one-shot all-reduce: NCCL's sums on 2 GPUs, eagerly and in CUDA-graph replay, through
`ParallelGroup.all_reduce`; larger messages and other ops stay with NCCL; no measured size, no fast path."""

from __future__ import annotations

import torch
import torch.distributed as dist

from plugserve.core.distributed import ParallelGroup
from plugserve.core.symmetric_all_reduce import ONE_SHOT_MAX_BYTES, build_symmetric_all_reduce
from tests.multiprocess import needs_gpus, run_ranks


def test_without_a_measured_size_for_the_world_every_all_reduce_is_nccl() -> None:
    assert 3 not in ONE_SHOT_MAX_BYTES
    fast, reason = build_symmetric_all_reduce(None, 3, torch.device("cpu"), torch.bfloat16)  # type: ignore[arg-type]
    assert fast is None and "no measured one-shot size for 3 ranks" in reason


def _sums_as_nccl(group: ParallelGroup) -> None:
    device = torch.device("cuda", group.rank)
    fast, reason = build_symmetric_all_reduce(group.group, group.world_size, device, torch.bfloat16)
    assert fast is not None, reason
    group = group.with_small_all_reduce(fast)
    generator = torch.Generator(device=device).manual_seed(group.rank)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 2048, device=device, generator=generator).bfloat16()
        want = x.clone()
        dist.all_reduce(want)
        assert fast.applies(x)
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
    large = torch.ones(fast.max_bytes // 2 + 1, device=device, dtype=torch.bfloat16)
    assert not fast.applies(large) and group.all_reduce(large) is large and bool((large == 2).all())
    single = torch.ones(4, device=device)
    assert group.all_reduce(single) is single and bool((single == 2).all())
    smallest = torch.tensor([5 - group.rank], device=device)
    assert group.all_reduce(smallest, dist.ReduceOp.MIN).item() == 4


@needs_gpus(2)
def test_one_shot_all_reduce_sums_as_nccl_in_and_out_of_graphs() -> None:
    run_ranks(_sums_as_nccl, device="cuda")
