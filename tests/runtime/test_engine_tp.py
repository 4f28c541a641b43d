"""The engine with --tp-size 2 (and --ep-size 2, and DP attention; DP groups of two ranks at --tp-size 4) on the CPU
(the ranks past 0 worker processes, gloo) against --tp-size 1 on the same checkpoint: the same greedy tokens; a killed
rank ends the engine with an error naming it; deterministic inference at --tp-size 4."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plugserve.core.distributed import pick_free_port
from plugserve.core.forward_batch import ForwardMode
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from plugserve.runtime.dp_scheduler import DPScheduler
from plugserve.runtime.engine import Engine
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from tests.checkpoints import random_hf_model, save_hf_model, tiny_v3_config
from tests.engine_checks import assert_killing_rank_1_ends_the_engine

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [300, 1, 64], list(range(40, 80))]  # ids of the tiny model's vocabulary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(random_hf_model(tiny_v3_config()), tmp_path_factory.mktemp("v3"))


def _args(model_dir: Path, tp_size: int, ep_size: int = 1, **flags: object) -> ServerArgs:
    # A small pool: each rank holds a whole one.
    return ServerArgs(model_path=str(model_dir), tokenizer_path=str(EMBEDDED_MODEL_DIR), device="cpu",
                      max_total_tokens=2048, tp_size=tp_size, ep_size=ep_size, **flags)


def _tokens(engine: Engine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def tp1_tokens(model_dir: Path) -> list[list[int]]:
    single = Engine(_args(model_dir, 1))
    try:
        return _tokens(single)
    finally:
        single.shutdown()


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "tp2-ep2"])
def test_tp2_greedy_tokens_equal_tp1(model_dir: Path, tp1_tokens: list[list[int]], ep_size: int) -> None:
    engine = Engine(_args(model_dir, 2, ep_size))
    try:
        assert _tokens(engine) == tp1_tokens
        assert engine.runner.model.backends.moe.spec.num_local_experts == 8 // ep_size  # type: ignore[union-attr]
        assert engine.runner.all_reduce_status == "torch_ref (gloo), by declared priority"
        assert [c for c in engine.runner.backends.chosen if "fell back" in c.reason] == []
    finally:
        engine.shutdown()
    assert engine.ranks is not None and [p.exitcode for p in engine.ranks.workers.values()] == [0]


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(model_dir: Path) -> None:
    engine = Engine(_args(model_dir, 2))
    try:
        _tokens(engine)  # serving
        assert_killing_rank_1_ends_the_engine(engine, PROMPTS[0])
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("ep_size", "overlap"), [(1, True), (2, False)], ids=["dp2", "dp2-ep2-no-overlap"])
def test_dp_attention_greedy_tokens_equal_tp1(model_dir: Path, tp1_tokens: list[list[int]], ep_size: int,
                                              overlap: bool) -> None:
    """Three concurrent requests spread over both DP groups, then one alone (the other group idles): the tokens
    of --tp-size 1, every group's pages given back."""
    expected = tp1_tokens
    engine = Engine(_args(model_dir, 2, ep_size, enable_dp_attention=True, dp_size=2,
                          disable_overlap_schedule=not overlap))
    try:
        assert _tokens(engine) == expected
        scheduler = engine.scheduler
        assert isinstance(scheduler, DPScheduler) and all(g.radix.queried_tokens for g in scheduler.groups)
        assert _tokens(engine, PROMPTS[1:2]) == expected[1:2]
        engine.check_pool_accounting()
        assert all(g.allocator.num_free + g.radix.evictable_pages == g.allocator.num_pages for g in scheduler.groups)
    finally:
        engine.shutdown()
    assert engine.ranks is not None and all(p.exitcode == 0 for p in engine.ranks.workers.values())


