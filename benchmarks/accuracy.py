"""Accuracy of backend combinations against the torch reference in float32, on one model (issue 15).

    python -m benchmarks.accuracy --model-path DIR [--text FILE] [--combos reference auto gemm=triton ...]
        [--device cuda] [--dtype bfloat16] [--max-text-tokens 16384] [--result-filename accuracy.json]

Each combination (attention, FP8 GEMM and MoE backends and a dtype; every other server flag is shared) loads the
model through plugserve's ModelRunner and Engine, as serving does, and is measured on:
- perplexity of held-out text (windows of --window tokens, one EXTEND forward each: the prefill backends),
  and its change against the reference;
- cached perplexity: the same windows fed one DECODE step a token, so that every score reads the keys back from the
  KV cache (the decode backends, and what --kv-cache-dtype changes; a prompt's own EXTEND never reads it);
- top-1: the share of those text positions where its argmax is the reference's;
- forced: the reference's greedy continuations of a fixed prompt set fed back one DECODE step at a time (the
  decode backends, teacher-forced); the share of steps whose argmax is the reference's token. A small model's
  near-ties make greedy runs part at the first flipped choice and never meet again, so this is what the targets read;
- greedy: greedy continuations of the prompt set through the engine (prefill, then decode backends), the share of
  generated tokens equal to the reference's before the first difference;
- NextN (models with an MTP layer): the share of positions where the NextN layer's top-1 for the token after next
  is the main model's greedy choice there (what speculative decoding can accept).

A combination is `reference` (every kind torch_ref, float32), `auto` (what serving picks, at --dtype), or
comma-separated `kind=name` pairs over attention, prefill_attention, decode_attention, gemm, moe, dtype and kv (the
--kv-cache-dtype), the kinds not named torch_ref (e.g. `gemm=triton,dtype=bfloat16`, `kv=fp8_e4m3`). Without
--combos: reference, torch_ref at --dtype, auto, and each registered backend alone with the other kinds torch_ref,
at --dtype; those that cannot run here are listed with the reason. Prints a table and writes --result-filename
(JSON).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.kv_cache import pages_needed
from plugserve.core.loader import read_config
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR, load_tokenizer
from plugserve.registry import SelectionError, get_registry
from plugserve.runtime import speculative
from plugserve.runtime.engine import Engine
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from plugserve.server.launch import add_server_args, server_args_from

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "heldout_docs.txt"
FLAGS = {"attention": "attention_backend", "prefill_attention": "prefill_attention_backend",
         "decode_attention": "decode_attention_backend", "gemm": "fp8_gemm_backend", "moe": "moe_runner_backend",
         "dtype": "dtype", "kv": "kv_cache_dtype"}
REFERENCE = {"attention": "torch_ref", "gemm": "torch_ref", "moe": "torch_ref", "dtype": "float32"}
KV_POOL_TOKENS = 65536
# Plain text to continue and chat turns (rendered with the model's chat template when it has one).
PROMPTS = (
    "The for statement in Python",
    "A decorator is",
    "Django's session framework",
    "To create a virtual environment,",
    "The json module",
    "Exceptions are",
)
CHAT_PROMPTS = (
    "What is a list comprehension?",
    "Explain Django middleware.",
    "Tell me about the datetime module.",
    "How do I read a file line by line?",
)


@dataclass
class Row:
    combination: str
    backends: str = ""  # what each kind and phase ran, as the runner chose
    perplexity: float = math.nan
    delta: float = math.nan  # relative change of perplexity against the reference
    cached_perplexity: float = math.nan  # the text scored one DECODE step a token, over the KV cache
    cached_delta: float = math.nan  # its relative change against the reference's
    top1: float = math.nan  # text positions whose argmax is the reference's
    forced: float = math.nan  # teacher-forced decode steps whose argmax is the reference's greedy token
    greedy: float = math.nan  # generated tokens equal to the reference's before the first difference
    nextn: float = math.nan  # NextN top-1 == the main model's greedy choice at the next position
    skipped: str = ""  # why the combination cannot run here


@dataclass
class Measured:
    nll: torch.Tensor  # [N] float64: -log p(token) over the text's predicted positions
    cached_nll: torch.Tensor | None  # [N] float64: the same, each position scored by a DECODE step over the cache
    top1: torch.Tensor  # [N] int64: the argmax at each
    nextn: float
    greedy: list[list[int]]
    forced: list[list[int]]  # argmax of each decode step fed the reference's greedy tokens


def parse_combination(text: str, dtype: str) -> dict[str, str]:
    """`reference`, `auto`, or kind=name pairs -> {key of FLAGS: value}; kinds not named run torch_ref."""
    if text == "reference":
        return dict(REFERENCE)
    if text == "auto":
        return {"attention": "auto", "gemm": "auto", "moe": "auto", "dtype": dtype}
    pairs = dict(pair.split("=", 1) for pair in text.split(","))
    unknown = set(pairs) - set(FLAGS)
    if unknown:
        raise ValueError(f"combination {text!r}: unknown keys {sorted(unknown)} (known: {', '.join(FLAGS)})")
    return REFERENCE | {"dtype": dtype} | pairs


def default_combinations(dtype: str) -> list[str]:
    """reference, torch_ref at `dtype`, auto, and each registered backend alone (the other kinds torch_ref) at
    `dtype`; an attention backend without absorbed MLA runs prefill only (decode needs MLA)."""
    alone = []
    for kind, entries in get_registry().backends.items():
        for name, entry in sorted(entries.items()):
            if name == "torch_ref":
                continue
            prefill_only = kind == "attention" and AttnForwardMethod.MLA not in entry.cls.capabilities.methods
            alone.append(f"{'prefill_attention' if prefill_only else kind}={name},dtype={dtype}")
    return ["reference", *([f"dtype={dtype}"] if dtype != "float32" else []), "auto", *alone]


def server_args(base: ServerArgs, combination: dict[str, str]) -> ServerArgs:
    """`base` with the combination's backends and dtype; a KV pool of KV_POOL_TOKENS unless --max-total-tokens says
    otherwise (what the harness runs needs little, and a pool sized to fill a GPU takes long to allocate). A model
    without block-FP8 weights runs no FP8 GEMM: its GEMM backend is left unnamed, as the server asks."""
    config, _ = read_config(base.model_dir, base.model_preset, base.quantization)
    if config.fp8_block is None:
        combination = {key: value for key, value in combination.items() if key != "gemm"}
    values = base.model_dump() | {FLAGS[key]: value for key, value in combination.items()}
    return ServerArgs(**values | {"max_total_tokens": base.max_total_tokens or KV_POOL_TOKENS})


def text_tokens(base: ServerArgs, path: Path, limit: int) -> list[int]:
    tokenizer = load_tokenizer(base.tokenizer_path or base.model_dir or EMBEDDED_MODEL_DIR)
    return tokenizer.encode(path.read_text(encoding="utf-8"))[: limit + 1]


def prompt_tokens(base: ServerArgs) -> list[list[int]]:
    tokenizer = load_tokenizer(base.tokenizer_path or base.model_dir or EMBEDDED_MODEL_DIR)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    if tokenizer.chat_template:
        prompts += [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)) for p in CHAT_PROMPTS]
    return prompts


@torch.inference_mode()
def score_text(runner: ModelRunner, tokens: list[int], window: int, batch: int) -> tuple[torch.Tensor, ...]:
    """Windows of `tokens`, `batch` at a time, each one EXTEND forward from position 0 -> nll [N] float64 and
    argmax [N] of each predicted position, and the NextN agreement (nan without a NextN layer)."""
    model, device = runner.model, runner.device
    starts = list(range(0, len(tokens) - 1, window))
    nll, top1, agree, count = [], [], 0, 0
    pages_per = pages_needed(window, runner.page_size)
    pages = runner.allocator.alloc(pages_per * batch)
    try:
        for first in range(0, len(starts), batch):
            chunks = [tokens[s : s + window + 1] for s in starts[first : first + batch]]
            lens = [len(c) - 1 for c in chunks]
            table = torch.tensor([pages[i * pages_per : (i + 1) * pages_per] for i in range(len(chunks))],
                                 dtype=torch.int32, device=device)
            forward_batch = runner.prepare(ForwardBatch.build(ForwardMode.EXTEND, lens, lens, table, runner.pool))
            inputs = torch.tensor([t for c in chunks for t in c[:-1]], device=device)
            targets = torch.tensor([t for c in chunks for t in c[1:]], device=device)
            attention = runner.backends.attention(forward_batch)
            attention.plan(forward_batch)
            hidden = model(inputs, forward_batch, attention)
            logits = model.compute_logits(hidden)[:, : runner.sample_vocab].double()
            nll.append(-logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1).cpu())
            top1.append(logits.argmax(-1).cpu())
            if model.nextn is not None:
                # Position i's NextN guess for token i + 2 against the main model's choice at i + 1, per window.
                guess = model.compute_logits(model.forward_nextn(targets, hidden, forward_batch, attention)).argmax(-1)
                greedy = top1[-1].to(device)
                for begin, n in zip(itertools.accumulate(lens[:-1], initial=0), lens, strict=True):
                    agree += int((guess[begin : begin + n - 1] == greedy[begin + 1 : begin + n]).sum())
                    count += n - 1
    finally:
        runner.allocator.free(pages)
    return torch.cat(nll), torch.cat(top1), torch.tensor(agree / count if count else math.nan)


@torch.inference_mode()
def score_text_cached(runner: ModelRunner, tokens: list[int], window: int, batch: int) -> torch.Tensor:
    """`score_text`'s windows, each token after the first fed by one DECODE step (every key read back from the KV
    cache) -> nll [N] float64 in score_text's order."""
    starts = list(range(0, len(tokens) - 1, window))
    nll = []
    for first in range(0, len(starts), batch):
        chunks = [tokens[s : s + window + 1] for s in starts[first : first + batch]]
        lens = [len(c) - 1 for c in chunks]
        # Windows of equal length step together; the last, shorter one alone.
        for group in ([c for c, n in zip(chunks, lens, strict=True) if n == length] for length in dict.fromkeys(lens)):
            prompts = [c[:1] for c in group]
            steps = forced_decode(runner, prompts, [c[1:] for c in group], logits=True)
            targets = torch.tensor([c[1:] for c in group])
            nll.append(-steps.log_softmax(-1).gather(2, targets[:, :, None]).squeeze(2).flatten())
    return torch.cat(nll)


