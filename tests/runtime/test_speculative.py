"""Speculative decoding with the NextN layer (chains): greedy outputs equal those without speculation token for
token, whatever the drafts' acceptance, with every scheduler feature; sampled outputs keep the target's
distribution."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from plugserve.runtime.acceptance import verify_drafts
from plugserve.runtime.engine import Engine, GenerateResult
from plugserve.runtime.request import FinishReason
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from plugserve.runtime.speculative import build_runner
from plugserve.runtime.warmup import warm_up
from tests.checkpoints import add_mtp_layer, random_hf_model, save_hf_model, tiny_v3_config, write_nextn_draft
from tests.engine_checks import assert_every_page_is_back
from tests.paged_runner import load_reference_model

STEPS = 3
GREEDY = SamplingParams(max_new_tokens=11, temperature=0, ignore_eos=True)  # 1 + 4 + 4 + 2: the last run is cut
PROMPTS = [[5, 17, 33, 2, 9], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110] * 3, [7], [250, 3, 250, 3]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 (random weights) with a NextN layer."""
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path_factory.mktemp("v3-nextn"))
    add_mtp_layer(directory, num_layers=3)
    return directory


def _args(checkpoint, **flags) -> ServerArgs:
    return ServerArgs(**{"model_path": str(checkpoint), "tokenizer_path": str(EMBEDDED_MODEL_DIR),
                         "max_total_tokens": 1024, **flags})


@pytest.fixture(scope="module")
def plain(checkpoint):
    engine = Engine(_args(checkpoint))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def spec(checkpoint):
    engine = Engine(_args(checkpoint, speculative_algorithm="NEXTN", speculative_num_steps=STEPS))
    yield engine
    engine.shutdown()


def _outputs(results: list[GenerateResult]) -> list[tuple]:
    return [(r.token_ids, r.text, r.finish_reason, r.matched_stop, r.completion_tokens) for r in results]


def _copying_draft(expected: dict[tuple[int, ...], list[int]], wrong_every: int = 0, steps: int = STEPS) -> Callable:
    """A test double for `SpeculativeWorker._draft` that drafts the target's own greedy continuation (`expected`, by
    prompt), so that whole runs are accepted; `wrong_every` n > 0 spoils each draft at an output index i with
    (i + prompt length) % n == 0, so that requests of one batch accept different lengths."""

    def draft(verify, requests, rows, default_generator, greedy):
        drafts = []
        for request in requests:
            done = request.num_resolved
            future = expected[tuple(request.prompt_ids)][done : done + steps]
            for j in range(steps):
                if wrong_every and (done + j + len(request.prompt_ids)) % wrong_every == 0:
                    future[j] = (future[j] + 1) % 320
            drafts.append(future)
        return torch.tensor(drafts, device=rows.device), None

    return draft



def test_greedy_outputs_equal_those_without_speculation_with_the_nextn_layers_own_drafts(plain, spec):
    assert _outputs(spec.generate(PROMPTS, GREEDY)) == _outputs(plain.generate(PROMPTS, GREEDY))
    assert spec.scheduler.overlap_status == "off: speculative decoding runs the non-overlap loop"
    assert_every_page_is_back(spec)


@pytest.mark.parametrize("wrong_every", [0, 3, 5])
@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(max_new_tokens=14, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3),
        SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                       frequency_penalty=0.5, n=2),
    ],
    ids=["greedy", "logprobs", "penalties-n2"],
)
def test_accepted_runs_equal_the_targets_greedy_tokens(plain, spec, monkeypatch, params, wrong_every):
    expected = plain.generate(PROMPTS, params)
    by_prompt = {tuple(p): r.token_ids + [0] * 8 for p, r in zip(PROMPTS, expected[:: params.n], strict=True)}
    monkeypatch.setattr(spec.scheduler.spec, "_draft", _copying_draft(by_prompt, wrong_every))
    before = (spec.scheduler.spec.verify_steps, spec.scheduler.spec.accepted_tokens)
    results = spec.generate(PROMPTS, params)
    assert _outputs(results) == _outputs(expected)
    for got, want in zip(results, expected, strict=True):
        assert [(t.token_id, t.top and [i for i, _ in t.top]) for t in got.logprobs] == \
               [(t.token_id, t.top and [i for i, _ in t.top]) for t in want.logprobs]
        assert torch.allclose(torch.tensor([t.logprob for t in got.logprobs]),
                              torch.tensor([t.logprob for t in want.logprobs]), atol=1e-4)
    steps = spec.scheduler.spec.verify_steps - before[0]
    accept_length = (spec.scheduler.spec.accepted_tokens - before[1]) / steps
    assert accept_length > (3.0 if wrong_every == 0 else 1.5)
    assert_every_page_is_back(spec)


