"""The engine over several GPUs (`pytest -m multigpu tests`, on a lent machine of 2 or 4): TP, EP, DP attention and
their mixes on the tiny V3 in float32 give one GPU's greedy tokens, which are HF transformers', and so does
speculative decoding (chains in the greedy round's graph, trees) under TP and TP+EP, and eagerly under DP attention
(+EP); aborts under DP attention
leave every page owned; a killed rank ends the engine with an error naming it; two nodes started as on two hosts
give one GPU's tokens. Each multi-GPU engine runs
in a process of its own (its NCCL world lives until that process exits)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugserve.core.distributed import pick_free_port
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from plugserve.runtime.cuda_graph_runner import CudaGraphRunner
from plugserve.runtime.engine import Engine
from plugserve.runtime.request import RequestOutput
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from plugserve.runtime.speculative import ROUND
from plugserve.runtime.speculative_graphs import DP_EAGER
from tests.checkpoints import add_mtp_layer, random_hf_model, save_hf_model, tiny_v3_config
from tests.engine_checks import assert_killing_rank_1_ends_the_engine
from tests.multiprocess import multi_gpu, needs_gpus, run_in_process

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
ENGINE_TIMEOUT_S = 150.0  # one engine's start, requests and shutdown in its process
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [300, 1, 64], list(range(40, 80)), [11] * 20]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs GPUs")


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model(tiny_v3_config())


@pytest.fixture(scope="module")
def model_dir(hf_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(hf_model, tmp_path_factory.mktemp("v3"))


@pytest.fixture(scope="module")
def nextn_dir(hf_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with a NextN layer to draft with."""
    directory = save_hf_model(hf_model, tmp_path_factory.mktemp("v3-nextn"))
    add_mtp_layer(directory, num_layers=tiny_v3_config().num_hidden_layers)
    return directory


