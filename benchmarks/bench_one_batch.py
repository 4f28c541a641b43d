"""Static-batch latency: one prefill of `batch_size` prompts of `input_len` random tokens, then
`output_len` decode steps, through plugserve's own scheduler and model runner (no HTTP). Each decode step
is timed by itself, as SGLang's bench_one_batch does (planned, run, its tokens read back and processed);
`--overlap` times them under the overlap scheduler instead, as serving runs them: step k + 1 is planned
and launched while step k runs, so the host's work per step hides behind the GPU's.
With --speculative-algorithm a decode step is a speculative round, which gives each request one to k + 1 tokens:
the steps run until every request is done, decode throughput is the tokens over their total time, and the
"accept length" (mean tokens a request gets from one verify) is printed beside it; without speculation the same
"decode_throughput" (tokens over the steps' total time) goes into the JSON line beside the median, so that the
two compare (tools/device/run_fast_path_on_device.sh's `specvs` step). The runner's CUDA-graph status is printed
and stored too.
Prints SGLang's bench_one_batch format; --result-filename appends one JSON line per run (with the server flags
it ran under). Every server flag is taken, the parallel ones included: with --tp-size N (and --ep-size) this
process is rank 0 and starts the node's other ranks as workers, as the Engine does (runtime/ranks.py); other nodes
of --nnodes run `plugserve serve --node-rank n`. The cost of --enable-deterministic-inference is a run with it
against the same command without it.

    python benchmarks/bench_one_batch.py --model-preset deepseek-v3 --num-layers 4 --load-format dummy \\
        --batch-size 1 8 32 --input-len 256 --output-len 32
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from plugserve.core.distributed import SINGLE
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR, load_tokenizer
from plugserve.plugins.attention.cutlass_mla import PAGE_SIZE as LARGEST_PAGE  # the largest a built-in backend asks
from plugserve.runtime import speculative
from plugserve.runtime.dp_scheduler import DPScheduler
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.ranks import Ranks
from plugserve.runtime.request import Request
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.scheduler import Scheduler
from plugserve.runtime.server_args import ServerArgs, flag
from plugserve.runtime.warmup import warm_up
from plugserve.server.launch import add_server_args, server_args_from


class NoText:
    """Random token ids need no detokenization: the benchmark times the model, not the tokenizer."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _decode_one_by_one(scheduler: Scheduler, runner: ModelRunner, steps: int) -> list[float]:
    """Seconds of each of (at most, with speculation) `steps` decode steps, each planned, run, read back and
    processed alone."""
    decode = []
    for _ in range(steps):
        if not scheduler.has_work:  # speculative rounds finished the requests in fewer steps
            break
        begin = time.perf_counter()
        scheduler.step()
        _sync(runner)
        decode.append(time.perf_counter() - begin)
    return decode


def _decode_overlapped(scheduler: Scheduler) -> list[float]:
    """Seconds per decode step under the overlap scheduler until every request is done: each call
    launches step k + 1, then processes step k (waiting for it), so a step takes the interval between the
    returns of consecutive calls. The first call only launches."""
    scheduler.overlap = True
    returns = []
    while scheduler.has_work:
        scheduler.step()
        returns.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(returns)]