def test_stops_inside_an_accepted_run_cut_it(plain, spec, monkeypatch):
    tokens = plain.generate(PROMPTS[0], GREEDY)[0].token_ids
    text = plain.generate(PROMPTS[0], GREEDY)[0].text
    monkeypatch.setattr(spec.scheduler.spec, "_draft", _copying_draft({tuple(PROMPTS[0]): tokens + [0] * 8}))
    variants = [
        SamplingParams(max_new_tokens=11, temperature=0, stop_token_ids=[tokens[6]]),
        SamplingParams(max_new_tokens=11, temperature=0, stop=[text[len(text) // 2 :][:2]]),
        SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True),
    ]
    for params in variants:
        want = plain.generate(PROMPTS[0], params)
        assert want[0].completion_tokens < 11 and want[0].finish_reason is not None
        assert _outputs(spec.generate(PROMPTS[0], params)) == _outputs(want)
    assert_every_page_is_back(spec)


@pytest.mark.parametrize(
    "flags",
    [
        {"chunked_prefill_size": 8},  # the long prompt is prefilled in chunks, the NextN layer after each
        {"page_size": 4, "disable_radix_cache": True},
        {"page_size": 4},
        {"max_total_tokens": 50, "max_running_requests": 3},  # waiting and retraction
    ],
    ids=["chunked-prefill", "page4-no-radix", "page4", "tiny-pool"],
)
def test_scheduling_variants_give_the_same_greedy_outputs(checkpoint, plain, flags):
    shared = PROMPTS[1] + [3, 4]  # run after the others: a prefix-cache hit on the long prompt's pages
    expected = plain.generate([*PROMPTS, shared], GREEDY)
    engine = Engine(_args(checkpoint, speculative_algorithm="EAGLE", speculative_num_steps=2, **flags))
    try:
        by_prompt = {tuple(p): r.token_ids + [0] * 8 for p, r in zip([*PROMPTS, shared], expected, strict=True)}
        engine.scheduler.spec._draft = _copying_draft(by_prompt, wrong_every=4, steps=2)
        assert _outputs(engine.generate(PROMPTS, GREEDY)) == _outputs(expected[:-1])
        assert _outputs(engine.generate(shared, GREEDY)) == _outputs(expected[-1:])
        assert engine.scheduler.spec.accepted_tokens > 1.5 * engine.scheduler.spec.verify_steps
        if "max_total_tokens" in flags:
            assert engine.metrics.retractions._value.get() > 0
        if not flags.get("disable_radix_cache"):
            assert engine.radix.hit_rate > 0
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


def _reference_drafts(model, tokens: list[int], steps: int) -> list[int]:
    """The chain the NextN layer drafts after `tokens`, computed from scratch on a fresh pool: the target over all but
    the last token, the NextN layer over the same positions reading the token after each, then steps - 1 NextN
    decode steps, each reading the previous draft and the NextN layer's own previous output."""
    n = len(tokens)
    pool = MLAKVPool(model.num_kv_layers, n + steps, 1, model.config.kv_lora_rank, model.config.qk_rope_head_dim,
                     torch.float32, "cpu")
    table = torch.arange(n + steps, dtype=torch.int32)[None]
    with torch.inference_mode():
        batch = ForwardBatch.build(ForwardMode.EXTEND, [n - 1], [n - 1], table, pool)
        hidden = model(torch.tensor(tokens[:-1]), batch)
        hidden = model.forward_nextn(torch.tensor(tokens[1:]), hidden, batch)[-1:]
        drafts = [int(model.compute_logits(hidden).argmax())]
        for step in range(1, steps):
            batch = ForwardBatch.build(ForwardMode.DECODE, [n - 1 + step], [1], table, pool)
            hidden = model.forward_nextn(torch.tensor(drafts[-1:]), hidden, batch)
            drafts.append(int(model.compute_logits(hidden).argmax()))
    return drafts


def test_the_nextn_layer_drafts_from_the_state_the_rounds_leave(checkpoint, spec, monkeypatch):
    """Each round's drafts are what the NextN layer computes from scratch over the sequence so far: its KV after
    prefill and draft extends, and its last output h', are those of the accepted tokens."""
    worker, seen = spec.scheduler.spec, []
    real = worker._draft

    def spy(verify, requests, rows, default_generator, greedy):
        drafts, probs = real(verify, requests, rows, default_generator, greedy)
        for request, chain in zip(requests, drafts.tolist(), strict=True):
            seen.append((request.prompt_ids + request.output_ids[: request.num_resolved], chain))
        return drafts, probs

    monkeypatch.setattr(worker, "_draft", spy)
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42]]  # pages no earlier request left in the cache
    spec.generate(prompts, GREEDY)
    model = load_reference_model(checkpoint)
    assert len(seen) >= 2 * 3
    assert [d for _, d in seen] == [_reference_drafts(model, tokens, STEPS) for tokens, _ in seen]


