"""Speculative rounds under CUDA graphs, on the CPU: `EagerGraphRunner` stands in for the captured graphs (it runs
the captured forward eagerly on the runner's static buffers: the load, padding and slicing of a replay, with the
backend's own plan instead of plan_replay). Which forwards are captured and why the others run eagerly
(`graph_status`), that the padded DRAFT_EXTEND gives the accepted tokens the unpadded forward's outputs, and that
greedy outputs with graphs equal those without speculation; these run on the CPU everywhere. The last test
captures and replays real graphs, on a GPU only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import plugserve.runtime.cuda_graph_runner as cuda_graph_runner_module
import plugserve.runtime.speculative_graphs as speculative_graphs_module
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import pages_needed
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from plugserve.runtime.cuda_graph_runner import CudaGraphRunner, GraphForward
from plugserve.runtime.engine import Engine
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from plugserve.runtime.speculative import ROUND, build_runner
from tests.checkpoints import add_mtp_layer, random_hf_model, save_hf_model, tiny_v3_config
from tests.paged_runner import load_reference_model
from tests.runtime.test_speculative import _copying_draft, _reference_drafts

CHAINS = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
TREES = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
         "speculative_num_draft_tokens": 5}
GREEDY = SamplingParams(max_new_tokens=11, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], [100, 101, 102, 103, 104, 105, 106, 107, 108] * 3, [7], [250, 3, 250, 3]]
ALL_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})
GRAPH_MAX_BS = 4  # graphs of 1, 2 and 4 requests


class EagerGraphRunner(CudaGraphRunner):
    """A CudaGraphRunner whose graphs replay by running the captured forward eagerly on the static batch."""

    def capture(self, forward: GraphForward, pool_handle: object, progress=None) -> None:
        self.forward, self.replays = forward, []
        for size in reversed(self.sizes):
            if progress is not None:
                progress(size)

    def _launch(self, size: int, static: ForwardBatch) -> tuple[torch.Tensor, ...]:
        self.replays.append(size)
        n = size * self.tokens_per_request
        attention = self.backend_for_size(size)
        attention.plan(static)
        hidden = None if self.inputs.hidden is None else self.inputs.hidden[:n]
        return self.forward(self.inputs.input_ids[:n], hidden, static, attention)


def _capture(runner: ModelRunner, monkeypatch, graph_modes: frozenset[ForwardMode], max_bs: int = GRAPH_MAX_BS,
             moe_graph: bool = True, plan_on_device: bool = False) -> None:
    """`runner.capture_graphs()` on the CPU, with stand-in graphs, torch_ref declaring `graph_modes` (and
    graph_plan_on_device as `plan_on_device` says: the greedy round's graph then plans each of its forwards with
    `plan`) and the MoE backend declaring cuda_graph as `moe_graph` says."""
    monkeypatch.setattr(TorchRefAttention, "capabilities",
                        dataclasses.replace(TorchRefAttention.capabilities, graph_modes=graph_modes,
                                            graph_plan_on_device=plan_on_device))
    monkeypatch.setattr(speculative_graphs_module, "plan_in_graph", lambda attention, batch: attention.plan(batch))
    moe = runner.model.backends.moe
    monkeypatch.setattr(type(moe), "capabilities", dataclasses.replace(moe.capabilities, cuda_graph=moe_graph))
    monkeypatch.setattr(cuda_graph_runner_module, "CudaGraphRunner", EagerGraphRunner)
    monkeypatch.setattr(cuda_graph_runner_module, "init_graph_attention", lambda runners: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    runner.graphs.runners, runner.graph_max_bs = {}, max_bs
    runner.capture_graphs()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 (random weights) with a NextN layer."""
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path_factory.mktemp("v3-nextn-graphs"))
    add_mtp_layer(directory, num_layers=3)
    return directory


def _args(checkpoint, **flags) -> ServerArgs:
    return ServerArgs(**{"model_path": str(checkpoint), "tokenizer_path": str(EMBEDDED_MODEL_DIR),
                         "max_total_tokens": 1024, "device": "cpu", **flags})


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    engine = Engine(_args(checkpoint))
    try:
        return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.shutdown()


ON_HOST = "greedy round is not one graph: attention backend torch_ref plans on the host before each replay"


