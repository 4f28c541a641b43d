"""The backend shootout: every usable backend of a kind on one shape grid, in one process, on one device,
side by side with the device's own ceilings measured in the same run.

    python benchmarks/shootout.py --kinds attention gemm moe --output-dir benchmarks/results/<gpu>/shootout
    python benchmarks/shootout.py --tp-size 8 [--ep-size 8] ...   # one rank's shapes of an 8-GPU deployment
    python benchmarks/shootout.py --kinds attention --heads 16 --merge-into plugserve/tables/<gpu>.json ...
                                  # attention's ranking at 16 heads a rank, beside the table's 128
    python benchmarks/shootout.py --kinds gemm --backends gemm:triton gemm:torch_scaled_mm \\
        --merge-into plugserve/tables/<gpu>.json ...   # those two re-ranked where they stand in the table
    python benchmarks/shootout.py --kinds comm --output-dir ... [--merge-into plugserve/tables/<gpu>.json]
                                  # all-reduces at 2, 4, 8 ranks (as many as there are GPUs), ranked per size

For each case and backend: time (CUDA events after warm-up, median of --reps), achieved GB/s and
TFLOP/s, and the fraction of the limit, where limit = max(bytes / measured memory GB/s, flops / measured
dense TFLOP/s of the dtype); on a GPU each timed replay starts with a cold L2 (as in a model's step), and a
fraction above 1 fails the run (the limit or the case's byte count would be wrong). Writes shootout.json,
shootout.md, one PNG per kind, and the selection table `auto` reads (`<device_key>.json`, to copy into
plugserve/tables/), ranking backends per kind, phase and batch bucket by measured time.

comm (all-reduces, not run by default): for each world of 2, 4 and 8 ranks the visible GPUs allow, one spawned
process per rank (the CPU: two gloo ranks, to test the flow) builds every usable comm backend as serving does
(runtime/comm.py), checks its sum of each message against the group's own all-reduce (a backend that sums wrong is
printed and not ranked) and times it: CUDA-graph replay of COMM_CALLS sums, the median replay, the slowest rank's.
An all-reduce has no limit here (its fraction is left empty); the table ranks backends per world and message size
(`comm`: buckets of max_bytes, fastest first), which serving's all-reduces follow.

Shapes are one rank's (--tp-size P, --ep-size E), sliced as the model slices them (ModelConfig.attention_spec /
moe_spec, core/layers/parallel.py): attention at heads / P; GEMMs at DeepSeek-V3's projections' per-rank [N, K];
MoE experts at width I / P (tensor-parallel) or n / P experts of width I (expert-parallel, rank 0's). The JSON
files record P and E.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import gpu_timing
from plugserve.conformance.batches import random_batch
from plugserve.conformance.comm_ranks import run_ranks
from plugserve.core.config import ModelConfig, ModelConfigError, preset_config
from plugserve.core.dispatch import prepare_attention
from plugserve.core.distributed import ParallelGroup
from plugserve.core.forward_batch import ForwardMode, Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import CommBackend, MoEWeights
from plugserve.core.layers.quant import quantize_block_fp8
from plugserve.core.specs import KV_DTYPES, AttentionSpec, CommSpec, GemmSpec, MoESpec
from plugserve.registry import BATCH_BUCKETS, comm_order_line, get_registry, merged_neighbours, size_name
from plugserve.runtime.comm import agreed, build_checked, sum_mismatch

# The models whose shapes the shootout measures: GEMMs of the first, MoE layers of each (--quick: "tiny").
GEMM_MODEL = "deepseek-v3"
MOE_MODELS = ("deepseek-v3", "deepseek-v2-lite")
QUICK_MODEL = "tiny"
# The all-reduces measured, (tokens, hidden) of --dtype: DeepSeek-V3's hidden from a decode step of one token to a
# prefill chunk, and a small model's single token (--quick: two small ones).
COMM_CASES = [*((t, 7168) for t in (1, 8, 32, 64, 128, 256, 512)), (1, 2048)]
QUICK_COMM_CASES = [(1, 2048), (8, 2048)]
COMM_WORLDS = (2, 4, 8)  # the tensor-parallel groups of one node; the CPU's gloo ranks run 2 (to test the flow)
COMM_CALLS = {"cuda": 20, "cpu": 3}  # all-reduces per timed sample: one graph's (CUDA), or a loop's (CPU)
COMM_TIMEOUT_S = 600.0  # a world's ranks, start to end (NCCL's start-up at eight ranks included)


@dataclass
class Case:
    kind: str
    phase: str
    shape: str
    batch: int  # tokens (attention decode: requests), for the selection table's buckets
    bytes: float
    flops: float
    flop_dtype: str  # which measured TFLOP/s ceiling applies: "bf16" or "fp8"


@dataclass
class Row:
    kind: str
    phase: str
    shape: str
    backend: str
    us: float
    gbps: float
    tflops: float
    fraction_of_limit: float | None  # None for comm: an all-reduce's limit is the link's, not measured here
    batch: int
    timing: str  # "graph", "events" or "wall": see timed() (comm: time_all_reduce())
    library_us: float | None = None  # the backend's library called directly on the same inputs (no wrapper)
    world: int | None = None  # comm: the ranks that summed
    message_bytes: int | None = None  # comm: the bytes each rank's message holds

    @property
    def wrapper_overhead(self) -> float | None:
        """What plugserve's wrapper adds over calling the library directly, as a fraction of the latter."""
        return None if self.library_us is None else self.us / self.library_us - 1


# -- timing ------------------------------------------------------------------------------------------