def test_requests_run_to_the_context_length_as_without_speculation(plain, spec):
    """The last rounds verify drafts past the context length (their KV lands in the block table's spare
    columns); the tokens stop at it."""
    params, prompt = SamplingParams(max_new_tokens=1000, temperature=0, ignore_eos=True), list(range(1, 201))
    want = plain.generate(prompt, params)
    assert want[0].finish_reason is FinishReason.LENGTH and want[0].completion_tokens == 256 - 200
    assert _outputs(spec.generate(prompt, params)) == _outputs(want)
    assert_every_page_is_back(spec)


def test_abort_between_rounds_frees_the_request(spec, monkeypatch):
    worker = spec.scheduler.spec
    real, resume, blocked = worker._draft, threading.Event(), threading.Event()

    def draft(verify, requests, rows, default_generator, greedy):
        if requests[0].num_resolved >= 3:
            blocked.set()
            resume.wait(30)
        return real(verify, requests, rows, default_generator, greedy)

    monkeypatch.setattr(worker, "_draft", draft)
    outputs, done = [], threading.Event()

    def on_output(output):
        outputs.append(output)
        if output.finished:
            done.set()

    rid = spec.submit([9, 9, 9], SamplingParams(max_new_tokens=200, ignore_eos=True), on_output)
    assert blocked.wait(30)
    spec.abort(rid)  # handled after the round in progress, before the next
    resume.set()
    assert done.wait(30)
    assert outputs[-1].finish_reason is FinishReason.ABORT and outputs[-1].completion_tokens < 200
    assert_every_page_is_back(spec)


