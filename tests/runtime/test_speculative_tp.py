"""Speculative decoding with --tp-size 2 on the CPU (rank 1 a worker process, gloo): chains and trees give the
greedy tokens of decoding without speculation on one rank (which equal HF transformers', `test_engine.py`), also
next to sampled requests (whose drafts and acceptance rank 0 alone decides) and with --ep-size 2; a killed rank
ends the engine with an error naming it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from plugserve.runtime.engine import Engine
from plugserve.runtime.request import RequestOutput
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from tests.checkpoints import add_mtp_layer, random_hf_model, save_hf_model, tiny_v3_config
from tests.engine_checks import assert_killing_rank_1_ends_the_engine

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [300, 1, 64, 300, 1, 64]]
CHAINS = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
TREE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 6}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 (random weights) with a NextN layer."""
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path_factory.mktemp("v3-nextn-tp"))
    add_mtp_layer(directory, num_layers=3)
    return directory


def _args(checkpoint: Path, tp_size: int, **flags: object) -> ServerArgs:
    return ServerArgs(model_path=str(checkpoint), tokenizer_path=str(EMBEDDED_MODEL_DIR), device="cpu",
                      max_total_tokens=1024, tp_size=tp_size, **flags)


@pytest.fixture(scope="module")
def plain_tokens(checkpoint: Path) -> list[list[int]]:
    engine = Engine(_args(checkpoint, 1))
    try:
        return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.shutdown()


def _generate_mixed(engine: Engine) -> list[list[int]]:
    """The greedy prompts' tokens, generated alone, then again next to a sampled request."""
    alone = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    sampled: list[RequestOutput] = []
    done = threading.Event()

    def on_output(output: RequestOutput) -> None:
        sampled.append(output)
        if output.finished:
            done.set()

    engine.submit(PROMPTS[0], SAMPLED, on_output)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == alone
    assert done.wait(60) and sampled[-1].error is None
    assert sum(len(o.token_ids) for o in sampled) == SAMPLED.max_new_tokens
    return alone


@pytest.mark.parametrize(("flags", "ep_size"), [(CHAINS, 1), (TREE, 2)], ids=["chains", "tree-ep2"])
def test_tp2_speculative_gives_the_greedy_tokens_of_one_rank_without_it(checkpoint: Path,
                                                                        plain_tokens: list[list[int]],
                                                                        flags: dict[str, object], ep_size: int) -> None:
    engine = Engine(_args(checkpoint, 2, ep_size=ep_size, **flags))
    try:
        assert _generate_mixed(engine) == plain_tokens
        worker = engine.scheduler.spec  # type: ignore[attr-defined]
        # Some drafts were accepted: the sampled request's at least (the random NextN layer's greedy chains seldom are).
        assert worker.verify_steps and worker.accepted_tokens > worker.verify_steps
    finally:
        engine.shutdown()
    assert engine.ranks is not None and [p.exitcode for p in engine.ranks.workers.values()] == [0]


def test_a_killed_rank_during_speculative_decoding_ends_the_engine(checkpoint: Path) -> None:
    engine = Engine(_args(checkpoint, 2, **CHAINS))
    try:
        long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
        worker, rounds = engine.scheduler.spec, threading.Event()  # type: ignore[attr-defined]
        verify = worker.verify

        def verify_and_tell(*args: object) -> object:
            rounds.set()
            return verify(*args)

        worker.verify = verify_and_tell
        running = threading.Thread(target=engine.generate, args=([PROMPTS[0]], long), daemon=True)
        running.start()
        assert rounds.wait(60)  # mid-decode: rounds are running
        assert_killing_rank_1_ends_the_engine(engine, PROMPTS[0])
        running.join(60)
        assert not running.is_alive()
    finally:
        engine.shutdown()
