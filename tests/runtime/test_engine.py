"""The engine on the tiny preset: batching, chunked prefill, overlap, retraction, abort.

The scheduling tests run the tiny preset's random unquantized weights, whose greedy outputs do not depend on how
requests are batched. The embedded model's would: its block-FP8 GEMMs round activations per 128-group, and a
rounding that batching moves can flip a near-tie. The embedded model has its own tests (tests/assets)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from plugserve.core.forward_batch import ForwardMode
from plugserve.core.kv_cache import PoolAccountingError
from plugserve.runtime.engine import Engine, served_model_names
from plugserve.runtime.metrics import SGLANG_NAMES
from plugserve.runtime.request import FinishReason
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from tests.engine_checks import assert_every_page_is_back

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "import numpy as np\n" * 20]


@pytest.fixture(scope="module")
def engine():
    engine = Engine(ServerArgs(model_preset="tiny"))
    yield engine
    engine.shutdown()


def _texts(engine: Engine, prompts=PROMPTS, params=GREEDY) -> list[str]:
    return [r.text for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def solo(engine) -> list[str]:
    """Each prompt run on its own."""
    return [_texts(engine, [p])[0] for p in PROMPTS]


def test_batched_equals_solo(engine, solo):
    assert _texts(engine) == solo


@pytest.mark.parametrize(
    "args",
    [
        ServerArgs(model_preset="tiny", disable_overlap_schedule=True),
        ServerArgs(model_preset="tiny", chunked_prefill_size=16),  # the long prompt is prefilled in several chunks
        ServerArgs(model_preset="tiny", disable_radix_cache=True, page_size=4),
        ServerArgs(model_preset="tiny", max_total_tokens=200, max_running_requests=3),  # waiting and retraction
    ],
    ids=["no-overlap", "chunked-prefill", "no-radix-page4", "tiny-pool"],
)
def test_scheduling_variants_give_the_same_greedy_outputs(args, solo):
    engine = Engine(args)
    try:
        results = engine.generate(PROMPTS, GREEDY)
        assert [r.text for r in results] == solo
        assert all(r.completion_tokens == GREEDY.max_new_tokens for r in results)
    finally:
        engine.shutdown()


def test_far_too_small_kv_pool_loses_no_request():
    engine = Engine(ServerArgs(model_preset="tiny", max_total_tokens=48))
    try:
        params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
        results = engine.generate([f"request number {i}: tell me" for i in range(12)], params)
        assert [r.finish_reason for r in results] == [FinishReason.LENGTH] * 12
        assert all(r.completion_tokens == 24 for r in results)
        assert engine.metrics.retractions._value.get() > 0
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


def test_prefix_cache_reuses_a_shared_prompt(engine):
    prefix = "You are a helpful assistant. " * 8
    first = engine.generate(prefix + "What is 2 + 2?", GREEDY)[0]
    second = engine.generate(prefix + "Name a colour.", GREEDY)[0]
    assert second.cached_tokens >= len(engine.tokenize(prefix)) - 1
    assert second.cached_tokens > first.cached_tokens


def test_stop_strings_stop_tokens_and_eos(engine, solo):
    text = solo[0]
    stop = text[5:8]
    result = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0, stop=[stop]))[0]
    assert result.finish_reason is FinishReason.STOP and result.matched_stop == stop
    assert result.text == text[: text.find(stop)]
    tokens = engine.generate(PROMPTS[0], GREEDY)[0].token_ids
    by_id = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0,
                                                       stop_token_ids=[tokens[3]]))[0]
    assert by_id.token_ids == tokens[: tokens.index(tokens[3]) + 1] and by_id.matched_stop == tokens[3]


def test_streaming_increments_add_up(engine, solo):
    outputs = list(engine.stream(PROMPTS[1], GREEDY))
    assert "".join(o.text for o in outputs) == solo[1]
    assert outputs[-1].finished and sum(len(o.token_ids) for o in outputs) == GREEDY.max_new_tokens


def test_seeded_sampling_is_reproducible_and_n_expands(engine):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, n=3)
    first, second = engine.generate(PROMPTS[0], params), engine.generate(PROMPTS[0], params)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert len({tuple(r.token_ids) for r in first}) > 1  # seeds 7, 8, 9 differ


def test_samples_whose_seeds_leave_the_generators_range_are_refused_before_any_runs(engine):
    """n samples take seeds seed, seed + 1, ...: the second one here used to fail in torch after the first ran."""
    with pytest.raises(ValueError, match=r"seed must be None or in \[0, 2\^64\)"):
        engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2, seed=2**64 - 1, n=2))
    assert engine.num_outstanding == 0


def test_a_bad_prompt_among_several_is_refused_before_any_is_queued(engine):
    """generate checks every prompt first: the good prompts before a bad one used to run, their outputs unread."""
    with pytest.raises(ValueError):
        engine.generate([PROMPTS[0], [10**9]], SamplingParams(max_new_tokens=2))
    assert engine.num_outstanding == 0


def test_generate_hands_its_requests_to_the_scheduler_in_one_command(engine, monkeypatch):
    """All of a generate call's requests reach the scheduler between the same two steps, so how they batch does not
    depend on the threads' timing (queued one by one, a loaded machine once split them over two steps)."""
    inbox = engine._inbox

    class CountingInbox:
        puts = 0

        def put(self, command):
            CountingInbox.puts += 1
            inbox.put(command)

        def __getattr__(self, name):
            return getattr(inbox, name)

    monkeypatch.setattr(engine, "_inbox", CountingInbox())
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, n=2))
    assert len(results) == 8 and CountingInbox.puts == 1