@pytest.mark.parametrize(("flags", "graph_modes", "plan_on_device", "status", "captured"), [
    (CHAINS, ALL_MODES, False, "TARGET_VERIFY, draft DECODE, DRAFT_EXTEND captured at batch sizes [1, 2, 4] (larger "
     f"batches run eagerly); {ON_HOST}", {"TARGET_VERIFY", "draft DECODE", "DRAFT_EXTEND"}),
    (CHAINS, ALL_MODES, True, "TARGET_VERIFY, draft DECODE, DRAFT_EXTEND, greedy round captured at batch sizes "
     "[1, 2, 4] (larger batches run eagerly)", {"TARGET_VERIFY", "draft DECODE", "DRAFT_EXTEND"}),
    (CHAINS, frozenset({ForwardMode.TARGET_VERIFY}), True, "TARGET_VERIFY captured at batch sizes [1, 2, 4] (larger "
     "batches run eagerly); draft DECODE runs eagerly: attention backend torch_ref does not run DECODE under CUDA "
     "graphs; DRAFT_EXTEND runs eagerly: attention backend torch_ref does not run DRAFT_EXTEND under CUDA graphs; "
     "greedy round is not one graph: attention backend torch_ref does not run DECODE under CUDA graphs",
     {"TARGET_VERIFY"}),
    (TREES, ALL_MODES, False, "DRAFT_EXTEND captured at batch sizes [1, 2, 4] (larger batches run eagerly); draft "
     "trees verify and draft eagerly: no attention backend runs tree attention under CUDA graphs", {"DRAFT_EXTEND"}),
])
def test_rounds_under_graphs_give_the_greedy_outputs_without_speculation(checkpoint, expected, monkeypatch, flags,
                                                                         graph_modes, plan_on_device, status, captured):
    """With the greedy round's graph, every round of these greedy requests replays it and nothing else."""
    engine = Engine(_args(checkpoint, **flags))
    try:
        engine.ready.wait()
        runner = engine.runner
        _capture(runner, monkeypatch, graph_modes, plan_on_device=plan_on_device)
        assert runner.graphs.status == status
        graphs = runner.graphs.runners
        assert set(graphs) - {ROUND} == captured
        assert (ROUND in graphs) == ("greedy round captured" in status)
        forwards: list[EagerGraphRunner] = [g for label, g in graphs.items() if label != ROUND]  # type: ignore[misc]
        rounds: list[EagerGraphRunner] = [graphs[ROUND]] if ROUND in graphs else []  # type: ignore[list-item]
        used, unused = (rounds, forwards) if rounds else (forwards, [])
        # 5 requests: rounds past the largest graph run eagerly.
        assert [r.token_ids for r in engine.generate([*PROMPTS, PROMPTS[0]], GREEDY)] == [*expected, expected[0]]
        # 3 requests: rounds on the graphs of 4, one request of padding.
        for graph in forwards + rounds:
            graph.replays.clear()
        assert [r.token_ids for r in engine.generate(PROMPTS[:3], GREEDY)] == expected[:3]
        assert all(4 in g.replays for g in used) and not any(g.replays for g in unused)
        if rounds:  # a penalty is applied on the host: those rounds replay each forward's graph
            penalized = dataclasses.replace(GREEDY, repetition_penalty=1.3)
            for graph in forwards + rounds:
                graph.replays.clear()
            with_graphs = [r.token_ids for r in engine.generate(PROMPTS[:3], penalized)]
            assert all(g.replays for g in forwards) and not rounds[0].replays
            graphs.clear()
            assert [r.token_ids for r in engine.generate(PROMPTS[:3], penalized)] == with_graphs
    finally:
        engine.shutdown()


def test_nothing_is_captured_when_the_backend_declares_no_mode_or_the_moe_backend_cannot(checkpoint, monkeypatch):
    runner = build_runner(_args(checkpoint, **CHAINS))
    assert runner.graphs.status == "no CUDA graphs on the CPU"
    _capture(runner, monkeypatch, frozenset())
    assert not runner.graphs.runners
    assert runner.graphs.status == "; ".join(
        f"{label}: attention backend torch_ref does not run {mode} under CUDA graphs"
        for label, mode in (("TARGET_VERIFY runs eagerly", "TARGET_VERIFY"), ("draft DECODE runs eagerly", "DECODE"),
                            ("DRAFT_EXTEND runs eagerly", "DRAFT_EXTEND"), ("greedy round is not one graph", "DECODE")))
    _capture(runner, monkeypatch, ALL_MODES, moe_graph=False, plan_on_device=True)
    assert not runner.graphs.runners
    moe = runner.model.backends.moe.name
    assert runner.graphs.status.count(f"moe backend {moe} cannot be captured in a CUDA graph") == 4


