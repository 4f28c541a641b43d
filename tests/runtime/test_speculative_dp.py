"""Speculative decoding under DP attention (--tp-size 2 --dp-size 2 on the CPU: rank 1 a worker process, gloo):
each DP group drafts and verifies its own requests while the MLPs and LM heads run over both groups' rows, so both
ranks run every forward of a step, a group without a batch of the step's kind on an IDLE one. Chains and trees
(with --ep-size 2) give the greedy tokens of decoding without speculation on one rank, from the drafts one rank
with speculation makes; over requests that finish at different steps, one alone (the other group idles through
its rounds), a prefill in one group beside a round in the other, and next to a sampled request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from plugserve.core.forward_batch import ForwardMode
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from plugserve.runtime import acceptance
from plugserve.runtime.dp_scheduler import DPScheduler
from plugserve.runtime.engine import Engine
from plugserve.runtime.request import RequestOutput
from plugserve.runtime.sampling import SampleOutput, SamplingParams
from plugserve.runtime.scheduled_batch import ScheduledBatch
from plugserve.runtime.server_args import ServerArgs
from plugserve.runtime.speculative_graphs import DP_EAGER
from tests.checkpoints import add_mtp_layer, random_hf_model, save_hf_model, tiny_v3_config

# Three prompts over the two groups (0 and 2 in group 0), finishing at different steps.
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [300, 1, 64, 300, 1, 64], list(range(40, 70))]
LENGTHS = [9, 4, 6]
SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
CHAINS = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
TREE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 6}
# What rank 0 verified: each request's tokens so far -> its drafts (chains) or its tree's tokens and parents.
Drafts = dict[tuple[int, ...], object]


def _greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 (random weights) with a NextN layer."""
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path_factory.mktemp("v3-nextn-dp"))
    add_mtp_layer(directory, num_layers=3)
    return directory


def _args(checkpoint: Path, tp_size: int, **flags: object) -> ServerArgs:
    return ServerArgs(model_path=str(checkpoint), tokenizer_path=str(EMBEDDED_MODEL_DIR), device="cpu",
                      max_total_tokens=1024, tp_size=tp_size, **flags)


def _submit(engine: Engine, prompt: list[int], params: SamplingParams, tokens: list[int], errors: list[str]
            ) -> tuple[threading.Event, threading.Event]:
    """Queue one request whose tokens go to `tokens`: (its first output came, it finished)."""
    started, done = threading.Event(), threading.Event()

    def on_output(output: RequestOutput) -> None:
        tokens.extend(output.token_ids)
        if output.error is not None:
            errors.append(output.error)
        started.set()
        if output.finished:
            done.set()

    engine.submit(prompt, params, on_output)
    return started, done


