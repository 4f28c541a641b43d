"""Host time of the serving loop without the device: the engine's scheduler (planning, block tables, sampling's
bookkeeping, stop rules, detokenization, streaming callbacks, metrics) over a runner whose forward returns fixed
logits at once, so that what a step costs is the host path alone, the part a GPU step must hide under overlap.

    python -m benchmarks.dev.bench_host_path --batch-size 64 256 --output-len 128 1024
    python -m benchmarks.dev.bench_host_path --http --batch-size 64 --output-len 128
    python -m benchmarks.dev.bench_host_path --batch-size 64 --output-len 128 --json-schema \
        --model-preset deepseek-v2-lite --num-layers 1       # a served model's vocabulary (masks of 102,400 tokens)

Per case: decode steps, output tokens per second and milliseconds of host time per step (median of --repeat runs),
greedy, every request running to --output-len (ignore_eos). With --http the same server runs in a process of its own
(`--serve PORT`) and `bench_serving` streams to it at concurrency --batch-size: the HTTP path (FastAPI, SSE, the
event loop) beside the scheduler. Where the time goes: a sampling profiler that sees every thread
(`py-spy record -p <server pid>`, or `py-spy record -- python -m benchmarks.dev.bench_host_path ...`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import urllib.request

import torch

from plugserve.runtime import rank_protocol
from plugserve.runtime.engine import Engine
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs


class FixedLogits:
    """A stand-in for `ModelRunner.forward_groups`: each sampled row's logits peak on a token that moves every step
    (never EOS), made without running a model. The tokens are `text_ids` in turn, the ids of some ordinary text:
    arbitrary ids (byte-level vocabularies' lone bytes) decode to no character, which would make every detokenizer
    step re-decode a growing tail, as no model's output does."""

    def __init__(self, vocab: int, text_ids: list[int], forward_ms: float = 0.0) -> None:
        self.vocab, self.text_ids, self.steps, self.forward_s = vocab, text_ids, 0, forward_ms / 1000

    def __call__(self, parts: list[rank_protocol.Part | None]) -> list[torch.Tensor]:
        self.steps += 1
        if self.forward_s:
            time.sleep(self.forward_s)  # a device step's time, the GIL released as a GPU forward's wait releases it
        out = []
        for part in parts:
            rows = 0 if part is None else part.sample_rows.shape[0]
            logits = torch.zeros(rows, self.vocab)
            logits[:, self.text_ids[self.steps % len(self.text_ids)]] = 10.0
            out.append(logits)
        return out


# A JSON schema no output of these lengths can close: every token of a request is sampled under the grammar's mask.
LONG_STRING_SCHEMA = ('{"type": "object", "properties": {"answer": {"type": "string", "minLength": 100000}}, '
                      '"required": ["answer"], "additionalProperties": false}')


def run(engine: Engine, forward: FixedLogits, batch_size: int, output_len: int, json_schema: str | None = None
        ) -> tuple[int, float]:
    """One batch of `batch_size` greedy requests of `output_len` tokens (each under `json_schema`'s grammar when
    given) -> (steps, seconds)."""
    prompts = [[5 + i % 1000, 6, 7, 8, 9, 10, 11, 12] for i in range(batch_size)]
    params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True, json_schema=json_schema)
    steps = forward.steps
    start = time.perf_counter()
    engine.generate(prompts, params)
    return forward.steps - steps, time.perf_counter() - start


def fake_engine(max_running: int, disable_overlap_schedule: bool, forward_ms: float = 0.0, model_preset: str = "tiny",
                **kwargs) -> tuple[Engine, FixedLogits]:
    """A preset's engine (dummy weights) with its forward replaced by `FixedLogits` (taking `forward_ms` a step)."""
    engine = Engine(ServerArgs(model_preset=model_preset, load_format="dummy", max_running_requests=max_running,
                               log_level="warning", disable_overlap_schedule=disable_overlap_schedule, **kwargs))
    text_ids = engine.tokenizer.encode(" the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    forward = FixedLogits(engine.runner.sample_vocab, text_ids, forward_ms)
    engine.runner.forward_groups = forward  # type: ignore[method-assign]
    return engine, forward


def serve(port: int, max_running: int, disable_overlap_schedule: bool) -> None:
    """The fake engine behind the HTTP server, until killed."""
    import uvicorn

    from plugserve.server.app import create_app

    engine, _ = fake_engine(max_running, disable_overlap_schedule, port=port)
    engine.ready.wait()
    uvicorn.run(create_app(engine), host="127.0.0.1", port=port, log_level="warning")


def http_cases(args: argparse.Namespace) -> None:
    """bench_serving against `serve` in a child process, per batch size (concurrency) and output length."""
    from benchmarks import bench_serving
    from plugserve.core.distributed import pick_free_port

    port = pick_free_port()
    command = [sys.executable, "-m", "benchmarks.dev.bench_host_path", "--serve", str(port),
               "--batch-size", str(max(args.batch_size))]
    server = subprocess.Popen(command + (["--disable-overlap-schedule"] if args.disable_overlap_schedule else []))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the fake server did not come up") from None
                time.sleep(0.5)
        print(f"server pid {server.pid}")
        for batch_size in args.batch_size:
            for output_len in args.output_len:
                print(f"\n# concurrency {batch_size}, output {output_len}")
                bench_serving.main(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(4 * batch_size),
                                    "--max-concurrency", str(batch_size), "--random-input-len", "8",
                                    "--random-output-len", str(output_len), "--random-range-ratio", "1",
                                    "--disable-tqdm"])
    finally:
        server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--output-len", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--http", action="store_true", help="through the HTTP server and bench_serving")
    parser.add_argument("--forward-ms", type=float, default=0.0,
                        help="each forward sleeps this long (a device step): with overlap a step should then take "
                             "max(this, the host's time), not their sum")
    parser.add_argument("--json-schema", action="store_true",
                        help="also every case with each request under a JSON schema's grammar (structured output)")
    parser.add_argument("--model-preset", default="tiny",
                        help="whose vocabulary and config (dummy weights; the forward is never run)")
    parser.add_argument("--num-layers", type=int, default=None, help="of the preset (fewer: less memory to load)")
    parser.add_argument("--serve", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        return serve(args.serve, max(args.batch_size), args.disable_overlap_schedule)
    if args.http:
        return http_cases(args)
    engine, forward = fake_engine(max(args.batch_size), args.disable_overlap_schedule, args.forward_ms,
                                  args.model_preset, num_layers=args.num_layers)
    try:
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))
        print("batch  output  grammar  steps  tok/s     host ms/step")
        for batch_size in args.batch_size:
            for output_len in args.output_len:
                for schema in [None, *([LONG_STRING_SCHEMA] if args.json_schema else [])]:
                    runs = [run(engine, forward, batch_size, output_len, schema) for _ in range(args.repeat)]
                    steps, seconds = runs[0][0], statistics.median(s for _, s in runs)
                    print(f"{batch_size:5d}  {output_len:6d}  {'json' if schema else 'none':>7}  {steps:5d}  "
                          f"{batch_size * output_len / seconds:8.0f}  {1000 * seconds / steps:8.2f}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
