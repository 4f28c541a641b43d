"""Before serving: every shape the server will run, once, so that JIT compiles, autotuning, FlashInfer plans and
CUDA-graph capture happen here and not inside a request."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import pages_needed
from plugserve.core.progress import track
from plugserve.runtime.backends import WARMUP_PREFILL_TOKENS
from plugserve.runtime.metrics import report_late_triton_compiles
from plugserve.runtime.model_runner import ModelRunner

# A short extension over each warmed prompt (absorbed-MLA extend over a cached prefix).
WARMUP_EXTEND_TOKENS = 16
CPU_WARMUP_TOKENS = 64  # nothing compiles on the CPU: the warm-up only walks the paths
# The warm-up prefills every power of two from here to the largest bucket: Triton's MoE and GEMM backends pick
# launch configurations by token count, so a prompt between two warmed sizes would compile its own on first use.
WARMUP_MIN_PREFILL_TOKENS = 16


@torch.inference_mode()
def warm_up(runner: ModelRunner, on_late_compile: Callable[[], None] | None = None,
            part: tuple[int, int] | None = None) -> None:
    """Before serving: every prefill bucket's backend on a prompt of its size and of each power of two below
    it down to WARMUP_MIN_PREFILL_TOKENS (and an extension of each over the cached prefix), every decode
    bucket's eagerly (with speculative decoding, the NextN layer after each prefill and a round's forwards
    at each decode batch size), then the CUDA graphs. JIT compiles, autotuning and FlashInfer plans happen
    here, not in a request. After it, each Triton kernel compiled is logged and `on_late_compile` called
    (`report_late_triton_compiles`). `part` (k, n): only every n-th shape and graph size from the k-th, quietly
    (`precompile`'s processes split the warm-up so)."""
    prefill_buckets, decode_buckets = runner.backends.prefill_buckets, runner.backends.decode_buckets
    cap = WARMUP_PREFILL_TOKENS if runner.device.type == "cuda" else CPU_WARMUP_TOKENS
    largest = min(prefill_buckets[-1].max_size, cap,
                  runner.allocator.num_pages * runner.page_size - WARMUP_EXTEND_TOKENS)
    ladder = itertools.takewhile(lambda n: n < largest,
                                 (WARMUP_MIN_PREFILL_TOKENS << i for i in itertools.count()))
    sizes = sorted({*ladder, *(min(b.max_size, largest) for b in prefill_buckets)})
    steps = [*(functools.partial(warm_up_prefill, runner, n) for n in sizes),
             *(functools.partial(warm_up_decode, runner, min(b.max_size, runner.allocator.num_pages))
               for b in decode_buckets)]
    if runner.args.speculative is not None:
        n = runner.args.speculative.num_draft_tokens
        per_request = pages_needed(2 * n, runner.page_size)
        steps += [functools.partial(warm_up_speculative, runner, min(b.max_size, runner.allocator.num_pages
                                                                   // per_request), n)
                  for b in decode_buckets]
    if runner.args.skip_server_warmup:  # --skip-server-warmup: each shape compiles on its first request instead
        steps = []
    if part is not None:
        steps = steps[part[0]::part[1]]
    for step in steps if part is not None else track(steps, len(steps), "warm-up", "shapes"):
        step()
    if runner.graph_max_bs:
        runner.capture_graphs(part)
    if runner.device.type == "cuda" and part is None:
        report_late_triton_compiles(on_late_compile)


def scratch_forward(runner: ModelRunner, mode: ForwardMode, seq_lens: list[int], extend_lens: list[int],
                     pages: list[list[int]], nextn: bool = False) -> None:
    """One forward over scratch pages (`pages[i]`: request i's, at least ceil(seq_len / page_size)) with
    token id 0 everywhere, through the batch's own backend: the model's, or with `nextn` its NextN layer's
    (on zero hidden states)."""
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [p[-1]] * (width - len(p)) for p in pages], dtype=torch.int32)
    batch = runner.prepare(ForwardBatch.build(mode, seq_lens, extend_lens, table.to(runner.device), runner.pool))
    if runner.dp_size > 1:  # every rank runs the same batch
        batch.dp_tokens = [batch.num_tokens] * runner.dp_size
    ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=runner.device)
    attention = runner.backends.attention(batch)
    if not nextn:
        runner.logits(ids, batch, attention, plan=True)
        return
    attention.plan(batch)
    hidden = torch.zeros(batch.num_tokens, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
    runner.model.compute_logits(runner.model.forward_nextn(ids, hidden, batch, attention))


def warm_up_prefill(runner: ModelRunner, num_tokens: int) -> None:
    total = num_tokens + WARMUP_EXTEND_TOKENS
    pages = runner.allocator.alloc(pages_needed(total, runner.page_size))
    try:
        for seq_len, new in ((num_tokens, num_tokens), (total, WARMUP_EXTEND_TOKENS)):
            scratch_forward(runner, ForwardMode.EXTEND, [seq_len], [new], [pages])
            if runner.args.speculative is not None:  # the NextN layer follows every prefill
                scratch_forward(runner, ForwardMode.EXTEND, [seq_len], [new], [pages], nextn=True)
    finally:
        runner.allocator.free(pages)


def warm_up_decode(runner: ModelRunner, batch_size: int) -> None:
    pages = runner.allocator.alloc(batch_size)
    try:
        scratch_forward(runner, ForwardMode.DECODE, [1] * batch_size, [1] * batch_size, [[p] for p in pages])
    finally:
        runner.allocator.free(pages)


def warm_up_speculative(runner: ModelRunner, batch_size: int, n: int) -> None:
    """A speculative round's forwards for `batch_size` requests of n draft tokens: the target's TARGET_VERIFY,
    the NextN layer's draft steps (DECODE) and its DRAFT_EXTEND (padded to n tokens per request)."""
    per_request = pages_needed(2 * n, runner.page_size)
    pages = runner.allocator.alloc(per_request * batch_size)
    try:
        rows = [pages[i * per_request : (i + 1) * per_request] for i in range(batch_size)]
        scratch_forward(runner, ForwardMode.TARGET_VERIFY, [2 * n] * batch_size, [n] * batch_size, rows)
        for mode, new in ((ForwardMode.DECODE, 1), (ForwardMode.DRAFT_EXTEND, n)):
            scratch_forward(runner, mode, [n + new] * batch_size, [new] * batch_size, rows, nextn=True)
    finally:
        runner.allocator.free(pages)
