"""The engine with --tp-size 2 (and --ep-size 2) on the CPU (rank 1 a worker process, gloo) against
--tp-size 1 on the same checkpoint: the same greedy tokens; a killed rank ends the engine with an error
naming it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from plugserve.core.engine import Engine, EngineStopped
from plugserve.core.sampling import SamplingParams
from plugserve.core.server_args import ServerArgs
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from tests.checkpoints import random_hf_model, save_hf_model, tiny_v3_config

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [300, 1, 64], list(range(40, 80))]  # ids of the tiny model's vocabulary
DEATH_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(random_hf_model(tiny_v3_config()), tmp_path_factory.mktemp("v3"))


def _args(model_dir: Path, tp_size: int, ep_size: int = 1) -> ServerArgs:
    # A small pool: each rank holds a whole one.
    return ServerArgs(model_path=str(model_dir), tokenizer_path=str(EMBEDDED_MODEL_DIR), device="cpu",
                      max_total_tokens=2048, tp_size=tp_size, ep_size=ep_size)


def _tokens(engine: Engine) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "tp2-ep2"])
def test_tp2_greedy_tokens_equal_tp1(model_dir: Path, ep_size: int) -> None:
    single = Engine(_args(model_dir, 1))
    try:
        expected = _tokens(single)
    finally:
        single.shutdown()
    engine = Engine(_args(model_dir, 2, ep_size))
    try:
        assert _tokens(engine) == expected
        assert engine.runner.model.backends.moe.spec.num_local_experts == 8 // ep_size  # type: ignore[union-attr]
    finally:
        engine.shutdown()
    assert engine.ranks is not None and all(p.exitcode == 0 for p in engine.ranks.workers.values())


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(model_dir: Path) -> None:
    engine = Engine(_args(model_dir, 2))
    try:
        _tokens(engine)  # serving
        assert engine.ranks is not None
        engine.ranks.workers[1].kill()
        deadline = time.monotonic() + DEATH_TIMEOUT_S
        while engine.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.error is not None and "tensor-parallel rank 1 exited" in engine.error
        assert not engine.alive
        with pytest.raises(EngineStopped, match="tensor-parallel rank 1 exited"):
            engine.generate(PROMPTS[:1], GREEDY)
    finally:
        engine.shutdown()