def timed(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> tuple[float, str]:
    """Median seconds of fn() after warm-up, and how it was timed: "graph" (CUDA-graph replay, so host
    launch overhead is excluded alike for every backend), else "events" (CUDA events around eager calls:
    fn syncs with the host or cannot be captured) or "wall" on the CPU. On a GPU the L2 is flushed before each
    timed call."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
        return statistics.median(samples), "wall"
    graph = _capture(fn)
    run = graph.replay if graph is not None else fn
    flush = torch.empty(gpu_timing.FLUSH_BYTES, dtype=torch.uint8, device=device)
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()  # a cold L2, outside the timed events
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples), "graph" if graph is not None else "events"


def _capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
    """fn captured in a CUDA graph, or None when it cannot be (a host sync, a CPU tensor op...)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception:  # any capture failure means: time it eagerly
        torch.cuda.synchronize()
        return None
    return graph


def measure_ceilings(device: torch.device, quick: bool) -> dict[str, float]:
    """Read GB/s (a read-only stream), copy GB/s (read + write), memory GB/s (the faster: the limit's), dense bf16
    and fp8 TFLOP/s, measured here and now."""
    n_bytes = (2 << 30) if not quick else (64 << 20)
    ceilings = gpu_timing.memory_ceilings(device, n_bytes)
    size = 8192 if not quick else 512
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    bf16_s, _ = timed(lambda: a @ b, device, 3, 10)
    ceilings["bf16_tflops"] = 2 * size**3 / bf16_s / 1e12
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        fp8_s, _ = timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), device, 3, 10)
        ceilings["fp8_tflops"] = 2 * size**3 / fp8_s / 1e12
    else:
        ceilings["fp8_tflops"] = ceilings["bf16_tflops"]
    return ceilings


# -- cases -------------------------------------------------------------------------------------------


def attention_decode_cases(quick: bool) -> list[tuple[int, int]]:
    return [(1, 64), (4, 256)] if quick else [(b, kv) for b in (1, 8, 32, 64, 128) for kv in (512, 2048, 8192, 32768)]


def attention_extend_cases(quick: bool) -> list[tuple[int, int]]:
    return [(64, 0), (64, 128)] if quick else [(t, p) for t in (512, 4096, 16384) for p in (0, 4096)]


def gemm_shapes(config: ModelConfig, tp_size: int) -> list[tuple[int, int]]:
    """[N, K] of every block-FP8 GEMM weight one of `tp_size` ranks holds (core/layers/parallel.py): q_a ++ kv_a
    replicated (without q LoRA, q_proj's H/P heads ++ kv_a), q_b and kv_b column-parallel by heads, o_proj
    row-parallel, the dense MLP's and shared experts' gate ++ up column- and down row-parallel (also under
    expert parallelism, which splits only the routed experts). Raises ModelConfigError when a width does not
    split over the ranks."""
    c = config
    heads = c.attention_spec(torch.bfloat16, tp_size=tp_size).num_heads
    latent = c.kv_lora_rank + c.qk_rope_head_dim

    def split(what: str, size: int) -> int:
        if size % tp_size:
            raise ModelConfigError(f"{what} {size} does not split over {tp_size} tensor-parallel ranks")
        return size // tp_size

    shapes = [(c.q_lora_rank + latent, c.hidden_size), (heads * c.qk_head_dim, c.q_lora_rank)] if c.q_lora_rank \
        else [(heads * c.qk_head_dim + latent, c.hidden_size)]
    shapes += [(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), (c.hidden_size, heads * c.v_head_dim)]
    mlps = [("intermediate_size", c.intermediate_size)]
    if c.n_shared_experts:
        mlps.append(("the shared experts' intermediate size", c.n_shared_experts * c.moe_intermediate_size))
    for what, width in mlps:
        shapes += [(2 * split(what, width), c.hidden_size), (c.hidden_size, split(what, width))]
    return shapes


def library_call(backend: str, function: str) -> Callable[..., Callable[[], object]] | None:
    """`function` of benchmarks/library_calls/<backend>.py: it sets up and returns a call of the backend's
    library made directly, without plugserve (None when there is none, or its library is missing)."""
    package = f"{__package__}.library_calls" if __package__ else "library_calls"  # as a module, or as a script
    try:
        module = importlib.import_module(f"{package}.{backend}")
    except ImportError as exc:
        if getattr(exc, "name", None) != f"{package}.{backend}":  # not merely "no library call for it"
            print(f"library_calls.{backend}: {exc}", file=sys.stderr)
        return None
    return getattr(module, function, None)


def attention_phases(quick: bool, kv_cache_dtypes: list[str]) -> list[tuple[Phase, str, list[tuple[int, int]]]]:
    """(phase, --kv-cache-dtype, cases): decode once per KV dtype asked for, prefill (MHA over k / v the model
    dequantized: no cache read) once."""
    return [*((Phase.DECODE, kv, attention_decode_cases(quick)) for kv in kv_cache_dtypes),
            (Phase.PREFILL, "auto", attention_extend_cases(quick))]