@pytest.fixture(scope="module")
def hf_tokens(hf_model) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt on one GPU, float32."""
    model = hf_model.to("cuda", torch.float32).eval()
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, attention_mask=None)
            tokens.append(out[0, len(prompt):].tolist())
    model.to("cpu")
    return tokens


def _args(model_dir: Path, tp_size: int = 1, **flags: object) -> ServerArgs:
    return ServerArgs(**{"model_path": str(model_dir), "tokenizer_path": str(EMBEDDED_MODEL_DIR), "device": "cuda",
                         "dtype": "float32", "max_total_tokens": 4096, "max_running_requests": 16, "tp_size": tp_size}
                      | flags)


def _tokens(engine: Engine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def one_gpu_tokens(model_dir: Path, hf_tokens: list[list[int]]) -> list[list[int]]:
    engine = Engine(_args(model_dir))
    try:
        tokens = _tokens(engine)
    finally:
        engine.shutdown()
    assert tokens == hf_tokens
    return tokens


def _layouts() -> list[object]:
    layouts = []
    for world in (2, 4):
        dp = {"enable_dp_attention": True, "dp_size": world}
        for name, flags in [("tp", {}), ("tp-ep", {"ep_size": world}), ("dp", dp), ("dp-ep", dp | {"ep_size": world}),
                            ("tp-nccl", {"disable_custom_all_reduce": True}),
                            ("tp-deterministic", {"enable_deterministic_inference": True})]:  # sums by gather_sum
            layouts.append(pytest.param(world, flags, id=f"{name}{world}", marks=multi_gpu(world)))
    # Two DP groups of two ranks, each splitting its heads (o_proj summed over the group's NCCL subgroup).
    groups = {"enable_dp_attention": True, "dp_size": 2}
    for name, flags in [("dp2-tp4", groups), ("dp2-tp4-ep4", groups | {"ep_size": 4})]:
        layouts.append(pytest.param(4, flags, id=name, marks=multi_gpu(4)))
    return layouts


def _layout_tokens(model_dir: Path, world: int, flags: dict[str, object]) -> tuple[list[list[int]], ...]:
    """In its own process: the greedy tokens of PROMPTS and of PROMPTS[1] alone, the backends that fell back from
    their self-check, the CUDA graphs' status and the workers' exit codes."""
    engine = Engine(_args(model_dir, world, **flags))
    try:
        tokens = _tokens(engine)
        alone = _tokens(engine, PROMPTS[1:2])  # one request: under DP, the other groups idle
        fell_back = [c.name for c in engine.runner.backends.chosen if "fell back" in c.reason]
        graphs = engine.runner.graphs.status
        engine.check_pool_accounting()
    finally:
        engine.shutdown()
    assert engine.ranks is not None
    return tokens, alone, fell_back, graphs, [p.exitcode for p in engine.ranks.workers.values()]


@pytest.mark.parametrize(("world", "flags"), _layouts())
def test_ranks_give_one_gpus_greedy_tokens(model_dir: Path, one_gpu_tokens: list[list[int]], world: int,
                                           flags: dict[str, object]) -> None:
    tokens, alone, fell_back, graphs, exit_codes = run_in_process(_layout_tokens, model_dir, world, flags,
                                                              timeout_s=ENGINE_TIMEOUT_S)
    assert tokens == one_gpu_tokens
    assert alone == one_gpu_tokens[1:2]
    assert fell_back == []  # no backend fell back from its start-up self-check (as the triton MoE once did under EP)
    assert graphs.startswith("DECODE captured at batch sizes [1, 2, 4, 8, 12, 16]"), graphs  # DP attention's too
    assert exit_codes == [0] * (world - 1)


def _aborts_under_dp_attention(model_dir: Path, one_gpu_tokens: list[list[int]]) -> None:
    engine = Engine(_args(model_dir, 2, enable_dp_attention=True, dp_size=2, max_total_tokens=64))
    mix = [0, 1, 3]  # PROMPTS that fit the pool with their 24 tokens
    try:
        long = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
        outputs: list[queue.SimpleQueue[RequestOutput]] = [queue.SimpleQueue() for _ in range(12)]
        rids = [engine.submit(PROMPTS[mix[i % 3]], long, outputs[i].put) for i in range(12)]
        for i in range(0, 12, 3):
            outputs[i].get(timeout=60)  # its first token
            engine.abort(rids[i])
        for i in range(12):
            if i % 3:
                tokens: list[int] = []
                while not (output := outputs[i].get(timeout=60)).finished:
                    tokens += output.token_ids
                tokens += output.token_ids
                assert tokens[: GREEDY.max_new_tokens] == one_gpu_tokens[mix[i % 3]]
        assert engine.metrics.retractions._value.get() > 0
        engine.check_pool_accounting()
    finally:
        engine.shutdown()


@needs_gpus(2)
def test_aborts_under_dp_attention_leave_every_page_owned(model_dir: Path, one_gpu_tokens: list[list[int]]) -> None:
    """Twelve requests over two DP groups with a pool small enough to retract; every third aborted after its first
    token: the others get one GPU's tokens, and every group's pages come back."""
    run_in_process(_aborts_under_dp_attention, model_dir, one_gpu_tokens, timeout_s=ENGINE_TIMEOUT_S)


def _killed_rank(model_dir: Path) -> None:
    engine = Engine(_args(model_dir, 2))
    try:
        _tokens(engine, PROMPTS[:1])
        assert_killing_rank_1_ends_the_engine(engine, PROMPTS[0])
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="start each multi-GPU engine in its own process"):
        Engine(_args(model_dir, 2))


@needs_gpus(2)
def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(model_dir: Path) -> None:
    run_in_process(_killed_rank, model_dir, timeout_s=ENGINE_TIMEOUT_S)


def _two_nodes(model_dir: Path, world: int) -> tuple[list[list[int]], int]:
    """Node 0 (this process's engine, GPUs 0 .. world/2 - 1) and node 1 (`plugserve serve --node-rank 1` in a process
    of its own that sees only the other half of the GPUs, as a second host would): the greedy tokens, node 1's exit
    code once node 0 shuts down."""
    per_node = world // 2
    address = f"127.0.0.1:{pick_free_port()}"
    flags = ["--model-path", str(model_dir), "--tokenizer-path", str(EMBEDDED_MODEL_DIR), "--device", "cuda",
             "--dtype", "float32", "--max-total-tokens", "4096", "--max-running-requests", "16", "--tp-size",
             str(world), "--nnodes", "2", "--dist-init-addr", address]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ",".join(str(per_node + i) for i in range(per_node))}
    node1 = subprocess.Popen([sys.executable, "-m", "plugserve", "serve", *flags, "--node-rank", "1"], env=env)
    try:
        engine = Engine(_args(model_dir, world, nnodes=2, dist_init_addr=address))
        try:
            tokens = _tokens(engine)
        finally:
            engine.shutdown()
        return tokens, node1.wait(timeout=60)
    finally:
        node1.kill()


@pytest.mark.parametrize("world", [pytest.param(world, id=f"tp{world}", marks=multi_gpu(world)) for world in (2, 4)])
def test_two_nodes_give_one_gpus_greedy_tokens(model_dir: Path, one_gpu_tokens: list[list[int]], world: int) -> None:
    """--nnodes 2 on one machine, each node's processes seeing only its own GPUs."""
    tokens, node1_exit = run_in_process(_two_nodes, model_dir, world, timeout_s=ENGINE_TIMEOUT_S)
    assert tokens == one_gpu_tokens
    assert node1_exit == 0