def test_abort_frees_the_request(engine):
    done = threading.Event()
    outputs = []

    def on_output(output):
        outputs.append(output)
        if output.finished:
            done.set()

    rid = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=2000, ignore_eos=True), on_output)
    # Aborted once it holds KV: a few tokens in.
    deadline = time.monotonic() + 30
    while sum(len(o.token_ids) for o in outputs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_outstanding == 1 and not done.is_set()
    engine.abort(rid)
    assert done.wait(30)
    assert outputs[-1].finish_reason is FinishReason.ABORT
    assert_every_page_is_back(engine)


@pytest.mark.parametrize("prompt", [[], [10**9], "x " * 9000])
def test_bad_prompts_are_refused(engine, prompt):
    with pytest.raises(ValueError):
        engine.tokenize(prompt)


def test_a_request_failing_in_its_stop_rules_ends_alone_and_the_engine_goes_on(engine):
    """A bad stop_token_ids ("ab": `token in "ab"` raises TypeError) used to kill the scheduler thread and
    hang every later request."""
    bad = SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids="ab")  # type: ignore[arg-type]
    good = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    done = threading.Event()
    results = {}

    def collect(name):
        def on_output(output):
            if output.finished:
                results[name] = output
                if len(results) == 2:
                    done.set()
        return on_output

    engine.submit("Hello", bad, collect("bad"))
    engine.submit("Hello", good, collect("good"))
    assert done.wait(30), "a request hung"
    assert results["bad"].finish_reason is FinishReason.ERROR and "TypeError" in results["bad"].error
    assert results["good"].finish_reason is FinishReason.LENGTH and results["good"].completion_tokens == 4
    assert engine.alive
    assert engine.generate("Hello", good)[0].completion_tokens == 4