def run_once(runner: ModelRunner, batch_size: int, input_len: int, output_len: int, seed: int,
             verbose: bool, overlap: bool = False, text_tokens: list[int] | None = None) -> dict[str, float]:
    """One static batch; `overlap`: decode under the overlap scheduler (the runner's scheduler flags must
    allow it: see build_runner); `text_tokens`: prompts are its consecutive `input_len`-token windows instead of
    random tokens (what speculative decoding's acceptance depends on)."""
    # Under DP attention the requests spread over the groups, as the engine spreads them.
    scheduler: Scheduler | DPScheduler = (
        DPScheduler(runner, NoText(), None, radix_cache=False) if runner.dp_size > 1
        else Scheduler(runner, RadixCache(runner.allocator, runner.page_size, enabled=False), NoText()))
    groups = scheduler.groups if isinstance(scheduler, DPScheduler) else [scheduler]
    scheduler.overlap = False  # the prefill timed alone in either mode
    generator = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    if text_tokens is not None and len(text_tokens) < batch_size * input_len:
        raise SystemExit(f"--prompt-text has {len(text_tokens)} tokens: too few for {batch_size} prompts of "
                         f"{input_len}")
    for i in range(batch_size):
        ids = (torch.randint(0, vocab, (input_len,), generator=generator).tolist() if text_tokens is None
               else text_tokens[i * input_len : (i + 1) * input_len])
        scheduler.add(Request(f"bench-{i}", ids, params, lambda _: None))
    _sync(runner)
    start = time.perf_counter()
    scheduler.step()
    _sync(runner)
    prefill = time.perf_counter() - start
    if any(g.waiting or g.chunked for g in groups):
        raise SystemExit("the batch did not fit one prefill: raise --chunked-prefill-size or --max-total-tokens")
    print(f"Prefill. latency: {prefill:.5f} s, throughput: {batch_size * input_len / prefill:9.2f} token/s")
    decode = _decode_overlapped(scheduler) if overlap else _decode_one_by_one(scheduler, runner, output_len - 1)
    if verbose:
        for step, latency in enumerate(decode):
            if step < 5 or step == len(decode) - 1:
                print(f"Decode.  latency: {latency:.5f} s, throughput: {batch_size / latency:9.2f} token/s")
    total = time.perf_counter() - start
    result = {"batch_size": batch_size, "input_len": input_len, "output_len": output_len, "overlap": overlap,
              "prefill_latency": prefill, "prefill_throughput": batch_size * input_len / prefill,
              "total_latency": total, "overall_throughput": batch_size * (input_len + output_len) / total}
    if decode and scheduler.spec is not None:
        tokens, accept_length = batch_size * (output_len - 1), scheduler.spec.accept_length
        print(f"Decode.  median latency: {statistics.median(decode):.5f} s, throughput: "
              f"{tokens / sum(decode):9.2f} token/s, accept length: {accept_length:.2f}")
        result |= {"median_decode_latency": statistics.median(decode), "decode_throughput": tokens / sum(decode),
                   "accept_length": accept_length, "decode_steps": len(decode)}
    elif decode:
        median = statistics.median(decode)
        print(f"Decode.  median latency: {median:.5f} s, median throughput: {batch_size / median:9.2f} token/s")
        result |= {"median_decode_latency": median, "median_decode_throughput": batch_size / median,
                   "decode_throughput": batch_size * len(decode) / sum(decode), "decode_steps": len(decode)}
    print(f"Total. latency: {total:.3f} s, throughput: {result['overall_throughput']:9.2f} token/s")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every server flag, plus the static batch's shape (lists: one run per combination)."""
    add_server_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, nargs="+", default=[1024])
    parser.add_argument("--output-len", type=int, nargs="+", default=[16])
    parser.add_argument("--overlap", action="store_true",
                        help="time decode under the overlap scheduler (the next step planned and launched while "
                             "one runs, as serving does) instead of each step alone")
    parser.add_argument("--prompt-text", type=Path, default=None,
                        help="prompts cut from this text file (tokenized by the model's tokenizer) instead of random "
                             "tokens, e.g. benchmarks/data/heldout_docs.txt for the embedded model")


@contextlib.contextmanager
def rank_zero_runner(args: ServerArgs) -> Iterator[ModelRunner]:
    """This process's ModelRunner: rank 0 of --tp-size ranks, whose other ranks on this node run as worker
    processes following its forwards (as the Engine starts them), released when the block ends; the one
    process's at --tp-size 1."""
    ranks = Ranks(args) if args.tp_size > 1 else None
    runner = None
    try:
        runner = speculative.build_runner(args, ranks.group if ranks is not None else SINGLE)
        yield runner
    except BaseException:
        if ranks is not None:
            ranks.stop(None)  # the workers may wait in a collective rank 0 left: they are killed, not released
        raise
    if ranks is not None:
        ranks.stop(runner)


# The flags build_runner sets for a static batch, which a server launched with the same flags would not have.
SET_BY_THE_BENCHMARK = ("disable_overlap_schedule", "disable_radix_cache", "chunked_prefill_size",
                        "max_running_requests", "max_total_tokens")