def run_attention(backends: list, device: torch.device, dtype: torch.dtype, heads: int, args, emit) -> None:
    """Decode rows per --kv-cache-dtype (an fp8 row's shape ends in "fp8kv" and counts one byte a cached value),
    then the prefill rows."""
    registry, hardware = get_registry(), Hardware.detect(device)
    for phase, kv_cache_dtype, cases in attention_phases(args.quick, args.kv_cache_dtype):
        fp8 = kv_cache_dtype == "fp8_e4m3"
        spec = AttentionSpec(num_heads=heads, dtype=dtype, page_size=args.page_size,
                             kv_cache_dtype=KV_DTYPES.get(kv_cache_dtype))
        for first, second in cases:
            if phase is Phase.DECODE:
                batch_size, kv = first, second
                mode, seq_lens, extend_lens = ForwardMode.DECODE, [kv] * batch_size, [1] * batch_size
                kv_bytes = batch_size * kv * (spec.kv_lora_rank + spec.qk_rope_head_dim) * spec.kv_dtype.itemsize
                flops = 2 * batch_size * heads * kv * (spec.kv_lora_rank * 2 + spec.qk_rope_head_dim)
                shape = f"decode b{batch_size} kv{kv} h{heads}" + (" fp8kv" if fp8 else "")
                case = Case("attention", phase.value, shape, batch_size, kv_bytes, flops, "bf16")
            else:
                tokens, prefix = first, second
                per_request = min(tokens, 4096)
                n = max(1, tokens // per_request)
                mode, seq_lens, extend_lens = ForwardMode.EXTEND, [prefix + per_request] * n, [per_request] * n
                visible = n * sum(prefix + i + 1 for i in range(per_request))
                flops = 2 * heads * visible * (spec.qk_head_dim + spec.v_head_dim)
                io = n * (prefix + per_request) * heads * (spec.qk_head_dim + spec.v_head_dim) * 2
                case = Case("attention", phase.value, f"extend t{tokens} prefix{prefix} h{heads}", tokens, io, flops,
                            "bf16")
            for entry in backends:
                if not registry.usability(entry.cls, phase, hardware, spec):
                    continue
                batch = random_batch(mode, seq_lens, extend_lens, spec, device, num_layers=1)
                backend = entry.cls(spec, device)
                t = batch.num_tokens
                if phase is Phase.DECODE:
                    q_nope = torch.randn(t, heads, spec.kv_lora_rank, device=device, dtype=dtype)
                    q_rope = torch.randn(t, heads, spec.qk_rope_head_dim, device=device, dtype=dtype)
                    backend.plan(batch)
                    run = partial(backend.forward_mla, q_nope, q_rope, 0)
                    direct = None if fp8 else library_call(entry.name, "mla_decode")  # libraries read q's dtype
                    library = direct and partial(direct, q_nope, q_rope, batch.kv_pool.buffer(0), batch.block_table,
                                                 batch.seq_lens, spec.page_size, spec.softmax_scale)
                else:
                    # One-shot MHA over the (de-compressed) prefix and the new tokens.
                    prepare_attention(batch, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=1 << 30)
                    kv_tokens = sum(seq_lens)
                    q = torch.randn(t, heads, spec.qk_head_dim, device=device, dtype=dtype)
                    k = torch.randn(kv_tokens, heads, spec.qk_head_dim, device=device, dtype=dtype)
                    v = torch.randn(kv_tokens, heads, spec.v_head_dim, device=device, dtype=dtype)
                    backend.plan(batch)
                    run = partial(backend.forward_mha, q, k, v)
                    direct = library_call(entry.name, "mha_prefill")
                    cu_kv = [0, *itertools.accumulate(seq_lens)]
                    library = direct and partial(direct, q, k, v, batch.cu_extend_lens,
                                                 torch.tensor(cu_kv, dtype=torch.int32, device=device),
                                                 max(extend_lens), max(seq_lens), spec.softmax_scale, True)
                emit(case, entry.name, *timed(run, device, args.warmup, args.reps_for(entry.name)),
                     library=time_library(library, device, args))


def run_gemm(backends: list, device: torch.device, dtype: torch.dtype, args, emit) -> None:
    registry, hardware = get_registry(), Hardware.detect(device)
    spec = GemmSpec(dtype=dtype)
    shapes = gemm_shapes(preset_config(QUICK_MODEL if args.quick else GEMM_MODEL), args.tp_size)
    ms = [1, 8] if args.quick else [1, 8, 64, 256, 1024, 4096]
    for n, k in shapes:
        w_q, scale = quantize_block_fp8(torch.randn(n, k, device=device) / k**0.5, (128, 128))
        for m in ms:
            case = Case("gemm", (Phase.DECODE if m <= 256 else Phase.PREFILL).value, f"m{m} n{n} k{k}", m,
                        n * k + m * k * 2 + m * n * 2, 2 * m * n * k, "fp8")
            x = torch.randn(m, k, device=device, dtype=dtype)
            for entry in backends:
                if not registry.usability(entry.cls, Phase.DECODE, hardware, spec):
                    continue
                backend = entry.cls(spec, device)
                packed = backend.prepare(w_q, scale)
                direct = library_call(entry.name, "gemm")
                emit(case, entry.name, *timed(partial(backend.apply, x, packed), device, args.warmup,
                                              args.reps_for(entry.name)),
                     library=time_library(direct and partial(direct, x, w_q, scale), device, args))


def moe_specs(dtype: torch.dtype, tp_size: int, ep_size: int, quick: bool) -> list[MoESpec]:
    """Rank 0's routed experts of each measured model as it is published and served: V3's block-FP8, V2-Lite's
    (and the quick model's) in the activation dtype (ModelConfig.moe_spec: width I / P under tensor parallelism,
    n / P whole experts under expert parallelism). Raises ModelConfigError when a model does not split over the
    ranks."""
    return [preset_config(name).moe_spec(dtype, tp_size, ep_size, 0)
            for name in ((QUICK_MODEL,) if quick else MOE_MODELS)]


def expert_weights(spec: MoESpec, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random local experts of `spec`: (w13 [E_l, 2I, H], w2 [E_l, H, I]) in the activation dtype, or block-FP8
    with their scales (w13, w2, w13_scale_inv, w2_scale_inv)."""
    hidden, inter, local = spec.hidden_size, spec.intermediate_size, spec.num_local_experts
    w13 = [torch.randn(2 * inter, hidden, device=device) / hidden**0.5 for _ in range(local)]
    w2 = [torch.randn(hidden, inter, device=device) / inter**0.5 for _ in range(local)]
    if not spec.is_fp8:
        return torch.stack(w13).to(spec.dtype), torch.stack(w2).to(spec.dtype)
    q13, s13 = zip(*(quantize_block_fp8(w, spec.block_shape) for w in w13), strict=True)
    q2, s2 = zip(*(quantize_block_fp8(w, spec.block_shape) for w in w2), strict=True)
    return torch.stack(q13), torch.stack(q2), torch.stack(s13), torch.stack(s2)


def moe_case(spec: MoESpec, dtype: torch.dtype, topk_ids: torch.Tensor) -> Case:
    """One MoE forward of topk_ids [T, k] global ids on this rank (`spec`'s local experts): bytes, the activated local
    experts' weights (3 matrices each) and the activations in and out; flops, the pairs this rank computes."""
    tokens, hidden, inter = topk_ids.shape[0], spec.hidden_size, spec.intermediate_size
    router, local, first = spec.router, spec.num_local_experts, spec.first_expert
    experts = f"e{router.num_experts}" if local == router.num_experts else f"e{local}of{router.num_experts}"
    mine = topk_ids[(topk_ids >= first) & (topk_ids < first + local)]  # the pairs this rank computes
    weight_bytes = int(mine.unique().numel()) * 3 * hidden * inter * (1 if spec.is_fp8 else dtype.itemsize)
    return Case("moe", (Phase.DECODE if tokens <= 512 else Phase.PREFILL).value,
                f"t{tokens} {experts}top{router.top_k} h{hidden} i{inter}"
                + ("" if spec.is_fp8 else f" {str(dtype).removeprefix('torch.')}"), tokens,
                weight_bytes + tokens * hidden * 4, 2 * int(mine.numel()) * 3 * hidden * inter,
                "fp8" if spec.is_fp8 else "bf16")


def limit_seconds(case: Case, ceilings: dict[str, float]) -> float:
    """The case's limit: max(bytes read and written / measured memory rate (memory_gbps), flops / measured dense
    rate of its flop dtype). Writes count at that rate too: a lower bound on the time, so no fraction can pass 1."""
    tflops_ceiling = ceilings["fp8_tflops" if case.flop_dtype == "fp8" else "bf16_tflops"]
    return max(case.bytes / (ceilings["memory_gbps"] * 1e9), case.flops / (tflops_ceiling * 1e12))


def run_moe(backends: list, device: torch.device, dtype: torch.dtype, args, emit) -> None:
    registry, hardware = get_registry(), Hardware.detect(device)
    for spec in moe_specs(dtype, args.tp_size, args.ep_size, args.quick):
        router, hidden, e = spec.router, spec.hidden_size, spec.router.num_experts
        weights = expert_weights(spec, device)
        for tokens in ([1, 8] if args.quick else [1, 8, 64, 512, 4096]):
            x = torch.randn(tokens, hidden, device=device, dtype=dtype)
            logits = torch.randn(tokens, e, device=device)
            bias = torch.randn(e, device=device) * 0.1 if router.topk_method == "noaux_tc" else None
            for entry in backends:
                if not registry.usability(entry.cls, Phase.DECODE, hardware, spec):
                    continue
                backend = entry.cls(spec, device)
                topk_weights, topk_ids = backend.route(logits, bias)
                case = moe_case(spec, dtype, topk_ids)
                packed = backend.prepare(MoEWeights(*weights))
                run = partial(backend.forward, x, packed, topk_ids, topk_weights, router.routed_scaling_factor)
                emit(case, entry.name, *timed(run, device, args.warmup, args.reps_for(entry.name)))


def comm_worlds(device: torch.device) -> list[int]:
    """The world sizes of COMM_WORLDS this machine runs: as many GPUs as are visible (rank r on cuda:r), or two gloo
    ranks on the CPU."""
    if device.type == "cuda":
        return [w for w in COMM_WORLDS if w <= torch.cuda.device_count()]
    return [2]


def time_all_reduce(backend: CommBackend, x: torch.Tensor, group: ParallelGroup, warmup: int, reps: int,
                    calls: int) -> tuple[float, str]:
    """Every rank at once: seconds per `backend.all_reduce` of a tensor of x's shape and dtype, the slowest rank's
    median of `reps` samples of `calls` sums, and how it was timed. CUDA ("graph"): the calls captured in one CUDA
    graph after a warm-up on a side stream (as serving captures them), each sample one replay between CUDA events,
    the ranks lined up by a barrier first; CPU ("wall"): wall time of a loop of the calls. The message is zeros (an
    in-place sum of zeros stays zeros however often it runs)."""
    static = torch.zeros_like(x)
    device = x.device
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(max(1, warmup)):
                backend.all_reduce(static)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                backend.all_reduce(static)
        graph.replay()
        torch.cuda.synchronize(device)
        samples = []
        for _ in range(reps):
            dist.barrier(group=group.group)
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / calls)
    else:
        for _ in range(warmup):
            backend.all_reduce(static)
        samples = []
        for _ in range(reps):
            dist.barrier(group=group.group)
            begin = time.perf_counter()
            for _ in range(calls):
                backend.all_reduce(static)
            samples.append((time.perf_counter() - begin) / calls)
    slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group.group)
    return float(slowest.item()), "graph" if device.type == "cuda" else "wall"


def comm_rank(rank: int, world: int, device: torch.device, out: str, dtype_name: str, cases: list[tuple[int, int]],
              wanted: list[str] | None, warmup: int, reps: int) -> None:
    """One rank of a world (plugserve.conformance.comm_ranks.run_ranks): every usable comm backend (of `wanted`
    names, None: all) built and self-checked as serving builds them (runtime/comm.py, collectively), its sum of each
    case it takes checked against the group's own all-reduce, then, where every check passed, timed. Rank 0 writes
    {"measured": [{backend, tokens, hidden, bytes, seconds, timing}], "excluded": [why]} to `out`."""
    group = ParallelGroup(rank, world, dist.group.WORLD)
    dtype = getattr(torch, dtype_name)
    spec = CommSpec(world, dtype, group=group.group)
    hardware = Hardware.detect(device)
    candidates = [s.backend for s in get_registry().candidates("comm", Phase.DECODE, 1, hardware, "auto", spec)
                  if wanted is None or s.backend.name in wanted]
    excluded: list[str] = []
    built: list[CommBackend] = []
    for cls in sorted(candidates, key=lambda c: c.name):  # one order on every rank: building is a collective
        backend, error = build_checked(cls, spec, device, group)  # type: ignore[arg-type]
        if backend is None:
            excluded.append(f"{cls.name}: {error}")
        else:
            built.append(backend)
    generator = torch.Generator(device=device).manual_seed(rank)
    messages = [(tokens, hidden, torch.randn(tokens, hidden, device=device, generator=generator).to(dtype))
                for tokens, hidden in sorted(cases, key=lambda c: c[0] * c[1])]
    measured = []
    for backend in built:
        taken = [(t, h, x) for t, h, x in messages if backend.takes(x)]  # by size and dtype: alike on every rank
        errors = [f"{backend.name} at {t} x {h}: {e}" for t, h, x in taken
                  if (e := agreed(_sum_error(backend, x, spec), device, group))]
        if errors:
            excluded.append(errors[0])  # a backend that sums one size wrong ranks at none
            continue
        for tokens, hidden, x in taken:
            seconds, timing = time_all_reduce(backend, x, group, warmup, reps, COMM_CALLS[device.type])
            measured.append({"backend": backend.name, "tokens": tokens, "hidden": hidden,
                             "bytes": x.numel() * x.element_size(), "seconds": seconds, "timing": timing})
    if rank == 0:
        Path(out).write_text(json.dumps({"measured": measured, "excluded": excluded}))
    dist.barrier()


def _sum_error(backend: CommBackend, x: torch.Tensor, spec: CommSpec) -> str:
    """runtime.comm.sum_mismatch, a sum that raises (on this rank: the others go on to agree) among its errors."""
    try:
        return sum_mismatch(backend, x, spec)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def run_comm(device: torch.device, dtype: torch.dtype, args, emit) -> None:
    """For each world this machine runs (comm_worlds), `comm_rank` on that many spawned ranks, then a row per
    backend and message it took, and a table of the world to stdout. A backend that failed to build or summed
    wrong is printed and gets no row; a world whose ranks failed, printed, the next one run."""
    worlds = comm_worlds(device)
    if not worlds:
        print(f"comm: one {device.type} device: no all-reduce to measure", file=sys.stderr)
        return
    if device.type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, as the lent machines need it
    wanted = sorted(name for kind, name in args.wanted if kind == "comm") if args.wanted else None
    dtype_name = str(dtype).removeprefix("torch.")
    for world in worlds:
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "comm.json"
            try:
                run_ranks(comm_rank, world, str(out), dtype_name, QUICK_COMM_CASES if args.quick else COMM_CASES,
                          wanted, args.warmup, args.reps, device_type=device.type, timeout_s=COMM_TIMEOUT_S)
            except Exception as exc:  # a world whose ranks failed must not end the shootout: report it and go on
                print(f"comm at {world} ranks failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                continue
            result = json.loads(out.read_text())
        rows = []
        for m in result["measured"]:
            case = Case("comm", "any", f"w{world} {size_name(m['bytes'])} t{m['tokens']} h{m['hidden']}",
                        m["tokens"], m["bytes"], 0.0, dtype_name)
            rows.append(emit(case, m["backend"], m["seconds"], m["timing"], world=world))
        for why in result["excluded"]:
            print(f"comm at {world} ranks, not ranked: {why}", flush=True)
        print(comm_world_table(rows, world, dtype), flush=True)
        ranked = comm_rankings(rows).get(str(world), [])
        print(f"  auto's order at {world} ranks: " + comm_order_line((b["max_bytes"], b["order"]) for b in ranked),
              flush=True)


def comm_world_table(rows: list[Row], world: int, dtype: torch.dtype) -> str:
    """One world's all-reduces as a text table: per message size, each backend's time and the order `auto` takes."""
    names = sorted({r.backend for r in rows})
    by_size: dict[int, dict[str, Row]] = {}
    for r in rows:
        by_size.setdefault(r.message_bytes, {})[r.backend] = r  # type: ignore[index]
    lines = [f"all-reduce at {world} ranks, {str(dtype).removeprefix('torch.')}, us per call:",
             f"  {'size':>10} {'tokens x hidden':>16} " + " ".join(f"{n:>18}" for n in names) + "  fastest first"]
    for n_bytes, mine in sorted(by_size.items()):
        tokens = next(iter(mine.values())).batch
        order = sorted(mine, key=lambda n: mine[n].us)
        shape = f"{tokens} x {n_bytes // (tokens * dtype.itemsize)}"
        lines.append(f"  {size_name(n_bytes):>10} {shape:>16} "
                     + " ".join(f"{mine[n].us:18.1f}" if n in mine else f"{'-':>18}" for n in names)
                     + "  " + " > ".join(order))
    return "\n".join(lines)


def time_library(setup: Callable[[], Callable[[], object]] | None, device: torch.device, args) -> float | None:
    """Seconds of the library called directly, timed as the backend was (None without a library call)."""
    if setup is None:
        return None
    try:
        seconds, _ = timed(setup(), device, args.warmup, args.reps)
    except Exception as exc:  # a broken direct call must not end the shootout: report it and go on
        print(f"library call failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return seconds


# -- outputs -----------------------------------------------------------------------------------------


def selection_table(rows: list[Row], device_name: str, command: str, tp_size: int = 1, ep_size: int = 1,
                    attention_heads: int = 128) -> dict:
    """Per kind and phase, for each batch bucket, backend names ordered by their summed time over the
    cases falling in that bucket (only backends measured on every such case compete); with the parallelism
    whose per-rank shapes they ran and the heads a rank's attention ran."""
    rankings: dict[str, dict[str, list[dict]]] = {}
    for kind in sorted({r.kind for r in rows} - {"comm"}):
        for phase in sorted({r.phase for r in rows if r.kind == kind}):
            buckets = []
            low = 0
            for edge in BATCH_BUCKETS:
                in_bucket = [r for r in rows if r.kind == kind and r.phase == phase and low < r.batch <= edge]
                low = edge
                if not in_bucket:
                    continue
                shapes = {r.shape for r in in_bucket}
                totals: dict[str, float] = {}
                for name in {r.backend for r in in_bucket}:
                    mine = [r for r in in_bucket if r.backend == name]
                    if {r.shape for r in mine} == shapes:
                        totals[name] = sum(r.us for r in mine)
                buckets.append({"max_batch_size": edge, "order": sorted(totals, key=totals.get)})
            if buckets:
                rankings.setdefault(kind, {})[phase] = buckets
    table = {"device_name": device_name, "source": command, "tp_size": tp_size, "ep_size": ep_size,
             "attention_heads": attention_heads, "rankings": rankings}
    comm = comm_rankings(rows)
    return table | {"comm": comm} if comm else table


def comm_rankings(rows: list[Row]) -> dict[str, list[dict]]:
    """Per world size (a JSON key: a string), all-reduce buckets (registry.CommBucket) in increasing size: each
    measured message size a bucket, its backends fastest first, neighbours of one order merged into the larger."""
    rankings = {}
    for world in sorted({r.world for r in rows if r.kind == "comm"}):  # type: ignore[type-var]
        mine = [r for r in rows if r.kind == "comm" and r.world == world]
        rankings[str(world)] = _merged_neighbours(
            (n_bytes, [r.backend for r in sorted((r for r in mine if r.message_bytes == n_bytes), key=lambda r: r.us)])
            for n_bytes in sorted({r.message_bytes for r in mine}))  # type: ignore[type-var]
    return rankings


def _merged_neighbours(buckets: Iterable[tuple[int, list[str]]]) -> list[dict]:
    """registry.merged_neighbours as CommBucket dicts (the table's JSON)."""
    return [{"max_bytes": edge, "order": list(order)} for edge, order in merged_neighbours(buckets)]


def merge_rankings(path: Path, measured: dict) -> None:
    """Put `measured`'s rankings into the selection table at `path` (of the same device and parallelism), bucket by
    bucket: the backends this run measured take, in their new order, the places they held in the table's order, and
    the table's other backends keep theirs (a run of two backends reorders those two, whatever was measured beside
    them before). A bucket, phase or kind the table lacks is added as measured. Attention measured at other heads
    than the table's `attention_heads` goes under `attention_by_heads`, so that `auto` picks by the heads a model
    runs per rank (registry.SelectionTable)."""
    table = json.loads(path.read_text())
    comm = measured.get("comm", {})
    if table["device_name"] != measured["device_name"] or (
            measured["rankings"] and table.get("tp_size", 1) != measured["tp_size"]):  # all-reduces: any tp
        raise SystemExit(f"--merge-into {path}: measured on {measured['device_name']} at tp {measured['tp_size']}, "
                         f"the table is {table['device_name']}'s at tp {table.get('tp_size', 1)}")
    if not measured["rankings"] and not comm:
        raise SystemExit(f"--merge-into {path}: this run ranked no backend")
    for world, buckets in comm.items():
        target = table.setdefault("comm", {})
        target[world] = merged_comm_buckets(target.get(world, []), buckets)
    heads = measured["attention_heads"]
    for kind, phases in measured["rankings"].items():
        if kind == "attention" and heads != table.get("attention_heads", 128):
            target = table.setdefault("attention_by_heads", {}).setdefault(str(heads), {})
        else:
            target = table["rankings"].setdefault(kind, {})
        for phase, buckets in phases.items():
            old = {b["max_batch_size"]: b["order"] for b in target.get(phase, [])}
            for bucket in buckets:
                old[bucket["max_batch_size"]] = _spliced(old.get(bucket["max_batch_size"], []), bucket["order"])
            target[phase] = [{"max_batch_size": edge, "order": old[edge]} for edge in sorted(old)]
    kinds = ", ".join([*(f"attention at {heads} heads" if kind == "attention" else kind
                         for kind in measured["rankings"]), *(["comm"] if comm else [])])
    table["source"] = f"{table.get('source', '')}; {kinds} re-ranked by: {measured['source']}"
    path.write_text(json.dumps(table, indent=1) + "\n")


def merged_comm_buckets(old: list[dict], measured: list[dict]) -> list[dict]:
    """One world's all-reduce buckets after a run: at every edge of either, the order covering it in the table with
    the measured backends put in their measured order (`_spliced`; above a list's last edge, its last order),
    neighbours of one order merged. A run of every backend replaces the table's orders; a run of some of them
    re-ranks those where they stood."""
    def covering(buckets: list[dict], n_bytes: int) -> list[str]:
        return next((b["order"] for b in buckets if n_bytes <= b["max_bytes"]), buckets[-1]["order"] if buckets else [])

    return _merged_neighbours((edge, _spliced(covering(old, edge), covering(measured, edge)))
                              for edge in sorted({b["max_bytes"] for b in [*old, *measured]}))


def merge_results(results: Path, table: Path) -> None:
    """`merge_rankings` of an earlier run's shootout.json (its rows, device, parallelism and command; runs before
    the file recorded their attention heads measured DeepSeek-V3's 128)."""
    data = json.loads(results.read_text())
    rows = [Row(**{k: v for k, v in row.items() if k != "wrapper_overhead"}) for row in data["rows"]]
    merge_rankings(table, selection_table(rows, data["device"], f"{data['command']} ({results})", data["tp_size"],
                                          data["ep_size"], data.get("attention_heads", 128)))


def _spliced(old: list[str], measured: list[str]) -> list[str]:
    """`old` with the backends of `measured` put, in measured's order, into the places they held. Where `old` lacks
    one of them (a bucket never measured with it), measured's order, then old's other backends."""
    if not set(measured) <= set(old):
        return [*measured, *(name for name in old if name not in measured)]
    ranked = iter(measured)
    return [next(ranked) if name in measured else name for name in old]


def write_outputs(rows: list[Row], ceilings: dict[str, float], hardware: Hardware, out: Path, command: str,
                  tp_size: int = 1, ep_size: int = 1, attention_heads: int = 128) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "shootout.json").write_text(json.dumps({"device": hardware.name, "command": command,
                                                   "tp_size": tp_size, "ep_size": ep_size,
                                                   "attention_heads": attention_heads, "ceilings": ceilings,
                                                   "rows": [asdict(r) | {"wrapper_overhead": r.wrapper_overhead}
                                                            for r in rows]}, indent=1))
    lines = [f"# Shootout on {hardware.name}", "", f"`{command}`", "",
             f"One rank's shapes at tensor parallelism {tp_size}, expert parallelism {ep_size}.", "",
             "Ceilings measured in the same run: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()), "",
             *(["comm rows: all-reduces at `w` ranks of the message size shown, every rank's; no limit (the link's is "
                "not measured here), their GB/s the message's bytes per second; ranked by time", ""]
               if any(r.kind == "comm" for r in rows) else []),
             "| kind | phase | shape | backend | time (us) | GB/s | TFLOP/s | fraction of limit | library direct (us) "
             "| wrapper overhead |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.kind} | {r.phase} | {r.shape} | {r.backend} | {r.us:.1f} | {r.gbps:.0f} | {r.tflops:.1f} | "
              + ("" if r.fraction_of_limit is None else f"{r.fraction_of_limit:.2f}") + " | "
              + ("" if r.library_us is None else f"{r.library_us:.1f}") + " | "
              + ("" if r.wrapper_overhead is None else f"{r.wrapper_overhead:+.1%}") + " |" for r in rows]
    (out / "shootout.md").write_text("\n".join(lines) + "\n")
    (out / f"{hardware.device_key}.json").write_text(
        json.dumps(selection_table(rows, hardware.name, command, tp_size, ep_size, attention_heads), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG plots", file=sys.stderr)
        return
    for kind in sorted({r.kind for r in rows}):
        mine = [r for r in rows if r.kind == kind]
        shapes = list(dict.fromkeys(r.shape for r in mine))
        fig, ax = plt.subplots(figsize=(max(8, len(shapes) * 0.45), 5))
        for name in sorted({r.backend for r in mine}):
            by_shape = {r.shape: r.us if kind == "comm" else r.fraction_of_limit for r in mine if r.backend == name}
            ax.plot(range(len(shapes)), [by_shape.get(s, float("nan")) for s in shapes], marker="o", label=name)
        ax.set_xticks(range(len(shapes)), shapes, rotation=70, fontsize=7)
        if kind == "comm":  # no limit to divide by: the time itself
            ax.set_yscale("log")
        ax.set_ylabel("us per all-reduce" if kind == "comm" else "fraction of the measured limit")
        ax.set_title(f"{kind} on {hardware.name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{kind}.png", dpi=110)
        plt.close(fig)


def check_parallelism(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tp-size / --ep-size as serving takes them, and every measured shape splitting over the ranks."""
    if args.tp_size < 1:
        parser.error(f"--tp-size {args.tp_size} must be at least 1")
    if args.ep_size not in (1, args.tp_size):
        parser.error(f"--ep-size {args.ep_size} must be 1 or --tp-size ({args.tp_size})")
    if args.heads % args.tp_size:
        parser.error(f"--heads {args.heads} does not split over --tp-size {args.tp_size}")
    try:
        gemm_shapes(preset_config(QUICK_MODEL if args.quick else GEMM_MODEL), args.tp_size)
        moe_specs(torch.bfloat16, args.tp_size, args.ep_size, args.quick)
    except (ModelConfigError, ValueError) as exc:
        parser.error(f"--tp-size {args.tp_size} --ep-size {args.ep_size}: {exc}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["attention", "gemm", "moe"],
                        choices=["attention", "gemm", "moe", "comm"],
                        help="comm: all-reduces on spawned ranks, at each world of 2, 4, 8 the visible GPUs allow "
                             "(the CPU: 2 gloo ranks)")
    parser.add_argument("--backends", nargs="*", default=None, help="KIND:NAME to include (default: every usable one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=128,
                        help="the attention rows' model heads (DeepSeek-V3: 128); a rank runs heads / --tp-size "
                             "(the GEMM rows slice DeepSeek-V3's own)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel ranks P: one rank's shapes (heads / P, GEMMs sliced, experts I / P)")
    parser.add_argument("--ep-size", type=int, default=1,
                        help="expert-parallel ranks: 1 or --tp-size (then a rank holds n / P whole experts)")
    parser.add_argument("--page-size", type=int, default=64,
                        help="the attention rows' KV page size. A server without --page-size runs its decode "
                             "backend's forced size, else 1, where the Triton MLA decode fills each 64-key block a "
                             "row a key (slower at long KV: docs/kernels.md); rows at 64 are a --page-size 64 server's")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8_e4m3"],
                        help="the KV cache of the attention decode rows, each asked for (auto: the --dtype; fp8_e4m3 "
                             "rows run the backends that read it, their shapes ending in fp8kv)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--reference-reps", type=int, default=3, help="repetitions for the slow torch_ref backends")
    parser.add_argument("--quick", action="store_true", help="tiny grid (to check the script, e.g. on the CPU)")
    parser.add_argument("--output-dir", type=Path, default=None, help="where the results go (needed unless "
                        "--from-results)")
    parser.add_argument("--merge-into", type=Path, default=None,
                        help="a selection table (plugserve/tables/<device>.json) to merge this run's rankings into: "
                             "the measured backends re-ranked in the places they held (see merge_rankings)")
    parser.add_argument("--from-results", type=Path, default=None,
                        help="an earlier run's shootout.json: merge its rankings into --merge-into, measuring nothing")
    args = parser.parse_args(argv)
    if args.from_results is not None:
        if args.merge_into is None:
            parser.error("--from-results re-ranks a table: give the table with --merge-into")
        merge_results(args.from_results, args.merge_into)
        return
    if args.output_dir is None:
        parser.error("--output-dir is required (unless --from-results)")
    if args.merge_into is not None and args.kv_cache_dtype != ["auto"]:
        parser.error("--merge-into ranks the default KV cache: leave --kv-cache-dtype auto")
    check_parallelism(parser, args)
    args.reps_for = lambda name: args.reference_reps if name == "torch_ref" else args.reps
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hardware = Hardware.detect(device)
    registry = get_registry()
    wanted = {tuple(b.split(":", 1)) for b in args.backends} if args.backends else None
    args.wanted = wanted
    # An all-reduce has no limit measured here: a run of comm alone measures no ceiling.
    ceilings = measure_ceilings(device, args.quick) if set(args.kinds) - {"comm"} else {}
    print(hardware.describe() + "".join(f", {k} {v:.1f}" for k, v in ceilings.items()))
    rows: list[Row] = []

    def emit(case: Case, backend: str, seconds: float, timing: str, library: float | None = None,
             world: int | None = None) -> Row:
        """A row of the case (comm: `world` ranks, no limit), printed."""
        fraction = None if world is not None else limit_seconds(case, ceilings) / seconds
        row = Row(case.kind, case.phase, case.shape, backend, seconds * 1e6, case.bytes / seconds / 1e9,
                  case.flops / seconds / 1e12, fraction, case.batch, timing,
                  None if library is None else library * 1e6, world, int(case.bytes) if world is not None else None)
        rows.append(row)
        limit = "no limit" if fraction is None else f"{fraction:6.2f} of limit"
        print(f"{row.kind:9} {row.shape:32} {row.backend:12} {row.us:10.1f} us {row.gbps:8.0f} GB/s "
              f"{row.tflops:7.1f} TFLOP/s {limit} ({timing})"
              + ("" if row.library_us is None else f" library {row.library_us:.1f} us, wrapper "
                 f"{row.wrapper_overhead:+.1%}"), flush=True)
        return row

    command = "python benchmarks/shootout.py " + " ".join(argv if argv is not None else sys.argv[1:])
    heads = args.heads // args.tp_size  # a rank's
    for kind in args.kinds:
        entries = [e for name, e in sorted(registry.backends[kind].items()) if wanted is None or (kind, name) in wanted]
        entries = [e for e in entries if registry.availability(e.cls, hardware)]
        if kind == "comm":
            run_comm(device, dtype, args, emit)  # each world's ranks find their own backends
        elif kind == "attention":
            run_attention(entries, device, dtype, heads, args, emit)
        elif kind == "gemm":
            run_gemm(entries, device, dtype, args, emit)
        else:
            run_moe(entries, device, dtype, args, emit)
        # After each kind: partial runs keep theirs.
        write_outputs(rows, ceilings, hardware, args.output_dir, command, args.tp_size, args.ep_size, heads)
    if args.merge_into is not None:
        merge_rankings(args.merge_into, selection_table(rows, hardware.name, command, args.tp_size, args.ep_size,
                                                        heads))
    if device.type == "cuda":
        check_limits(rows)


def check_limits(rows: list[Row]) -> None:
    """Exits naming every row faster than its limit (the results are written first, to look at): the limit is a
    lower bound on the time, so such a row means a byte or flop count, or a ceiling, is wrong. On a GPU only: a
    CPU's caches are not flushed between calls, so small cases there run from cache."""
    over = [f"{r.kind} {r.shape} {r.backend}: {r.fraction_of_limit:.2f}" for r in rows
            if r.fraction_of_limit is not None and r.fraction_of_limit > 1.0]
    if over:
        sys.exit("faster than the limit (fraction of the limit above 1):\n  " + "\n  ".join(over))


if __name__ == "__main__":
    main()
