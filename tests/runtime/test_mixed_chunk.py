"""--enable-mixed-chunk: the running requests decode inside the prefill batches of a long prompt's chunks, with the
tokens, logprobs, stops, streams and grammars they get without it (the tiny preset's random unquantized weights,
whose greedy outputs do not depend on batching: tests/runtime/test_engine.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from plugserve.core.forward_batch import ForwardMode
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR, load_tokenizer
from plugserve.runtime.engine import Engine
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.radix_cache import RadixCache
from plugserve.runtime.request import FinishReason, Request, RequestOutput
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.scheduled_batch import ScheduledBatch
from plugserve.runtime.scheduler import Scheduler
from plugserve.runtime.server_args import ServerArgs
from tests.checkpoints import random_hf_model, save_hf_model, tiny_v3_config
from tests.engine_checks import assert_every_page_is_back

CHUNK = 16
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
# The short prompts are prefilled first; the long one's chunks follow while they decode.
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "import numpy as np\n" * 16]
LONG = "import numpy as np\n" * 40


def _args(**flags: object) -> ServerArgs:
    return ServerArgs(model_preset="tiny", chunked_prefill_size=CHUNK, **flags)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def plain() -> Iterator[Engine]:
    engine = Engine(_args())
    yield engine
    engine.shutdown()


def _mixed_engine(args: ServerArgs | None = None, **flags: object) -> tuple[Engine, list[int]]:
    """A ready engine with the flag (`args`, else the tiny preset's with `flags`), and the riders of each forward it
    runs from now on (0: not a mixed batch)."""
    engine = Engine(args or _args(enable_mixed_chunk=True, **flags))
    assert engine.ready.wait(60)
    riders: list[int] = []
    forward = engine.scheduler.forward

    def counting(batch: ScheduledBatch):
        riders.append(batch.mixed)
        return forward(batch)

    engine.scheduler.forward = counting  # type: ignore[method-assign]
    return engine, riders


@pytest.mark.parametrize(
    "flags",
    [{}, {"disable_overlap_schedule": True}, {"chunked_prefix_cache_threshold": 0},
     {"max_total_tokens": 160}],
    ids=["overlap", "no-overlap", "mha-over-prefixes", "tiny-pool"],
)
def test_greedy_outputs_equal_those_without_the_flag(plain, flags):
    """40 tokens each. mha-over-prefixes: the riders' prefixes de-compressed (MHA) rather than absorbed MLA;
    tiny-pool: requests wait for room and are retracted (the four need more than its 160 tokens)."""
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    expected = [r.token_ids for r in plain.generate(PROMPTS, params)]
    engine, riders = _mixed_engine(**flags)
    try:
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected
        assert max(riders) >= 2, riders  # the short requests decoded inside the long prompt's chunks
        assert engine.metrics.retractions._value.get() > 0 or "max_total_tokens" not in flags
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


def _collector(results: dict[str, list[RequestOutput]], name: str, expected: int, done: threading.Event):
    def on_output(output: RequestOutput) -> None:
        results.setdefault(name, []).append(output)
        if output.finished and sum(o[-1].finished for o in results.values()) == expected:
            done.set()
    return on_output


def _wait_for_tokens(results: dict[str, list[RequestOutput]], names: list[str], count: int) -> None:
    deadline = time.monotonic() + 30
    while (min(sum(len(o.token_ids) for o in results.get(n, [])) for n in names) < count
           and time.monotonic() < deadline):
        time.sleep(0.005)


def test_logprobs_penalties_stops_grammar_and_streams_ride_along():
    """Requests of every kind are streaming while a long prompt arrives: their streamed increments add up to what
    each gives without the flag (logprobs to float tolerance). Both engines are deterministic: the batches the riders
    join depend on timing, and without the flag a near-tied greedy token may flip with the batch around it (the
    README's "What may vary")."""
    plain = Engine(_args(enable_deterministic_inference=True))
    try:
        sampled = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
        reference_text = plain.generate(PROMPTS[0], GREEDY)[0].text
        jobs = {
            "logprobs": (PROMPTS[0], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, logprobs=True,
                                                   top_logprobs=3)),
            "penalties": (PROMPTS[1], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True,
                                                     frequency_penalty=0.7, repetition_penalty=1.3)),
            "stop": (PROMPTS[0], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True,
                                                stop=[reference_text[len(reference_text) // 2 :][:3]])),
            "seeded": (PROMPTS[2], sampled),
            "grammar": (PROMPTS[2], SamplingParams(max_new_tokens=24, temperature=1.0, seed=5,
                                                   regex="(yes|no)-[0-9]{3}-[a-z]{8}")),
        }
        expected = {name: plain.generate(prompt, params)[0] for name, (prompt, params) in jobs.items()}
    finally:
        plain.shutdown()
    engine, riders = _mixed_engine(enable_deterministic_inference=True)
    try:
        done, results = threading.Event(), {}
        for name, (prompt, params) in jobs.items():
            engine.submit(prompt, params, _collector(results, name, len(jobs) + 1, done))
        _wait_for_tokens(results, list(jobs), 1)
        engine.submit(LONG, GREEDY, _collector(results, "long", len(jobs) + 1, done))
        assert done.wait(60), "a request hung"
        assert max(riders) >= 2, riders
        for name, want in expected.items():
            outputs = results[name]
            assert "".join(o.text for o in outputs) == want.text, name
            assert [t for o in outputs for t in o.token_ids] == want.token_ids, name
            assert outputs[-1].finish_reason is want.finish_reason, name
            got = [entry for o in outputs for entry in o.logprobs]
            assert [e.token_id for e in got] == [e.token_id for e in want.logprobs], name
            assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4), name
            assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top] for e in want.logprobs], name
        assert len(expected["logprobs"].logprobs) == 24 and expected["stop"].finish_reason is FinishReason.STOP
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_an_abort_and_a_failing_prefill_leave_the_riders_tokens(plain, overlap):
    """While a long prompt is prefilled in chunks, a rider is aborted, and another prompt's forward raises in a
    batch it shares with riders: the other riders get the tokens they get without the flag, every page comes
    back."""
    bad_ids, long_ids = plain.tokenize("A prompt whose forward raises " * 12), plain.tokenize(LONG)
    long = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    clean = [r.token_ids for r in plain.generate(PROMPTS[:3], long)]
    failed: list[set[str]] = []  # the requests of each forward that raised
    rids: list[str] = []

    def fault_hook(mode: ForwardMode, requests: list[Request]) -> None:
        if mode is ForwardMode.EXTEND and any(r.prompt_ids == long_ids for r in requests) and len(rids) == 3:
            engine.abort(rids.pop())  # handled by the scheduler's thread between two of the long prompt's chunks
        if mode is ForwardMode.EXTEND and any(r.prompt_ids == bad_ids for r in requests):
            failed.append({r.rid for r in requests})
            raise RuntimeError("forward failure")

    engine = Engine(_args(enable_mixed_chunk=True, disable_overlap_schedule=not overlap), fault_hook=fault_hook)
    try:
        done, results = threading.Event(), {}
        rids += [engine.submit(p, long, _collector(results, f"r{i}", 5, done)) for i, p in enumerate(PROMPTS[:3])]
        riders = set(rids[:2])
        _wait_for_tokens(results, ["r0", "r1", "r2"], 2)
        engine.submit(long_ids, GREEDY, _collector(results, "long", 5, done))
        engine.submit(bad_ids, GREEDY, _collector(results, "bad", 5, done))
        assert done.wait(60), "a request hung"
        assert any(f & riders for f in failed)  # the failing prefill shared its forward with riders
        assert results["bad"][-1].finish_reason is FinishReason.ERROR
        assert results["r2"][-1].finish_reason is FinishReason.ABORT
        assert sum(len(o.token_ids) for o in results["r2"]) < 40
        assert [t for o in results["long"] for t in o.token_ids] == plain.generate(long_ids, GREEDY)[0].token_ids
        for i in range(2):
            assert results[f"r{i}"][-1].finish_reason is FinishReason.LENGTH, results[f"r{i}"][-1].error
            assert [t for o in results[f"r{i}"] for t in o.token_ids] == clean[i]
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