def _generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Each prompt under its own parameters, all at once: their tokens."""
    tokens: list[list[int]] = [[] for _ in prompts]
    errors: list[str] = []
    events = [_submit(engine, prompt, p, out, errors) for prompt, p, out in zip(prompts, params, tokens, strict=True)]
    assert all(done.wait(60) for _, done in events) and not errors
    return tokens


def _staggered(engine: Engine) -> list[list[int]]:
    """Prompt 0 alone until it decodes (group 1 idles through its rounds), then prompt 1 (group 1 prefills while
    group 0 verifies): their greedy tokens."""
    tokens: list[list[int]] = [[], []]
    errors: list[str] = []
    started, first = _submit(engine, PROMPTS[0], _greedy(LENGTHS[0]), tokens[0], errors)
    assert started.wait(60)
    _, second = _submit(engine, PROMPTS[1], _greedy(LENGTHS[1]), tokens[1], errors)
    assert first.wait(60) and second.wait(60) and not errors
    return tokens


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> Iterator[Drafts]:
    """The drafts rank 0 verifies (acceptance is rank 0's alone), recorded as the test runs."""
    seen: Drafts = {}
    chains, tree = acceptance.verify_drafts, acceptance.verify_tree

    def record(prompt_ids: list[list[int]], output_ids: list[list[int]], *per_request: torch.Tensor) -> None:
        for prompt, output, *drafts in zip(prompt_ids, output_ids, *(t.tolist() for t in per_request), strict=True):
            seen[(*prompt, *output)] = drafts

    def verify_drafts(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                      params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]],
                      *rest: object) -> SampleOutput:
        record(prompt_ids, output_ids, drafts)
        return chains(logits, drafts, draft_probs, params, prompt_ids, output_ids, *rest)  # type: ignore[arg-type]

    def verify_tree(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, params: list[SamplingParams],
                    prompt_ids: list[list[int]], output_ids: list[list[int]], *rest: object
                    ) -> tuple[SampleOutput, torch.Tensor]:
        record(prompt_ids, output_ids, tokens, parents)
        return tree(logits, tokens, parents, params, prompt_ids, output_ids, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(acceptance, "verify_drafts", verify_drafts)
    monkeypatch.setattr(acceptance, "verify_tree", verify_tree)
    yield seen


@pytest.fixture(scope="module")
def plain_tokens(checkpoint: Path) -> list[list[int]]:
    """The prompts' greedy tokens without speculation, on one rank."""
    engine = Engine(_args(checkpoint, 1))
    try:
        return _generate(engine, PROMPTS, [_greedy(n) for n in LENGTHS])
    finally:
        engine.shutdown()


def _one_rank_drafts(checkpoint: Path, flags: dict[str, object], plain: list[list[int]], seen: Drafts) -> Drafts:
    """What one rank with speculation drafts for the prompts (its tokens are the plain ones)."""
    engine = Engine(_args(checkpoint, 1, **flags))
    try:
        assert _generate(engine, PROMPTS, [_greedy(n) for n in LENGTHS]) == plain
        assert _staggered(engine) == plain[:2]
    finally:
        engine.shutdown()
    drafts = dict(seen)
    seen.clear()
    return drafts


def _spy_steps(scheduler: DPScheduler) -> list[list[ForwardMode | None]]:
    """Each step's batch kind per group (None: the group has none), recorded as the scheduler runs them."""
    steps: list[list[ForwardMode | None]] = []
    forward = scheduler._forward

    def spy(batches: list[ScheduledBatch | None]) -> list[SampleOutput | None]:
        steps.append([None if b is None else b.mode for b in batches])
        return forward(batches)

    scheduler._forward = spy  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize(("flags", "ep_size"), [(CHAINS, 1), (TREE, 2)], ids=["chains", "tree-ep2"])
def test_dp2_speculative_gives_one_ranks_drafts_and_greedy_tokens(checkpoint: Path, plain_tokens: list[list[int]],
                                                                  verified: Drafts, flags: dict[str, object],
                                                                  ep_size: int) -> None:
    one_rank = _one_rank_drafts(checkpoint, flags, plain_tokens, verified)
    # Prefills in chunks of 16 tokens: those of prompt 2 but its last sample nothing.
    engine = Engine(_args(checkpoint, 2, ep_size=ep_size, enable_dp_attention=True, dp_size=2, chunked_prefill_size=16,
                          **flags))
    try:
        scheduler = engine.scheduler
        assert isinstance(scheduler, DPScheduler) and scheduler.spec is not None
        steps = _spy_steps(scheduler)
        assert _generate(engine, PROMPTS, [_greedy(n) for n in LENGTHS]) == plain_tokens
        assert all(g.radix.queried_tokens for g in scheduler.groups)  # both groups had requests
        assert _staggered(engine) == plain_tokens[:2]
        # Every round drafted (each group on its rank) what one rank drafts for the same tokens: group 1's too.
        assert verified == one_rank and any(k[: len(PROMPTS[1])] == tuple(PROMPTS[1]) for k in verified)
        verify, extend = ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND
        assert [verify, None] in steps and {verify, extend} in [set(s) for s in steps]  # idle; prefill beside a round
        # On a GPU the rounds would run eagerly too: nothing to capture, and the status says why.
        runner = engine.runner
        runner.graph_max_bs = 4
        runner.capture_graphs()
        assert not runner.graphs.runners and runner.graphs.status == DP_EAGER
        # Beside a sampled request (whose drafts and acceptance rank 0 decides for its group).
        mixed = _generate(engine, [PROMPTS[1], *PROMPTS], [SAMPLED, *(_greedy(n) for n in LENGTHS)])
        assert mixed[1:] == plain_tokens and len(mixed[0]) == SAMPLED.max_new_tokens
        engine.check_pool_accounting()
        assert all(g.allocator.num_free + g.radix.evictable_pages == g.allocator.num_pages for g in scheduler.groups)
        assert scheduler.spec.verify_steps
    finally:
        engine.shutdown()
    assert engine.ranks is not None and [p.exitcode for p in engine.ranks.workers.values()] == [0]


@pytest.mark.parametrize("flags", [CHAINS, TREE], ids=["chains", "tree"])
def test_dp_groups_of_two_ranks_speculate_as_one_rank(checkpoint: Path, plain_tokens: list[list[int]],
                                                     verified: Drafts, flags: dict[str, object]) -> None:
    """--tp-size 4 --dp-size 2: each group's two ranks split its heads and draft its requests alike (a tree's nodes
    gathered to rank 0 once a group): one rank's drafts and its greedy tokens without speculation."""
    one_rank = _one_rank_drafts(checkpoint, flags, plain_tokens, verified)
    engine = Engine(_args(checkpoint, 4, enable_dp_attention=True, dp_size=2, disable_overlap_schedule=True, **flags))
    try:
        scheduler = engine.scheduler
        assert isinstance(scheduler, DPScheduler) and scheduler.spec is not None
        assert _generate(engine, PROMPTS, [_greedy(n) for n in LENGTHS]) == plain_tokens
        assert _staggered(engine) == plain_tokens[:2]
        assert all(g.radix.queried_tokens for g in scheduler.groups)
        assert verified == one_rank and any(k[: len(PROMPTS[1])] == tuple(PROMPTS[1]) for k in verified)
        engine.check_pool_accounting()
    finally:
        engine.shutdown()
    assert engine.ranks is not None and [p.exitcode for p in engine.ranks.workers.values()] == [0, 0, 0]


def test_a_failing_prefill_fails_only_its_request_under_dp_attention(checkpoint: Path,
                                                                      plain_tokens: list[list[int]]) -> None:
    """One request's prefill raises in a speculative step (the fault hook): each group's batch runs alone (the other
    group idle through it), the failing one in parts; every other request gives one rank's tokens."""
    bad = [9, 8, 7, 6]

    def fault_hook(mode: ForwardMode, requests: list) -> None:
        if mode is ForwardMode.EXTEND and any(r.prompt_ids == bad for r in requests):
            raise RuntimeError("injected fault")

    engine = Engine(_args(checkpoint, 2, enable_dp_attention=True, dp_size=2, **CHAINS), fault_hook=fault_hook)
    try:
        tokens: list[list[int]] = [[] for _ in range(4)]
        errors: list[str] = []
        prompts, params = [*PROMPTS, bad], [*(_greedy(n) for n in LENGTHS), _greedy(3)]
        events = [_submit(engine, p, q, out, errors) for p, q, out in zip(prompts, params, tokens, strict=True)]
        assert all(done.wait(60) for _, done in events)
        assert tokens[:3] == plain_tokens and errors == ["RuntimeError: injected fault"]
        assert _generate(engine, PROMPTS, [_greedy(n) for n in LENGTHS]) == plain_tokens
        engine.check_pool_accounting()
    finally:
        engine.shutdown()