def test_a_failing_round_or_prefill_fails_only_its_own_request(checkpoint, plain):
    """One request's verify round raises mid-decode, another's prefill raises: their batch-mates are re-run
    without them (the greedy round's graph or eager, at the part's size) and give the tokens of plain decoding."""
    failing = {tuple(PROMPTS[1]): ForwardMode.TARGET_VERIFY, tuple(PROMPTS[3]): ForwardMode.EXTEND}

    def fault_hook(mode, requests):
        if any(failing.get(tuple(r.prompt_ids)) is mode and (mode is ForwardMode.EXTEND or r.num_resolved >= 3)
               for r in requests):
            raise RuntimeError("injected fault")

    engine = Engine(_args(checkpoint, speculative_algorithm="NEXTN", speculative_num_steps=STEPS),
                    fault_hook=fault_hook)
    try:
        results, expected = engine.generate(PROMPTS, GREEDY), plain.generate(PROMPTS, GREEDY)
        for prompt, result, want in zip(PROMPTS, results, expected, strict=True):
            if tuple(prompt) in failing:
                assert result.finish_reason is FinishReason.ERROR and result.error == "RuntimeError: injected fault"
            else:
                assert _outputs([result]) == _outputs([want])
        assert len(results[1].token_ids) >= 3  # it failed in a verify round, after the rounds it passed
        assert _outputs(engine.generate(PROMPTS[1:2], GREEDY)) != _outputs(expected[1:2])  # it fails again
        assert _outputs(engine.generate([PROMPTS[0], PROMPTS[2]], GREEDY)) == _outputs([expected[0], expected[2]])
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


def test_a_model_without_a_nextn_layer_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--speculative-algorithm NEXTN: the model has no NextN layer .*: give one "
                       r"with --speculative-draft-model-path"):
        Engine(ServerArgs(model_preset="tiny", speculative_algorithm="NEXTN", max_total_tokens=64))


def test_bench_one_batch_refuses_a_model_without_a_nextn_layer_before_warming_up():
    """bench_one_batch builds its runner through speculative.build_runner and warms up itself: the refusal must come
    from the build, not from a warm-up forward reaching the missing layer."""
    from benchmarks import bench_one_batch

    with pytest.raises(ValueError, match=r"--speculative-algorithm NEXTN: the model has no NextN layer"):
        bench_one_batch.main(["--model-preset", "tiny", "--load-format", "dummy", "--device", "cpu",
                              "--batch-size", "1", "--input-len", "8", "--output-len", "4",
                              "--speculative-algorithm", "NEXTN"])


def _recording_drafts(engine: Engine, monkeypatch) -> list[list[list[int]]]:
    """The drafts of every round the engine's worker makes from now on: [round][request][step] token ids."""
    worker, drafts = engine.scheduler.spec, []
    draft = worker._draft

    def recording(verify, requests, rows, default_generator, greedy):
        tokens, probs = draft(verify, requests, rows, default_generator, greedy)
        drafts.append(tokens.tolist())
        return tokens, probs

    monkeypatch.setattr(worker, "_draft", recording)
    return drafts


def test_a_draft_checkpoints_nextn_layer_drafts_as_the_targets_own(checkpoint, spec, tmp_path, monkeypatch):
    """The same tiny V3 without its MTP layer, drafting with that layer from a NextN-only export: the same drafts
    round for round, and the same tokens, as the checkpoint that has it."""
    bare = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path / "bare")
    draft = write_nextn_draft(checkpoint, tmp_path / "nextn", num_layers=3, shared_copies=False)
    drafted = Engine(_args(bare, speculative_algorithm="NEXTN", speculative_num_steps=STEPS,
                           speculative_draft_model_path=str(draft)))
    try:
        own_drafts, drafted_drafts = _recording_drafts(spec, monkeypatch), _recording_drafts(drafted, monkeypatch)
        expected = _outputs(spec.generate(PROMPTS, GREEDY))
        assert _outputs(drafted.generate(PROMPTS, GREEDY)) == expected
        assert drafted_drafts == own_drafts and len(own_drafts) > 5
        assert_every_page_is_back(drafted)
    finally:
        drafted.shutdown()


# Rejection sampling, on a four-token vocabulary: the target's distributions at three positions (as logits), and the
# draft's, which differ from them (and put mass on a token the target's top-k excludes).
TARGET_LOGITS = torch.tensor([[2.0, 1.0, 0.4, -1.0], [0.0, 1.5, 0.3, 0.9], [1.0, 1.2, -0.5, 0.1]])
DRAFT_PROBS = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
SAMPLED = SamplingParams(temperature=0.8, top_k=3)