def test_deterministic_inference_gives_a_riders_tokens_bit_for_bit():
    """On the embedded model, whose greedy tokens batching moves without --enable-deterministic-inference: a request
    decoding inside another prompt's chunks gives the tokens and logprobs it gives alone."""
    engine, riders = _mixed_engine(ServerArgs(enable_deterministic_inference=True, enable_mixed_chunk=True,
                                              chunked_prefill_size=8))
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    prompt = "To reset a user password in Django,"
    try:
        [alone] = engine.generate(prompt, params)
        engine.flush_cache()
        riders.clear()
        ridden = engine.generate([prompt, "The history of the Roman empire, " * 6], params)[0]
        assert max(riders) == 1, riders
        assert ridden.token_ids == alone.token_ids
        assert [lp.logprob for lp in ridden.logprobs] == [lp.logprob for lp in alone.logprobs]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(_args(enable_mixed_chunk=True))


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "unmixed"])
def test_decoding_advances_during_the_chunks_of_a_long_prefill(runner, mixed):
    """Each chunk of the long prompt is one forward that also decodes a token of every running request; without
    mixing, decoding stalls until the prompt is through."""
    scheduler = Scheduler(runner, RadixCache(runner.allocator, runner.page_size), load_tokenizer(EMBEDDED_MODEL_DIR))
    scheduler.mixed_chunk, scheduler.overlap = mixed, False  # a step: one forward and its tokens
    outputs: list[RequestOutput] = []
    short = [Request(f"s{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=60, ignore_eos=True), outputs.append)
             for i in range(2)]
    long = Request("long", list(range(10, 10 + 6 * CHUNK)), SamplingParams(max_new_tokens=2), outputs.append)
    try:
        for request in short:
            scheduler.add(request)
        while not all(r.num_resolved for r in short):
            scheduler.step()
        scheduler.add(long)
        before, forwards = [r.num_resolved for r in short], 0
        while not long.num_resolved:
            scheduler.step()
            forwards += 1
        advanced = [r.num_resolved - b for r, b in zip(short, before, strict=True)]
        if mixed:  # 96 prompt tokens, 14 a chunk: the riders take 2 of the 16
            assert (forwards, advanced) == (7, [7, 7])
        else:
            assert (forwards, advanced) == (6, [0, 0])
    finally:
        for request in [*short, long]:
            scheduler.abort(request.rid)
        scheduler.shutdown()


def test_the_flag_is_refused_with_speculative_decoding():
    assert ServerArgs(enable_mixed_chunk=True).enable_mixed_chunk
    with pytest.raises(ValueError, match="--enable-mixed-chunk does not combine with --speculative-algorithm"):
        ServerArgs(enable_mixed_chunk=True, speculative_algorithm="NEXTN")


def test_under_dp_attention_each_group_mixes_its_own_requests(tmp_path):
    """--tp-size 2 --dp-size 2 on the CPU (rank 1 a worker process): the long prompt's group decodes its other
    request inside the chunks, with the tokens of one process without the flag."""
    model_dir = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path)
    prompts = [[5, 17, 250, 3], [300, 1, 64], [7, 99, 42], list(range(40, 140))]  # the tiny vocabulary's ids
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    flags = {"model_path": str(model_dir), "tokenizer_path": str(EMBEDDED_MODEL_DIR), "device": "cpu",
             "max_total_tokens": 2048, "chunked_prefill_size": CHUNK}
    single = Engine(ServerArgs(**flags))  # type: ignore[arg-type]
    try:
        expected = [r.token_ids for r in single.generate(prompts, params)]
    finally:
        single.shutdown()
    riders: list[int] = []  # the requests of each EXTEND forward that were decoding already

    def fault_hook(mode: ForwardMode, requests: list[Request]) -> None:
        if mode is ForwardMode.EXTEND:
            riders.append(sum(len(r.output_ids) > 1 for r in requests))

    engine = Engine(ServerArgs(**flags, tp_size=2, enable_dp_attention=True, dp_size=2,  # type: ignore[arg-type]
                               enable_mixed_chunk=True), fault_hook=fault_hook)
    try:
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected
        assert max(riders) >= 1, riders
        engine.check_pool_accounting()
    finally:
        engine.shutdown()
