"""Where a decode step's time goes: torch-profiler over a few decode steps of bench_one_batch's static
batch (CUDA graphs replay as they serve), GPU kernel time grouped by kernel, against the step's wall
time. Every server flag passes through.

    python -m benchmarks.dev.profile_decode --model-preset deepseek-v2-lite --load-format dummy \\
        --batch-size 1 --input-len 256 --enable-torch-compile --output profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_one_batch
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.request import Request
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.scheduler import Scheduler


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_one_batch.add_arguments(parser)
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    parser.add_argument("--output", default=None, help="write the report here too")
    parser.add_argument("--trace", default=None, help="write a Chrome trace (json) here")
    parser.add_argument("--host-profile", action="store_true",
                        help="also time the steps without any profiler, then by phase, then under cProfile: where "
                             "the host's time goes (Python, launches, waits), which the kernel table does not show")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch the Triton kernels without programmatic dependent launch (PLUGSERVE_PDL=0): "
                             "a kernel's time then no longer includes its wait for the kernel before")
    namespace = parser.parse_args(argv)
    if namespace.no_pdl:
        os.environ["PLUGSERVE_PDL"] = "0"  # before any kernel launches; spawned ranks inherit it
    # A speculative round can give every request up to num_draft_tokens tokens: budget for that many a step.
    per_step = 1
    if namespace.speculative_algorithm:
        per_step = namespace.speculative_num_draft_tokens or (namespace.speculative_num_steps or 1) + 1
    namespace.output_len = [(namespace.steps * (4 if namespace.host_profile else 1) + 2) * per_step]
    with bench_one_batch.build_runner(namespace, parser) as runner:
        profile_steps(runner, namespace)


def profile_steps(runner: ModelRunner, namespace: argparse.Namespace) -> None:
    """Prefill, one decode step, then --steps decode steps under the profilers; the report printed and written."""
    batch_size, input_len = namespace.batch_size[0], namespace.input_len[0]
    scheduler = Scheduler(runner, RadixCache(runner.allocator, runner.page_size, enabled=False),
                          bench_one_batch.NoText())
    params = SamplingParams(max_new_tokens=namespace.output_len[0], temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    for i in range(batch_size):
        ids = torch.randint(0, runner.config.vocab_size, (input_len,), generator=generator).tolist()
        scheduler.add(Request(f"profile-{i}", ids, params, lambda _: None))
    scheduler.step()  # the prefill
    scheduler.step()  # one decode step outside the profile
    torch.cuda.synchronize()
    host_report = _host_profile(scheduler, namespace.steps) if namespace.host_profile else []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(namespace.steps):
            scheduler.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / namespace.steps
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_total = sum(e.self_device_time_total for e in events) / namespace.steps / 1e3
    lines = [f"batch {batch_size}, input {input_len}: wall {wall * 1e3:.3f} ms/step, GPU kernels "
             f"{gpu_total:.3f} ms/step, {sum(e.count for e in events) / namespace.steps:.0f} kernels/step",
             f"graph status: {runner.graphs.status}", "",
             f"{'ms/step':>8} {'share':>6} {'calls/step':>10}  kernel"]
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:40]:
        ms = e.self_device_time_total / namespace.steps / 1e3
        lines.append(f"{ms:8.3f} {ms / gpu_total:6.1%} {e.count / namespace.steps:10.1f}  {e.key[:110]}")
    # Host side (what the step spends outside the GPU), and the ops behind the kernels with their shapes
    # (inside a CUDA-graph replay the ops are not seen: profile with --disable-cuda-graph for those).
    averages = prof.key_averages(group_by_input_shape=True)
    lines += ["", "host ops by self CPU time (whole profile):",
              averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60),
              "ops by self device time (whole profile):",
              averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)]
    report = "\n".join(lines + host_report)
    print(report)
    if namespace.output:
        with open(namespace.output, "w") as f:
            f.write(report + "\n")
    if namespace.trace:
        prof.export_chrome_trace(namespace.trace)


def _host_profile(scheduler: Scheduler, steps: int) -> list[str]:
    """Wall time per decode step with no profiler (each step synchronized, as bench_one_batch times it),
    then the same steps timed by phase (`_time_phases`), then under cProfile: host functions by own and by
    cumulative time. Uses 3 * steps of the requests' output budget."""
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        scheduler.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    phases = _time_phases(scheduler, steps)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        scheduler.step()
        torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    walls_ms = ", ".join(f"{w * 1e3:.2f}" for w in walls)
    return ["", f"host: wall ms per step without a profiler: {walls_ms}", *phases,
            f"cProfile over {steps} steps (times are totals, inflated by cProfile itself):", out.getvalue()]