@contextlib.contextmanager
def build_runner(namespace: argparse.Namespace, parser: argparse.ArgumentParser) -> Iterator[ModelRunner]:
    """The static-batch runner of the parsed flags (rank 0 of its ranks, see rank_zero_runner): radix cache off
    (overlap only with --overlap), every batch in one unchunked prefill, a KV pool for the biggest run (unless the
    flags size it); warmed up (JIT, CUDA graphs) and its chosen backends printed."""
    if namespace.overlap and namespace.disable_overlap_schedule:
        parser.error("--overlap times decode under the overlap scheduler, which --disable-overlap-schedule turns off")
    if namespace.overlap and namespace.speculative_algorithm:
        parser.error("--overlap: speculative decoding runs the non-overlap scheduler")
    given = {name: getattr(namespace, name) for name in SET_BY_THE_BENCHMARK}
    namespace.disable_overlap_schedule = not namespace.overlap
    namespace.disable_radix_cache = True
    # Each request's tokens in whole pages of the largest page size a built-in backend asks for, plus the
    # pages the scheduler holds back for each running request's next step (speculative rounds' drafts included).
    tokens = max(namespace.input_len) + max(namespace.output_len)
    biggest = max(namespace.batch_size) * (-(-tokens // LARGEST_PAGE) + 2) * LARGEST_PAGE
    namespace.chunked_prefill_size = -1
    namespace.max_running_requests = max(namespace.max_running_requests or 0, max(namespace.batch_size))
    if namespace.max_total_tokens is None and namespace.mem_fraction_static is None:
        namespace.max_total_tokens = biggest + 64
    args = server_args_from(namespace, parser)
    if args.node_rank:
        parser.error(f"--node-rank {args.node_rank}: bench_one_batch is node 0 (rank 0); the other nodes run "
                     "`plugserve serve --node-rank n` with the same flags")
    with rank_zero_runner(args) as runner:
        warm_up(runner)  # as the engine does before serving: JIT compiles and CUDA-graph capture
        print(f"max_total_num_tokens={runner.max_total_tokens}")
        for c in runner.backends.chosen:
            print(f"{c.kind} {c.phase} up to {c.max_batch_size}: {c.name} ({c.reason})")
        for kind, rows in runner.backends.by_rows.items():
            print(f"{kind} by rows: {rows}")
        changed = [f"{flag(name)} {getattr(args, name)} (given: {given[name]})" for name in SET_BY_THE_BENCHMARK
                   if getattr(args, name) != given[name]]
        if changed:
            print("differs from `plugserve serve` with these flags in: " + ", ".join(changed) + "; backends go by "
                  "batch size, so a batch of b runs what serve runs for b, but GEMM and MoE calls above "
                  f"{runner.max_running_requests} rows (prefill) run the prefill picks")
        print(f"cuda_graph: {runner.graphs.status}")
        print(f"all_reduce: {runner.all_reduce_status}")
        print("Warmup ...")
        run_once(runner, max(namespace.batch_size), min(namespace.input_len), 4, args.seed, verbose=False)
        yield runner


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--result-filename", default=None, help="append one JSON line per run")
    parser.add_argument("--run-name", default="", help="a label stored in the JSON lines")
    namespace = parser.parse_args(argv)
    with build_runner(namespace, parser) as runner:
        benchmark(runner, namespace)


def benchmark(runner: ModelRunner, namespace: argparse.Namespace) -> None:
    """One run per combination of the batch shapes, each printed and appended to --result-filename."""
    text_tokens = None
    if namespace.prompt_text is not None:
        args = runner.args
        tokenizer = load_tokenizer(args.tokenizer_path or args.model_dir or EMBEDDED_MODEL_DIR)
        text_tokens = tokenizer.encode(namespace.prompt_text.read_text(encoding="utf-8"), add_special_tokens=False)
    print("\nBenchmark ...")
    for batch_size in namespace.batch_size:
        for input_len in namespace.input_len:
            for output_len in namespace.output_len:
                print(f"\n# batch size {batch_size}, input {input_len}, output {output_len}")
                result = run_once(runner, batch_size, input_len, output_len, runner.args.seed, verbose=True,
                                  overlap=namespace.overlap, text_tokens=text_tokens)
                if namespace.result_filename:
                    result |= {"run_name": namespace.run_name, "device": runner.hardware.name,
                               "cuda_graph": runner.graphs.status, "all_reduce": runner.all_reduce_status,
                               "backends": {f"{c.kind}:{c.phase}": c.name for c in runner.backends.chosen},
                               "by_rows": runner.backends.by_rows,
                               "server_args": runner.args.model_dump(mode="json")}
                    with open(namespace.result_filename, "a") as f:
                        f.write(json.dumps(result) + "\n")


def run_then_exit(main: Callable[[Sequence[str]], None], argv: Sequence[str]) -> None:
    """main(argv), then os._exit with its status: a multi-GPU run's NCCL world is left to the process's exit, where
    NCCL's own teardown can hang (docs/parallelism.md, "Leaving")."""
    status = 0
    try:
        main(argv)
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1 if exit_.code else 0
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    run_then_exit(main, sys.argv[1:])