@torch.inference_mode()
def forced_decode(runner: ModelRunner, prompts: list[list[int]], continuations: list[list[int]], logits: bool = False
                  ) -> Any:
    """The prompts [P][n_i] in one EXTEND, then one DECODE step per token of `continuations` [P][m], each request fed
    the continuation's token -> the argmax [P][m] before each fed token (the first from the EXTEND); with `logits`,
    the logits themselves, [P, m, vocab] float64 on the CPU."""
    device, steps = runner.device, len(continuations[0])
    pages_per = pages_needed(max(map(len, prompts)) + steps, runner.page_size)
    pages = runner.allocator.alloc(pages_per * len(prompts))
    try:
        table = torch.tensor([pages[i * pages_per : (i + 1) * pages_per] for i in range(len(prompts))],
                             dtype=torch.int32, device=device)
        lens = [len(p) for p in prompts]
        batch = runner.prepare(ForwardBatch.build(ForwardMode.EXTEND, lens, lens, table, runner.pool))
        inputs = torch.tensor([t for p in prompts for t in p], device=device)
        last = torch.tensor(list(itertools.accumulate(lens)), device=device) - 1
        choices = [runner.forward(inputs, batch, last)]
        rows = torch.arange(len(prompts), device=device)
        for step in range(steps - 1):
            lens = [n + 1 for n in lens]
            batch = runner.prepare(ForwardBatch.build(ForwardMode.DECODE, lens, [1] * len(lens), table, runner.pool))
            inputs = torch.tensor([c[step] for c in continuations], device=device)
            choices.append(runner.forward(inputs, batch, rows))
    finally:
        runner.allocator.free(pages)
    if logits:
        return torch.stack(choices, 1).double().cpu()
    return torch.stack([c.argmax(-1) for c in choices], 1).tolist()