def phase_targets(scheduler: Scheduler) -> list[tuple[object, str]]:
    """(owner, attribute) of the functions a step's host time is split by: scheduling, the forward's pieces
    (speculative ones too), the graph replays' input loads and attention plans, processing the outputs."""
    from plugserve.core import forward_batch, graph_inputs
    from plugserve.runtime import acceptance, cuda_graph_runner, model_runner, speculative

    worker = speculative.SpeculativeWorker
    targets: list[tuple[object, str]] = [
        (Scheduler, "schedule"), (Scheduler, "run"), (Scheduler, "forward"), (Scheduler, "sample"),
        (Scheduler, "process"), (forward_batch.ForwardBatch, "build"), (model_runner.ModelRunner, "forward"),
        (cuda_graph_runner.CudaGraphRunner, "replay"), (graph_inputs.GraphInputs, "load"),
        (cuda_graph_runner.CudaGraphRunner, "_launch"), (worker, "_draft"), (worker, "_draft_step"),
        (worker, "_verify_chains"), (worker, "_verify_tree"), (worker, "_draft_extend"), (worker, "_logits"),
        (acceptance, "verify_drafts"), (acceptance, "verify_tree"), (speculative, "_draft_tokens"),
    ]
    backends = {type(b.backend) for b in scheduler.runner.backends.decode_buckets}
    return targets + [(backend, "plan_replay") for backend in backends if "plan_replay" in backend.__dict__]


def _time_phases(scheduler: Scheduler, steps: int) -> list[str]:
    """The same steps again with each of `phase_targets` timed on the host (inclusive of what it calls and of any
    wait on the GPU inside it; nothing synchronized but the step's end): calls and milliseconds a step."""
    totals: dict[str, list[float]] = {}
    originals = []
    for owner, name in phase_targets(scheduler):
        raw = owner.__dict__[name]
        function = raw.__func__ if isinstance(raw, classmethod) else raw
        label = f"{getattr(owner, '__name__', owner)}.{name}".removeprefix("plugserve.core.")
        label = label.removeprefix("plugserve.runtime.")

        def timed(*args, _function=function, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                total = totals.setdefault(_label, [0, 0.0])
                total[0] += 1
                total[1] += time.perf_counter() - start

        setattr(owner, name, classmethod(timed) if isinstance(raw, classmethod) else timed)
        originals.append((owner, name, raw))
    try:
        start = time.perf_counter()
        for _ in range(steps):
            scheduler.step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    finally:
        for owner, name, raw in originals:
            setattr(owner, name, raw)
    lines = ["", f"host time by phase ({steps} steps, {wall * 1e3:.3f} ms a step with the timers; inclusive):",
             f"{'ms/step':>8} {'calls/step':>10}  function"]
    for label, (calls, seconds) in sorted(totals.items(), key=lambda item: -item[1][1]):
        lines.append(f"{seconds / steps * 1e3:8.3f} {calls / steps:10.1f}  {label}")
    return [*lines, ""]


if __name__ == "__main__":
    bench_one_batch.run_then_exit(main, sys.argv[1:])