def _target_probs() -> torch.Tensor:
    """[3, 4]: softmax(logits / 0.8) over each position's top 3, renormalized, written out by hand."""
    probs = torch.softmax(TARGET_LOGITS / 0.8, dim=-1)
    probs[probs < probs.sort(dim=-1).values[:, 1:2]] = 0
    return probs / probs.sum(dim=-1, keepdim=True)


def _three_tokens(draft_probs_told: torch.Tensor, rows: int = 40000) -> torch.Tensor:
    """Draws of the first three tokens from one verify of two drafts drawn from DRAFT_PROBS (the verifier told the
    drafts came from `draft_probs_told`), each position past the accepted run drawn straight from the target, as the
    next round would: [rows] int64 codes t1 * 16 + t2 * 4 + t3."""
    generator = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(q, rows, replacement=True, generator=generator) for q in DRAFT_PROBS], 1)
    out = verify_drafts(TARGET_LOGITS.expand(rows, 3, 4), drafts, draft_probs_told.expand(rows, 2, 4),
                        [SAMPLED] * rows, [[0]] * rows, [[]] * rows, [None] * rows, generator)
    fresh = torch.stack([torch.multinomial(p, rows, replacement=True, generator=generator)
                         for p in _target_probs()], 1)
    accepted = out.accept_lens[:, None] >= torch.arange(3)
    tokens = torch.where(accepted, out.token_ids, fresh)
    return tokens[:, 0] * 16 + tokens[:, 1] * 4 + tokens[:, 2]