@pytest.mark.parametrize("ep_size", [1, 4], ids=["tp4-dp2", "tp4-dp2-ep4"])
def test_dp_groups_of_two_ranks_give_tp1_greedy_tokens(model_dir: Path, tp1_tokens: list[list[int]],
                                                       ep_size: int) -> None:
    """--tp-size 4 --dp-size 2: two DP groups of two ranks, each splitting its group's heads: two requests, one a
    group, give --tp-size 1's tokens."""
    engine = Engine(_args(model_dir, 4, ep_size, enable_dp_attention=True, dp_size=2, disable_overlap_schedule=True))
    try:
        assert _tokens(engine, PROMPTS[:2]) == tp1_tokens[:2]
        assert engine.runner.dp_rank == 0 and engine.runner.model.layers[0].self_attn.num_heads == 2
        scheduler = engine.scheduler
        assert isinstance(scheduler, DPScheduler) and all(g.radix.queried_tokens for g in scheduler.groups)
        engine.check_pool_accounting()
    finally:
        engine.shutdown()
    assert engine.ranks is not None and [p.exitcode for p in engine.ranks.workers.values()] == [0, 0, 0]


def test_deterministic_inference_at_tp4_gives_a_request_its_bits_alone_in_a_batch_or_cached(model_dir: Path) -> None:
    """--enable-deterministic-inference --tp-size 4: every all-reduce goes to gather_sum, and a greedy request's
    tokens and logprobs are the same alone, inside a batch of other lengths and from the prefix cache."""
    engine = Engine(_args(model_dir, 4, enable_deterministic_inference=True))
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=True)

    def answers(prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        return [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in engine.generate(prompts, params)]

    try:
        assert engine.runner.all_reduce_status == "gather_sum, by declared priority"
        [alone] = answers([PROMPTS[2]])
        assert answers(PROMPTS)[2] == alone
        [cached] = engine.generate([PROMPTS[2]], params)
        assert cached.cached_tokens > 0 and (cached.token_ids, [lp.logprob for lp in cached.logprobs]) == alone
    finally:
        engine.shutdown()
    assert engine.ranks is not None and [p.exitcode for p in engine.ranks.workers.values()] == [0, 0, 0]


def test_a_failing_forward_under_dp_attention_fails_only_its_request(model_dir: Path,
                                                                     tp1_tokens: list[list[int]]) -> None:
    """One request's prefill raises in a step of both groups (the fault hook): each group's batch runs alone, the
    failing one in parts; every other request gives --tp-size 1's tokens."""
    bad = [9, 8, 7, 6]

    def fault_hook(mode: ForwardMode, requests) -> None:
        if mode is ForwardMode.EXTEND and any(r.prompt_ids == bad for r in requests):
            raise RuntimeError("injected fault")

    engine = Engine(_args(model_dir, 2, enable_dp_attention=True, dp_size=2), fault_hook=fault_hook)
    try:
        results = engine.generate([*PROMPTS, bad], GREEDY)
        assert [r.token_ids for r in results[:-1]] == tp1_tokens
        assert results[-1].error == "RuntimeError: injected fault"
        assert _tokens(engine) == tp1_tokens
        engine.check_pool_accounting()
    finally:
        engine.shutdown()


def test_disable_custom_all_reduce_on_the_cpu_is_refused_naming_the_flag(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--disable-custom-all-reduce needs CUDA devices"):
        Engine(_args(model_dir, 2, disable_custom_all_reduce=True))


def test_two_nodes_give_one_rank_tokens(model_dir: Path, tp1_tokens: list[list[int]]) -> None:
    """--nnodes 2 as on two hosts: node 1 is `plugserve serve --node-rank 1` in its own process, node 0 the Engine;
    node 1 exits 0 once node 0 shuts down."""
    address = f"127.0.0.1:{pick_free_port()}"
    node_flags = ["--model-path", str(model_dir), "--tokenizer-path", str(EMBEDDED_MODEL_DIR), "--device", "cpu",
                  "--max-total-tokens", "2048", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", address]
    node1 = subprocess.Popen([sys.executable, "-m", "plugserve", "serve", *node_flags, "--node-rank", "1"])
    try:
        engine = Engine(_args(model_dir, 2, nnodes=2, dist_init_addr=address))
        try:
            assert engine.ranks is not None and not engine.ranks.workers  # node 0's only rank is the engine's
            assert _tokens(engine) == tp1_tokens
        finally:
            engine.shutdown()
        assert node1.wait(timeout=60) == 0
    finally:
        node1.kill()