def test_a_failing_scheduler_step_ends_every_held_request_and_the_loop_goes_on(engine, monkeypatch):
    real_step = engine.scheduler.step
    calls = []

    def step():
        if not calls:
            calls.append(1)
            raise RuntimeError("scheduler bug")
        real_step()

    monkeypatch.setattr(engine.scheduler, "step", step)
    [result] = engine.generate("Hello", SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    assert result.finish_reason is FinishReason.ERROR and "scheduler bug" in result.error
    monkeypatch.undo()
    assert engine.generate("Hello", SamplingParams(max_new_tokens=3, ignore_eos=True))[0].completion_tokens == 3
    assert engine.runner.allocator.num_free + engine.radix.evictable_pages == engine.runner.allocator.num_pages


def _collector(results: dict, name: str, expected: int, done: threading.Event):
    def on_output(output):
        results.setdefault(name, []).append(output)
        if output.finished and sum(o[-1].finished for o in results.values()) == expected:
            done.set()
    return on_output


def test_a_request_failing_while_scheduled_ends_alone_and_the_engine_goes_on(engine, monkeypatch):
    """A failure planning one request (here matching its prompt in the prefix cache) ended every request held."""
    bad_ids = engine.tokenize("A request the scheduler trips over")
    real = engine.scheduler._reuse_prefix

    def reuse_prefix(request):
        if request.prompt_ids == bad_ids:
            raise RuntimeError("planning bug")
        real(request)

    monkeypatch.setattr(engine.scheduler, "_reuse_prefix", reuse_prefix)
    done, results = threading.Event(), {}
    engine.submit(bad_ids, GREEDY, _collector(results, "bad", 2, done))
    engine.submit(PROMPTS[0], GREEDY, _collector(results, "good", 2, done))
    assert done.wait(30), "a request hung"
    assert results["bad"][-1].finish_reason is FinishReason.ERROR
    assert results["bad"][-1].error == "RuntimeError: planning bug"
    assert results["good"][-1].finish_reason is FinishReason.LENGTH and results["good"][-1].completion_tokens == 12
    assert engine.alive
    assert_every_page_is_back(engine)


def test_a_batch_that_cannot_be_built_ends_its_requests_alone(engine, monkeypatch):
    """A request decoding goes on when the prefill batch of a newcomer fails to build (it used to end too)."""
    real, armed = engine.runner.prepare, threading.Event()

    def prepare(batch):
        if armed.is_set() and batch.mode is ForwardMode.EXTEND:
            armed.clear()
            raise RuntimeError("batch bug")
        real(batch)

    monkeypatch.setattr(engine.runner, "prepare", prepare)
    done, results = threading.Event(), {}
    engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True),
                  _collector(results, "running", 2, done))
    deadline = time.monotonic() + 30
    while sum(len(o.token_ids) for o in results.get("running", [])) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    armed.set()
    engine.submit(PROMPTS[2], GREEDY, _collector(results, "newcomer", 2, done))
    assert done.wait(60), "a request hung"
    assert results["newcomer"][-1].finish_reason is FinishReason.ERROR
    assert results["newcomer"][-1].error == "RuntimeError: batch bug"
    assert results["running"][-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.token_ids) for o in results["running"]) == 60
    assert_every_page_is_back(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_forward_leaves_none_of_its_kv_in_the_prefix_cache(solo, overlap):
    """A failed batch used to give the prefix cache the pages it never wrote: the same prompt then reused them
    and was answered from garbage KV (a 200 with wrong text)."""
    calls: list[ForwardMode] = []

    def fault_hook(mode, requests):
        calls.append(mode)
        if len(calls) == 1:
            raise RuntimeError("forward failure")

    engine = Engine(ServerArgs(model_preset="tiny", max_total_tokens=1024, disable_overlap_schedule=not overlap),
                    fault_hook=fault_hook)
    try:
        assert engine.ready.wait(60)
        [failed] = engine.generate(PROMPTS[3], GREEDY)
        assert failed.finish_reason is FinishReason.ERROR and failed.error == "RuntimeError: forward failure"
        [again] = engine.generate(PROMPTS[3], GREEDY)
        assert again.text == solo[3]
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_failing_forward_ends_only_its_request_while_others_decode(overlap):
    """With overlap, the decode batch planned while a newcomer's prefill ran took that prefill's failed tokens as
    inputs and re-raised its error: every request decoding at that moment ended with it."""
    bad_ids: list[int] = []

    def fault_hook(mode, requests):
        if mode is ForwardMode.EXTEND and any(r.prompt_ids == bad_ids for r in requests):
            raise RuntimeError("forward failure")

    engine = Engine(ServerArgs(model_preset="tiny", disable_overlap_schedule=not overlap), fault_hook=fault_hook)
    try:
        assert engine.ready.wait(60)
        long = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        clean = [r.token_ids for r in engine.generate(PROMPTS[:2], long)]
        bad_ids += engine.tokenize("A prompt whose forward raises")
        done, results = threading.Event(), {}
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.submit(prompt, long, _collector(results, f"running{i}", 3, done))
        deadline = time.monotonic() + 30
        while (min(sum(len(o.token_ids) for o in results.get(f"running{i}", [])) for i in range(2)) < 2
               and time.monotonic() < deadline):
            time.sleep(0.005)
        engine.submit(bad_ids, GREEDY, _collector(results, "bad", 3, done))
        assert done.wait(60), "a request hung"
        assert results["bad"][-1].finish_reason is FinishReason.ERROR
        assert results["bad"][-1].error == "RuntimeError: forward failure"
        for i in range(2):
            outputs = results[f"running{i}"]
            assert outputs[-1].finish_reason is FinishReason.LENGTH, outputs[-1].error
            assert [t for o in outputs for t in o.token_ids] == clean[i]
        engine.check_pool_accounting()
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


def test_a_request_may_name_the_model_by_its_listed_id_or_a_launch_name():
    listed, names = served_model_names(ServerArgs(model_path="/models/DeepSeek-V3", served_model_name="ds"))
    assert listed == "ds" and names == {"ds", "/models/DeepSeek-V3"}
    assert served_model_names(ServerArgs(model_path="/models/V3")) == ("/models/V3", frozenset({"/models/V3"}))
    assert served_model_names(ServerArgs(model_preset="tiny")) == ("tiny", frozenset({"tiny"}))
    assert served_model_names(ServerArgs()) == ("plugserve-embedded", frozenset({"plugserve-embedded"}))


def test_seed_makes_unseeded_sampling_reproducible():
    """--seed seeds the generators unseeded requests draw from (not only the dummy weights)."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)

    def text(seed: int) -> str:
        engine = Engine(ServerArgs(model_preset="tiny", seed=seed, max_total_tokens=256))
        try:
            engine_text = engine.generate("Hello", params)[0].text
        finally:
            engine.shutdown()
        return engine_text

    first = text(5)
    torch.rand(100)  # whatever else draws from torch's global generator: the engine's seed decides
    assert text(5) == first


def test_pool_accounting_catches_a_leaked_page_and_a_stray_lock(engine):
    engine.generate(PROMPTS[0], GREEDY)  # something in the prefix cache
    assert_every_page_is_back(engine)
    [page] = engine.runner.allocator.alloc(1)  # owned by no one: the engine is idle
    with pytest.raises(PoolAccountingError, match=rf"1 pages leaked .*\[{page}\]"):
        engine.check_pool_accounting()
    engine.runner.allocator.free([page])
    match = engine.radix.match_prefix(engine.tokenize(PROMPTS[0]))
    engine.radix.lock(match.node)  # a lock no request holds
    with pytest.raises(PoolAccountingError, match="locks, its users hold 0"):
        engine.check_pool_accounting()
    engine.radix.unlock(match.node)
    row = engine.runner.block_table.acquire()  # a block-table row no request holds
    with pytest.raises(PoolAccountingError, match=rf"rows taken by no request: \[{row}\]"):
        engine.check_pool_accounting()
    engine.runner.block_table.release(row)
    engine.check_pool_accounting()


def _sample(engine: Engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


def _exported(engine: Engine) -> dict[str, float]:
    """/metrics as the server sends it: each unlabelled-but-for-model_name sample, by its exported name."""
    families = text_string_to_metric_families(engine.metrics.render().decode())
    return {s.name: s.value for f in families for s in f.samples if set(s.labels) == {"model_name"}}


def _idle_values(engine: Engine) -> dict[str, float]:
    """What an idle server's gauges read: nothing running, queued or generated; the KV pages in use are those the
    prefix cache keeps (evictable only)."""
    allocator = engine.runner.allocator
    cached = engine.radix.evictable_pages / allocator.num_pages
    capacity = _sample(engine, "plugserve_max_total_num_tokens")
    values = {"plugserve_num_running_requests": 0.0, "plugserve_num_waiting_requests": 0.0,
              "plugserve_gen_throughput": 0.0, "plugserve_kv_cache_usage": cached,
              "plugserve_num_used_tokens": float(round(cached * capacity))}
    return values | {SGLANG_NAMES[name]: value for name, value in values.items()}


def _assert_idle(engine: Engine, deadline: float) -> None:
    """Every gauge reads its idle value, under plugserve's and SGLang's names, once the loop has seen it has
    nothing to run (a few 50 ms ticks)."""
    def readings() -> tuple[dict[str, float], dict[str, float]]:
        exported, idle = _exported(engine), _idle_values(engine)
        return {name: exported.get(name) for name in idle}, idle

    while (state := readings())[0] != pytest.approx(state[1]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state[0] == pytest.approx(state[1])
    assert engine.radix.protected_pages == 0 and state[1]["plugserve_kv_cache_usage"] > 0  # the cache keeps some


def test_idle_gauges_read_zero_and_token_counters_match_usage():
    """After a mix of requests ends (batched, n > 1, streamed, aborted, failed in its forward), every gauge of
    /metrics reads an idle server and the token counters match the usage the requests reported: the running
    gauge used to keep the last batch's requests, throughput its last busy value, and the generated-token counter
    missed each first token."""
    bad_ids: list[int] = []

    def fault_hook(mode, requests):
        if any(r.prompt_ids == bad_ids for r in requests):
            raise RuntimeError("forward failure")

    engine = Engine(ServerArgs(model_preset="tiny"), fault_hook=fault_hook)
    try:
        finals = list(engine.generate(PROMPTS, GREEDY))
        finals += engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=3))
        finals.append(list(engine.stream(PROMPTS[2], GREEDY))[-1])
        bad_ids += engine.tokenize("A prompt whose forward raises")
        [failed] = engine.generate(bad_ids, GREEDY)
        assert failed.finish_reason is FinishReason.ERROR and failed.completion_tokens == 0
        deadline = time.monotonic() + 30
        _assert_idle(engine, time.monotonic() + 5)
        outputs: list = []
        rid = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=2000, ignore_eos=True), outputs.append)
        # Running past a throughput window (1 s) before the abort, so that the gauges had busy values.
        while (sum(len(o.token_ids) for o in outputs) < 3 or _sample(engine, "plugserve_gen_throughput") == 0) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = _exported(engine)
        assert busy["sglang:gen_throughput"] > 0 and busy["sglang:num_running_reqs"] == 1
        engine.abort(rid)
        while not (outputs and outputs[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outputs[-1].finish_reason is FinishReason.ABORT
        finals.append(outputs[-1])
        _assert_idle(engine, deadline)
        exported = _exported(engine)
        for name in ("plugserve_generation_tokens_total", "sglang:generation_tokens_total"):
            assert exported[name] == sum(f.completion_tokens for f in finals), name
        for name in ("plugserve_prompt_tokens_total", "sglang:prompt_tokens_total"):
            assert exported[name] == sum(f.prompt_tokens for f in finals), name
    finally:
        engine.shutdown()


def test_stream_interval_request_logs_batch_lines_and_chat_template(solo, caplog):
    """--stream-interval 3 streams the first token, then every 3, then the rest, with the same text; --log-requests
    logs each finished request, --decode-log-interval 2 SGLang's batch line; --chat-template replaces the
    tokenizer's."""
    args = ServerArgs(model_preset="tiny", stream_interval=3, log_requests=True, log_requests_level=2,
                      decode_log_interval=2, chat_template="<{{ messages[0]['content'] }}>")
    engine = Engine(args)
    try:
        with caplog.at_level("INFO", logger="plugserve.stats"):
            outputs = list(engine.stream(PROMPTS[0], GREEDY))
            rid = outputs[-1].rid
        assert [len(o.token_ids) for o in outputs] == [1, 3, 3, 3, 2]
        assert "".join(o.text for o in outputs) == solo[0]
        lines = [r.getMessage() for r in caplog.records]
        finished = [line for line in lines if line.startswith(f"Finished request {rid}:")]
        assert len(finished) == 1 and "prompt_tokens=" in finished[0] and "completion_tokens=12" in finished[0]
        assert f"{PROMPTS[0]}', output=" in finished[0] and f"output={solo[0]!r}" in finished[0]
        batches = [line for line in lines if line.startswith("Decode batch. #running-req: 1, #token: ")]
        assert len(batches) == 11 // 2 and "#queue-req: 0" in batches[0]
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert rendered == "<hi>"
    finally:
        engine.shutdown()
