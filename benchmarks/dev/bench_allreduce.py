"""All-reduce latency per message size on every GPU of this machine, inside CUDA-graph replay: NCCL against
torch's symmetric-memory one-shot and two-shot kernels and FlashInfer's TRT-LLM all-reduce (alone, and fused
with the residual add and RMSNorm), each checked against NCCL's sum first.

    python -m benchmarks.dev.bench_allreduce --hidden 2048 7168 --tokens 1 8 32 64 128 256 --output ar.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Method = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _methods(group_name: str, max_elems: int, hidden: int, max_tokens: int, rank: int, world: int
             ) -> dict[str, Method]:
    """name -> f(x, residual) returning the sum of x over the ranks (the fused one: RMSNorm(sum + residual))."""
    methods: dict[str, Method] = {}

    def nccl(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    methods["nccl"] = nccl
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(max_elems, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buffer, group_name)
        ops = torch.ops.symm_mem

        def one_shot(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return ops.one_shot_all_reduce_copy(buffer[: x.numel()], x.view(-1), "sum", group_name).view_as(x)

        def two_shot(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            staged = buffer[: x.numel()]
            staged.copy_(x.view(-1))
            ops.two_shot_all_reduce_(staged, "sum", group_name)
            return staged.view_as(x)

        methods["symm_one_shot"] = one_shot
        methods["symm_two_shot"] = two_shot
    except Exception:
        traceback.print_exc()
    try:
        from flashinfer import comm

        workspace = comm.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=world, rank=rank, max_token_num=max_tokens, hidden_dim=hidden,
            dtype=torch.bfloat16, group=dist.group.WORLD)
        gamma = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")

        def flashinfer(x: torch.Tensor, residual: torch.Tensor, oneshot: bool | None = None) -> torch.Tensor:
            out = torch.empty_like(x)
            comm.allreduce_fusion(x, workspace, pattern=comm.AllReduceFusionPattern.kAllReduce, output=out,
                                  launch_with_pdl=True, use_oneshot=oneshot)
            return out

        def flashinfer_norm(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            norm, residual_out = torch.empty_like(x), torch.empty_like(x)
            comm.allreduce_fusion(x, workspace, pattern=comm.AllReduceFusionPattern.kARResidualRMSNorm,
                                  residual_in=residual, residual_out=residual_out, norm_out=norm, rms_gamma=gamma,
                                  rms_eps=1e-6, launch_with_pdl=True)
            return norm

        methods["flashinfer"] = flashinfer
        methods["flashinfer_oneshot"] = lambda x, r: flashinfer(x, r, True)
        methods["flashinfer_twoshot"] = lambda x, r: flashinfer(x, r, False)
        methods["flashinfer_add_rmsnorm"] = flashinfer_norm
    except Exception:
        traceback.print_exc()
    return methods


def _rmsnorm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _time_in_graph(method: Method, x: torch.Tensor, residual: torch.Tensor, calls: int, replays: int) -> float:
    """Microseconds per call of `method`, `calls` of them captured in one graph, the graph replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            method(x, residual)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            method(x, residual)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def _worker(rank: int, world: int, port: int, namespace: argparse.Namespace, queue: mp.Queue) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300), device_id=torch.device("cuda", rank))
    rows = []
    max_tokens = max(namespace.tokens)
    for hidden in namespace.hidden:
        methods = _methods(dist.group.WORLD.group_name, max_tokens * hidden, hidden, max_tokens, rank, world)
        for tokens in namespace.tokens:
            generator = torch.Generator(device="cuda").manual_seed(rank)
            base = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
            residual = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16,
                                   generator=torch.Generator(device="cuda").manual_seed(99))
            expected = base.float().clone()
            dist.all_reduce(expected)
            for name, method in methods.items():
                row = {"world": world, "hidden": hidden, "tokens": tokens, "bytes": tokens * hidden * 2, "method": name}
                try:
                    got = method(base.clone(), residual).float()
                    want = _rmsnorm((expected + residual.float()).bfloat16()).float() if "rmsnorm" in name else expected
                    row["max_err"] = (got - want).abs().max().item()
                    row["us"] = _time_in_graph(method, base.clone(), residual, namespace.calls, namespace.replays)
                except Exception as error:
                    row["error"] = f"{type(error).__name__}: {error}"[:300]
                rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    parser.add_argument("--calls", type=int, default=20, help="all-reduces captured in one graph")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--output", default=None, help="write the rows here as JSON")
    namespace = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from plugserve.core.distributed import pick_free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = pick_free_port()
    processes = [context.Process(target=_worker, args=(rank, namespace.world, port, namespace, queue))
                 for rank in range(namespace.world)]
    for process in processes:
        process.start()
    rows = queue.get(timeout=900)
    for process in processes:
        process.join()
    print(f"{'world':>5} {'hidden':>6} {'tokens':>6} {'KiB':>7}  {'method':<24} {'us':>8} {'max_err':>8}")
    for row in rows:
        us = f"{row['us']:8.2f}" if "us" in row else row.get("error", "")[:80]
        print(f"{row['world']:5d} {row['hidden']:6d} {row['tokens']:6d} {row['bytes'] / 1024:7.1f}  "
              f"{row['method']:<24} {us:>8} {row.get('max_err', float('nan')):8.3g}")
    if namespace.output:
        with open(namespace.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