def measure(args: ServerArgs, tokens: list[int], prompts: list[list[int]], window: int, batch: int,
            max_new_tokens: int, reference: list[list[int]] | None, cached: bool = False) -> tuple[Measured, str]:
    """One combination: the text (with `cached` also a DECODE step a token over the cache), then the prompts fed
    `reference` (the reference's greedy continuations; its own when None), through a ModelRunner; then the prompts
    through an Engine (each loads the model)."""
    runner = speculative.build_runner(args)
    chosen = ", ".join(f"{c.kind} {c.phase}: {c.name}" for c in runner.backends.chosen)
    nll, top1, nextn = score_text(runner, tokens, window, batch)
    cached_nll = score_text_cached(runner, tokens, window, batch) if cached else None
    greedy = greedy_continuations(args, prompts, max_new_tokens) if reference is None else None
    forced = forced_decode(runner, prompts, reference or greedy)
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the runner's pool and graphs, before the engine sizes its own
    greedy = greedy or greedy_continuations(args, prompts, max_new_tokens)
    return Measured(nll, cached_nll, top1, float(nextn), greedy, forced), chosen


def greedy_continuations(args: ServerArgs, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations [len(prompts)][max_new_tokens] from an Engine of `args` (EOS ignored)."""
    engine = Engine(args)
    try:
        results = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                                                          ignore_eos=True))
    finally:
        engine.shutdown()
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"plugserve failed to generate: {errors[0]}")
    return [r.token_ids for r in results]


def prefix_agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    same = total = 0
    for a, b in zip(ours, reference, strict=True):
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        total += len(b)
    return same / total


def run(base: ServerArgs, combinations: list[str], text: Path, max_text_tokens: int, window: int, batch: int,
        max_new_tokens: int, num_prompts: int | None, dtype: str, cached: bool = False) -> list[Row]:
    """Every combination against the first, which is the reference; `cached`: also the perplexity over the KV cache
    (one forward a token: what a --kv-cache-dtype moves)."""
    tokens = text_tokens(base, text, max_text_tokens)
    prompts = prompt_tokens(base)[:num_prompts]
    rows, reference = [], None
    for combination in combinations:
        row = Row(combination)
        try:
            measured, row.backends = measure(server_args(base, parse_combination(combination, dtype)), tokens,
                                             prompts, window, batch, max_new_tokens,
                                             None if reference is None else reference.greedy, cached)
        except SelectionError as exc:
            row.skipped = str(exc).split(". ")[0]
            rows.append(row)
            continue
        if reference is None:
            reference = measured
        row.perplexity = math.exp(measured.nll.mean().item())
        row.delta = row.perplexity / math.exp(reference.nll.mean().item()) - 1
        if measured.cached_nll is not None and reference.cached_nll is not None:
            row.cached_perplexity = math.exp(measured.cached_nll.mean().item())
            row.cached_delta = row.cached_perplexity / math.exp(reference.cached_nll.mean().item()) - 1
        row.top1 = (measured.top1 == reference.top1).double().mean().item()
        row.forced = sum(a == b for ours, theirs in zip(measured.forced, reference.greedy, strict=True)
                         for a, b in zip(ours, theirs, strict=True)) / sum(map(len, reference.greedy))
        row.greedy = prefix_agreement(measured.greedy, reference.greedy)
        row.nextn = measured.nextn
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row: Row) -> str:
    return (f"{row.combination:44s} {row.perplexity:10.3f} {row.delta:+9.3%} {row.cached_perplexity:10.3f} "
            f"{row.cached_delta:+9.3%} {row.top1:8.2%} {row.forced:8.2%} {row.greedy:8.2%} {row.nextn:8.2%}")


def table(rows: list[Row]) -> str:
    lines = [f"{'combination':44s} {'perplexity':>10s} {'delta':>9s} {'cached':>10s} {'delta':>9s} {'top-1':>8s} "
             f"{'forced':>8s} {'greedy':>8s} {'NextN':>8s}"]
    lines += [format_row(r) for r in rows if not r.skipped]
    lines += [f"{r.combination:44s} cannot run here: {r.skipped}" for r in rows if r.skipped]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(parser)
    parser.add_argument("--combos", nargs="+", help="combinations to measure after the reference (default: all)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="held-out text (default: %(default)s)")
    parser.add_argument("--max-text-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--text-batch", type=int, default=8, help="windows per forward")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--num-prompts", type=int, help="the first N prompts of the set only")
    parser.add_argument("--result-filename", type=Path, help="write the rows here as JSON")
    parser.add_argument("--cached", action="store_true",
                        help="also score the text one DECODE step a token over the KV cache (slow; what "
                             "--kv-cache-dtype moves: a window's own prefill never reads the cache)")
    namespace = parser.parse_args(argv)
    base = server_args_from(namespace, parser)
    device = base.device if base.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = base.dtype if base.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    combinations = ["reference", *[c for c in (namespace.combos or default_combinations(dtype)[1:])
                                   if c != "reference"]]
    rows = run(base, combinations, namespace.text, namespace.max_text_tokens, namespace.window,
               namespace.text_batch, namespace.max_new_tokens, namespace.num_prompts, dtype, namespace.cached)
    print(table(rows))
    if namespace.result_filename:
        namespace.result_filename.write_text(json.dumps({"model": base.model_path or base.model_preset or "embedded",
                                                         "device": device, "rows": [asdict(r) for r in rows]},
                                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