CHAINS = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
TREE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 6}


def _speculative_layouts() -> list[object]:
    layouts = []
    for world in (2, 4):
        dp = {"enable_dp_attention": True, "dp_size": world}
        for name, flags in [("chains-tp", CHAINS), ("chains-tp-ep", CHAINS | {"ep_size": world}), ("tree-tp", TREE),
                            ("chains-dp", CHAINS | dp), ("tree-dp-ep", TREE | dp | {"ep_size": world})]:
            layouts.append(pytest.param(world, flags, id=f"{name}{world}", marks=multi_gpu(world)))
    layouts.append(pytest.param(4, TREE | {"enable_dp_attention": True, "dp_size": 2}, id="tree-dp2-tp4",
                                marks=multi_gpu(4)))
    return layouts


def _speculative_tokens(model_dir: Path, world: int, flags: dict[str, object]) -> tuple[object, ...]:
    """In its own process: the greedy tokens of PROMPTS with speculative decoding (Triton decode attention, which
    runs the round's graphs), the CUDA graphs' status, rank 0's replays of the greedy round's graph, the accept
    length once sampled requests ran too (whose drafts and acceptance rank 0 sends the other ranks mid-round; the
    random NextN layer's greedy drafts are seldom accepted) and the workers' exit codes."""
    engine = Engine(_args(model_dir, world, decode_attention_backend="triton", **flags))
    replay, round_replays = CudaGraphRunner.replay, []

    def counting(self: CudaGraphRunner, *args: object) -> object:
        round_replays.append(self is engine.runner.graphs.runners.get(ROUND))
        return replay(self, *args)

    CudaGraphRunner.replay = counting  # type: ignore[method-assign]  # this process's own engine only
    try:
        tokens = _tokens(engine)
        sampled = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))
        assert [r.error for r in sampled] == [None, None]
        graphs = engine.runner.graphs.status
        accept_length = engine.scheduler.spec.accept_length  # type: ignore[union-attr]
        engine.check_pool_accounting()
    finally:
        engine.shutdown()
    assert engine.ranks is not None
    return tokens, graphs, sum(round_replays), accept_length, [p.exitcode for p in engine.ranks.workers.values()]


@pytest.mark.parametrize(("world", "flags"), _speculative_layouts())
def test_speculative_decoding_over_ranks_gives_one_gpus_greedy_tokens(nextn_dir: Path,
                                                                       one_gpu_tokens: list[list[int]], world: int,
                                                                       flags: dict[str, object]) -> None:
    """Every rank runs the draft, verify and draft-extend forwards, chains in the greedy round's graph (eagerly
    under DP attention, each rank its group's requests)."""
    tokens, graphs, round_replays, accept_length, exit_codes = run_in_process(
        _speculative_tokens, nextn_dir, world, flags, timeout_s=ENGINE_TIMEOUT_S)
    assert tokens == one_gpu_tokens
    sizes = "captured at batch sizes [1, 2, 4, 8, 12, 16]"
    if "enable_dp_attention" in flags:
        assert graphs == DP_EAGER and round_replays == 0, graphs
    elif "speculative_eagle_topk" in flags:
        assert graphs.startswith(f"DRAFT_EXTEND {sizes}"), graphs
    else:
        assert graphs.startswith(f"TARGET_VERIFY, draft DECODE, DRAFT_EXTEND, greedy round {sizes}"), graphs
        assert round_replays > 0
    assert accept_length is not None and accept_length > 1
    assert exit_codes == [0] * (world - 1)