def _total_variation(codes: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(codes, minlength=64).float() / len(codes)
    return 0.5 * (counts - probs.flatten()).abs().sum().item()


def test_rejection_sampling_keeps_the_targets_distribution():
    """Total variation between 40000 draws of three tokens and the target's joint distribution (27 cells) is about
    0.01 from sampling noise alone; a verifier that trusted the wrong draft distribution lands far outside."""
    p = _target_probs()
    joint = p[0][:, None, None] * p[1][None, :, None] * p[2][None, None, :]
    assert _total_variation(_three_tokens(DRAFT_PROBS), joint) < 0.025
    assert _total_variation(_three_tokens(p[:2]), joint) > 0.1  # the negative control


def test_rejection_sampling_accepts_at_the_rate_min_p_q():
    rows = 40000
    generator = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(DRAFT_PROBS[0], rows, replacement=True, generator=generator)[:, None]
    out = verify_drafts(TARGET_LOGITS[:2].expand(rows, 2, 4), drafts, DRAFT_PROBS[:1].expand(rows, 1, 4),
                        [SAMPLED] * rows, [[0]] * rows, [[]] * rows, [None] * rows, generator)
    expected = torch.minimum(_target_probs()[0], DRAFT_PROBS[0]).sum().item()
    assert abs(out.accept_lens.float().mean().item() - expected) < 0.01


def test_greedy_verification_accepts_the_run_the_targets_argmax_agrees_with():
    logits = torch.zeros(3, 4, 6)
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    logits.scatter_(2, argmax[:, :, None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [4, 5, 5]])
    greedy = SamplingParams(temperature=0)
    out = verify_drafts(logits, drafts, None, [greedy] * 3, [[0]] * 3, [[]] * 3, [None] * 3, None)
    assert out.accept_lens.tolist() == [3, 1, 0]
    assert [row[: n + 1] for row, n in zip(out.token_ids.tolist(), [3, 1, 0], strict=True)] == [[1, 2, 3, 4], [1, 2],
                                                                                                  [5]]


def check_seeded_sampling(engine: Engine) -> None:
    """Seeded sampled requests (top-k 2, n 3) repeat token for token, differ between samples, and draw every
    token from the target's top 2 at its position; every page comes back."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=2, seed=5, n=3, logprobs=True,
                            top_logprobs=2, ignore_eos=True)
    first, second = engine.generate(PROMPTS[:2], params), engine.generate(PROMPTS[:2], params)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert len({tuple(r.token_ids) for r in first}) > 2
    assert all(t.token_id in [i for i, _ in t.top] for r in first for t in r.logprobs)
    assert_every_page_is_back(engine)


def test_sampled_requests_stay_in_the_targets_top_k_and_repeat_with_their_seed(spec):
    check_seeded_sampling(spec)


def test_accept_length_is_in_metrics_and_server_info(plain, spec, monkeypatch):
    from fastapi.testclient import TestClient

    from plugserve.server.app import create_app

    expected = plain.generate(PROMPTS, GREEDY)
    by_prompt = {tuple(p): r.token_ids + [0] * 8 for p, r in zip(PROMPTS, expected, strict=True)}
    monkeypatch.setattr(spec.scheduler.spec, "_draft", _copying_draft(by_prompt))
    generated = spec.metrics.generation_tokens._value.get()
    results = spec.generate(PROMPTS, GREEDY)
    # Prefill's sampled token and each verify's accepted tokens count once each: the usage's completion tokens.
    assert spec.metrics.generation_tokens._value.get() - generated == sum(r.completion_tokens for r in results)
    client = TestClient(create_app(spec))
    info = client.get("/server_info").json()
    assert info["speculative"]["algorithm"] == "NEXTN" and info["speculative"]["num_steps"] == STEPS
    assert info["speculative"]["accept_length"] == pytest.approx(spec.scheduler.spec.accept_length)
    assert info["overlap_schedule"] == "off: speculative decoding runs the non-overlap loop"
    assert info["cuda_graph"] == "no CUDA graphs on the CPU"
    metrics = client.get("/metrics").text
    gauge = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("plugserve_spec_accept_length{")))
    assert gauge == pytest.approx(spec.scheduler.spec.accept_length) and gauge > 1.5
    plain_info = TestClient(create_app(plain)).get("/server_info").json()
    assert plain_info["speculative"] is None and plain_info["overlap_schedule"] == "on"


def test_structured_output_is_refused_with_a_400_naming_the_flag(spec):
    """Drafts are not checked against a grammar: such a request is refused rather than served unconstrained."""
    from fastapi.testclient import TestClient

    from plugserve.server.app import create_app

    assert spec.ready.wait(60)
    response = TestClient(create_app(spec)).post("/v1/completions", json={"prompt": [1, 2, 3], "regex": "a+"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "regex" and "--speculative-algorithm" in error["message"], error


def test_warm_up_runs_a_rounds_forwards_at_each_decode_bucket_and_gives_pages_back(checkpoint, monkeypatch):
    runner = build_runner(_args(checkpoint, speculative_algorithm="NEXTN", speculative_num_steps=STEPS))
    n = STEPS + 1
    target, draft = [], []
    prepare, forward_nextn = runner.prepare, runner.model.forward_nextn

    def recording_prepare(batch: ForwardBatch) -> ForwardBatch:
        target.append((batch.mode, batch.batch_size, tuple(batch.extend_lens_cpu)))
        return prepare(batch)

    def recording_nextn(next_ids, hidden, batch, attention=None):
        draft.append((batch.mode, batch.batch_size, tuple(batch.extend_lens_cpu)))
        return forward_nextn(next_ids, hidden, batch, attention)

    monkeypatch.setattr(runner, "prepare", recording_prepare)
    monkeypatch.setattr(runner.model, "forward_nextn", recording_nextn)
    free = runner.allocator.num_free
    warm_up(runner)
    assert runner.allocator.num_free == free
    assert any(mode is ForwardMode.EXTEND for mode, _, _ in draft)
    for b in {min(bucket.max_size, runner.allocator.num_pages) for bucket in runner.backends.decode_buckets}:
        assert (ForwardMode.TARGET_VERIFY, b, (n,) * b) in target
        for mode, new in ((ForwardMode.DECODE, 1), (ForwardMode.DRAFT_EXTEND, n)):
            assert (mode, b, (new,) * b) in draft