def test_a_failed_capture_leaves_every_forward_eager_and_says_why(checkpoint, monkeypatch):
    runner = build_runner(_args(checkpoint, **CHAINS))

    def fail(self, forward, pool_handle, progress=None):
        if self.mode is ForwardMode.DRAFT_EXTEND:
            raise RuntimeError("out of graph memory")
        real(self, forward, pool_handle, progress)

    real = EagerGraphRunner.capture
    monkeypatch.setattr(EagerGraphRunner, "capture", fail)
    _capture(runner, monkeypatch, ALL_MODES, plan_on_device=True)
    assert not runner.graphs.runners
    assert runner.graphs.status == ("TARGET_VERIFY, draft DECODE, DRAFT_EXTEND, greedy round run eagerly: capture "
                                   "failed: RuntimeError: out of graph memory")


def test_without_speculation_only_the_targets_decode_is_captured(checkpoint, monkeypatch):
    runner = ModelRunner(_args(checkpoint))
    _capture(runner, monkeypatch, ALL_MODES, max_bs=5)
    assert runner.graphs.status == "DECODE captured at batch sizes [1, 2, 4, 5] (larger batches run eagerly)"
    assert set(runner.graphs.runners) == {"DECODE"}


@torch.inference_mode()
def test_padded_draft_extend_gives_the_accepted_tokens_the_unpadded_outputs(checkpoint, monkeypatch):
    """DRAFT_EXTEND padded to n tokens per request (eagerly, and replayed on a graph of 4 requests whose last
    is padding) gives each request's accepted rows what the forward over only those rows gives."""
    runner = build_runner(_args(checkpoint, **CHAINS))
    _capture(runner, monkeypatch, ALL_MODES, max_bs=4)
    worker_nextn = runner.graphs.runners["DRAFT_EXTEND"]
    n, prefix, accepted = 4, [6, 9, 3], [1, 3, 4]  # 1 .. n tokens accepted (the accepted drafts and one more)
    torch.manual_seed(0)
    rows_pages = [runner.allocator.alloc(pages_needed(p + n, runner.page_size)) for p in prefix]
    width = max(map(len, rows_pages))
    table = torch.tensor([p + [p[-1]] * (width - len(p)) for p in rows_pages], dtype=torch.int32)
    hidden_size = runner.config.hidden_size

    def nextn(ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        attention = runner.backends.attention(runner.prepare(batch))
        attention.plan(batch)
        return runner.model.forward_nextn(ids, hidden, batch, attention)

    # The NextN layer's KV of the prefixes.
    nextn(torch.randint(0, 300, (sum(prefix),)), torch.randn(sum(prefix), hidden_size),
          ForwardBatch.build(ForwardMode.EXTEND, prefix, prefix, table, runner.pool))
    b = len(prefix)
    ids, hidden = torch.randint(0, 300, (b * n,)), torch.randn(b * n, hidden_size)
    rows = torch.tensor([i * n + j for i, a in enumerate(accepted) for j in range(a)])
    unpadded = nextn(ids[rows], hidden[rows], ForwardBatch.build(
        ForwardMode.DRAFT_EXTEND, [p + a for p, a in zip(prefix, accepted, strict=True)], accepted, table,
        runner.pool))
    padded_batch = ForwardBatch.build(ForwardMode.DRAFT_EXTEND, [p + n for p in prefix], [n] * b, table, runner.pool)
    padded = nextn(ids, hidden, padded_batch)
    torch.testing.assert_close(padded[rows], unpadded)
    greedy, replayed = worker_nextn.replay(ids, padded_batch, hidden)
    assert worker_nextn.replays == [4]  # type: ignore[attr-defined]
    torch.testing.assert_close(replayed[rows], unpadded)
    # The next round's first greedy drafts, from the same graph.
    assert torch.equal(greedy[rows], runner.model.compute_logits(unpadded)[:, : runner.sample_vocab].argmax(-1))
    for pages in rows_pages:
        runner.allocator.free(pages)


def test_graphed_rounds_leave_the_nextn_layer_the_state_of_the_accepted_tokens(checkpoint, expected, monkeypatch):
    """Each round's NextN drafts, drafted on the graphs, are what the NextN layer computes from scratch over the
    sequence so far: the padded DRAFT_EXTEND on its graph kept the accepted tokens' KV and the h' of the last.
    The rounds verify the target's own continuation instead (every third draft spoiled), so that requests
    accept runs of every length."""
    engine = Engine(_args(checkpoint, **CHAINS))
    try:
        engine.ready.wait()
        _capture(engine.runner, monkeypatch, ALL_MODES)
        worker, seen = engine.scheduler.spec, []
        real = worker._draft
        copying = _copying_draft({tuple(p): e for p, e in zip(PROMPTS, expected, strict=True)}, wrong_every=3)

        def spy(verify, requests, rows, default_generator, greedy):
            drafts, _ = real(verify, requests, rows, default_generator, greedy)
            for request, chain in zip(requests, drafts.tolist(), strict=True):
                seen.append((request.prompt_ids + request.output_ids[: request.num_resolved], chain))
            return copying(verify, requests, rows, default_generator, greedy)

        monkeypatch.setattr(worker, "_draft", spy)
        params = dataclasses.replace(GREEDY, max_new_tokens=GREEDY.max_new_tokens - CHAINS["speculative_num_steps"])
        assert [r.token_ids for r in engine.generate(PROMPTS[:2], params)] == [e[:8] for e in expected[:2]]
        nextn = [engine.runner.graphs.runners[label] for label in ("draft DECODE", "DRAFT_EXTEND")]
        assert all(g.replays for g in nextn)  # type: ignore[attr-defined]
        assert worker.accepted_tokens > 2 * worker.verify_steps
    finally:
        engine.shutdown()
    model = load_reference_model(checkpoint)
    assert [d for _, d in seen] == [_reference_drafts(model, tokens, CHAINS["speculative_num_steps"])
                                    for tokens, _ in seen]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_the_gpu_rounds_replay_their_graphs_and_give_the_greedy_outputs_without_speculation(checkpoint,
                                                                                               monkeypatch):
    """Real capture and replay (float32, Triton attention, graphs of 1, 2 and 4 requests) against the engine without
    speculation, whose decode replays its own graphs: greedy rounds replay the round's graph, rounds with a penalty
    each forward's."""
    gpu = {"device": "cuda", "dtype": "float32", "decode_attention_backend": "triton", "cuda_graph_max_bs": 4}
    replays: list[tuple[ForwardMode | str, int]] = []
    rounds: set[int] = set()
    replay = CudaGraphRunner.replay

    def counting(self, input_ids, batch, hidden=None):
        replays.append(("round" if id(self) in rounds else self.mode, batch.batch_size))
        return replay(self, input_ids, batch, hidden)

    monkeypatch.setattr(CudaGraphRunner, "replay", counting)
    penalized = dataclasses.replace(GREEDY, repetition_penalty=1.3)
    outputs, statuses = [], []
    for flags in ({}, CHAINS):
        replays.clear()  # the speculative engine's are kept
        engine = Engine(_args(checkpoint, **gpu, **flags))
        try:
            engine.ready.wait()
            rounds.add(id(engine.runner.graphs.runners.get(ROUND)))
            # 5 requests: past the largest graph, eagerly; then 3 on the graphs of 4.
            outputs.append([r.token_ids for r in engine.generate([*PROMPTS, PROMPTS[0]], GREEDY)]
                           + [r.token_ids for r in engine.generate(PROMPTS[:3], GREEDY)]
                           + [r.token_ids for r in engine.generate(PROMPTS[:3], penalized)])
            statuses.append(engine.runner.graphs.status)
        finally:
            engine.shutdown()
    assert statuses == ["DECODE captured at batch sizes [1, 2, 4] (larger batches run eagerly)",
                        "TARGET_VERIFY, draft DECODE, DRAFT_EXTEND, greedy round captured at batch sizes [1, 2, 4] "
                        "(larger batches run eagerly)"]
    assert outputs[1] == outputs[0]
    assert {ForwardMode.TARGET_VERIFY, ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND} <= {m for m, _ in replays}
    assert ("round", 3) in replays and (ForwardMode.TARGET_VERIFY, 3) in replays
