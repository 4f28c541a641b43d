"""The CUDA-graph runner's logic that needs no GPU: capture sizes, padding, static buffers, and that a
padded static batch computes what the real batch computes (the graph itself is checked on the GPU)."""

from __future__ import annotations

import pytest
import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.graph_inputs import GraphInputs, capture_sizes, padded_size
from plugserve.core.kv_cache import MLAKVPool
from plugserve.runtime import warmup
from plugserve.runtime.cuda_graph_runner import CudaGraphRunner, _Graph, dp_graph_size
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.rank_protocol import Header, idle_part
from plugserve.runtime.server_args import ServerArgs


def test_capture_sizes_follow_sglang_and_end_at_the_max():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 12, 16, 20]
    full = capture_sizes(256)
    assert full[:6] == [1, 2, 4, 8, 12, 16] and full[-2:] == [248, 256] and len(full) == 36
    assert capture_sizes(300)[-2:] == [256, 300]


@pytest.mark.parametrize(("batch", "expected"), [(1, 1), (3, 4), (4, 4), (9, 12), (13, 16), (17, None)])
def test_a_batch_replays_the_smallest_graph_that_holds_it(batch, expected):
    assert padded_size([1, 2, 4, 8, 12, 16], batch) == expected


def _pool(page_size: int = 4, num_pages: int = 9) -> MLAKVPool:
    return MLAKVPool(2, num_pages, page_size, 8, 4, torch.float32, "cpu")


def _real_batch(pool: MLAKVPool, seq_lens: list[int], pages: list[list[int]], mode=ForwardMode.DECODE,
                per_request: int = 1) -> ForwardBatch:
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int32)
    return ForwardBatch.build(mode, seq_lens, [per_request] * len(seq_lens), table, pool)


def test_load_copies_the_batch_and_pads_the_rest_onto_the_padding_page():
    pool = _pool()
    inputs = GraphInputs(max_batch_size=8, tokens_per_request=1, max_pages=3, pool=pool, padding_page=8)
    real = _real_batch(pool, [5, 2, 9], [[3, 1], [0], [2, 4, 6]])
    static = inputs.load(torch.tensor([11, 12, 13]), real, batch_size=4)
    assert static.batch_size == 4 and static.seq_lens_cpu == [5, 2, 9, 1] and static.extend_lens_cpu == [1] * 4
    assert inputs.input_ids[:3].tolist() == [11, 12, 13]
    assert static.seq_lens.tolist() == [5, 2, 9, 1]
    assert static.positions.tolist() == [4, 1, 8, 0]
    assert static.out_cache_loc.tolist() == [real.out_cache_loc[i].item() for i in range(3)] + [8 * 4]
    assert static.block_table[:3, :3].tolist()[2] == [2, 4, 6] and static.block_table[3].tolist() == [8, 8, 8]
    assert static.cu_extend_lens.tolist() == [0, 1, 2, 3, 4]
    # The static batch is a view of the buffers: a graph captured on them sees every later load.
    assert static.block_table.data_ptr() == inputs.block_table.data_ptr()
    assert static.positions.data_ptr() == inputs.positions.data_ptr()

    # A smaller batch later: rows that held real requests become padding again.
    again = inputs.load(torch.tensor([7]), _real_batch(pool, [3], [[5]]), batch_size=4)
    assert again.seq_lens.tolist() == [3, 1, 1, 1] and again.positions.tolist() == [2, 0, 0, 0]
    assert inputs.block_table[1:4, 0].tolist() == [8, 8, 8]
    assert again.out_cache_loc.tolist()[1:] == [32, 32, 32]


def test_verify_batches_pad_every_draft_token_onto_the_padding_page():
    pool = _pool(page_size=2)
    inputs = GraphInputs(max_batch_size=4, tokens_per_request=3, max_pages=4, pool=pool, padding_page=8)
    real = _real_batch(pool, [7], [[1, 2, 3, 4]], ForwardMode.TARGET_VERIFY, per_request=3)
    static = inputs.load(torch.tensor([1, 2, 3]), real, batch_size=2)
    assert static.num_tokens == 6 and static.positions.tolist() == [4, 5, 6, 0, 1, 2]
    assert static.out_cache_loc.tolist()[3:] == [16, 17, 16]  # positions 0, 1, 2 of a row of padding pages
    assert static.cu_extend_lens.tolist() == [0, 3, 6]


def test_load_refuses_what_no_graph_holds():
    pool = _pool()
    inputs = GraphInputs(max_batch_size=2, tokens_per_request=1, max_pages=2, pool=pool, padding_page=8)
    with pytest.raises(ValueError, match="does not fit a graph"):
        inputs.load(torch.tensor([1, 2, 3]), _real_batch(pool, [1, 1, 1], [[0], [1], [2]]), batch_size=2)
    with pytest.raises(ValueError, match="does not fit a graph"):
        inputs.load(torch.tensor([1]), _real_batch(pool, [12], [[0, 1, 2]]), batch_size=2)
    with pytest.raises(ValueError, match="new tokens per request"):
        inputs.load(torch.tensor([1, 2]), _real_batch(pool, [4], [[0]], ForwardMode.EXTEND, per_request=2), 2)


class _Recorder:
    """Stands in for a graph (replay) and its attention backend (plan_replay), counting the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def replay(self) -> None:
        self.calls.append("replay")

    def plan_replay(self, batch: ForwardBatch) -> None:
        self.calls.append(f"plan {batch.seq_lens_cpu}")


@pytest.mark.parametrize(("plan_in_graph", "expected"), [(False, ["plan [3, 1]", "replay"]), (True, ["replay"])])
def test_a_replay_plans_on_the_host_unless_the_plan_was_captured(plan_in_graph: bool, expected: list[str]):
    pool = _pool()
    recorder = _Recorder()
    graphs = CudaGraphRunner(ForwardMode.DECODE, [2], 1, 3, pool, 8, lambda size: recorder)  # type: ignore[arg-type]
    output = torch.arange(2.0)
    graphs._graphs[2] = _Graph(recorder, graphs.inputs.batch(ForwardMode.DECODE, 2), recorder,  # type: ignore[arg-type]
                               (output,), plan_in_graph)
    (out,) = graphs.replay(torch.tensor([4]), _real_batch(pool, [3], [[5]]))
    assert recorder.calls == expected and out.tolist() == [0.0]


def _decode(batch_size: int, width: int = 1, sampled: int | None = None) -> Header:
    return Header(ForwardMode.DECODE, [5] * batch_size, [1] * batch_size, width,
                  batch_size if sampled is None else sampled)


@pytest.mark.parametrize(("headers", "expected"), [
    ([_decode(3), None], 4),  # the largest group's batch, padded; the idle group replays it too
    ([_decode(1), _decode(5)], 8),
    ([_decode(9), _decode(1)], None),  # larger than the largest graph
    ([_decode(2), Header(ForwardMode.EXTEND, [7], [7], 1, 1)], None),  # a prefill anywhere: eager everywhere
    ([_decode(2, width=4), _decode(1)], None),  # wider than the graphs' block table
    ([_decode(2, sampled=1), None], None),  # not every request's token sampled
    ([None, None], None),
])
def test_every_dp_group_replays_the_graph_of_the_largest_groups_batch(headers: list[Header | None],
                                                                      expected: int | None):
    graphs = CudaGraphRunner(ForwardMode.DECODE, [1, 2, 4, 8], 1, 3, _pool(), 8, lambda size: None,  # type: ignore
                             dp_size=2)
    assert dp_graph_size(graphs, headers) == expected


def test_an_idle_dp_group_replays_padding_rows_and_gets_every_groups_logits():
    pool = _pool()
    recorder = _Recorder()
    graphs = CudaGraphRunner(ForwardMode.DECODE, [4], 1, 3, pool, 8, lambda size: recorder,  # type: ignore[arg-type]
                             dp_size=2)
    output = torch.arange(8.0)  # two groups' 4 rows
    graphs._graphs[4] = _Graph(recorder, graphs.inputs.batch(ForwardMode.DECODE, 4), recorder,  # type: ignore[arg-type]
                               (output,), False)
    graphs.inputs.out_cache_loc.fill_(0)
    idle = idle_part(pool)
    (out,) = graphs.replay_dp(idle.input_ids, idle.batch, 4, [0, 3])
    assert recorder.calls == ["plan [1, 1, 1, 1]", "replay"] and out.tolist() == list(range(8))
    assert graphs.inputs.out_cache_loc.tolist() == [8 * pool.page_size] * 4  # every row on the padding page
    # The MoE's gathered rows: the other group's 3 real, every row of this idle group padding.
    assert graphs.dp_real_rows.tolist() == [False] * 4 + [True] * 3 + [False]
    (out,) = graphs.replay_dp(torch.tensor([4, 5]), _real_batch(pool, [3, 6], [[5], [6, 7]]), 4, [2, 1])
    assert recorder.calls[2:] == ["plan [3, 6, 1, 1]", "replay"] and graphs.inputs.input_ids[:2].tolist() == [4, 5]
    assert graphs.dp_real_rows.tolist() == [True, True, False, False, True, False, False, False]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(ServerArgs(model_preset="tiny", device="cpu", page_size=4, max_total_tokens=256))  # eager: CPU


def test_padded_static_batch_gives_the_real_rows_the_eager_logits(runner: ModelRunner):
    """What a replay computes: the real batch copied into static buffers, padded to a captured size,
    run without re-planning anything but `plan_replay`'s refresh. Here eagerly (no GPU), with the
    backend's own plan on the static batch."""
    torch.manual_seed(0)
    pages = runner.allocator.alloc(6)
    table = torch.tensor([[*pages[:2], pages[1]], pages[2:5]], dtype=torch.int32)
    prompt_batch = runner.prepare(ForwardBatch.build(ForwardMode.EXTEND, [7, 10], [7, 10], table, runner.pool))
    ids = torch.randint(0, 300, (17,))
    runner.forward(ids, prompt_batch, torch.tensor([6, 16]))  # fills the cache
    decode = runner.prepare(ForwardBatch.build(ForwardMode.DECODE, [8, 11], [1, 1], table, runner.pool))
    step = torch.tensor([5, 9])
    eager = runner.forward(step, decode, torch.arange(2))

    inputs = GraphInputs(8, 1, 4, runner.pool, runner.padding_page)
    static = inputs.load(step, decode, batch_size=4)
    padded = runner.logits(inputs.input_ids[:4], static, runner.backends.attention(static), plan=True)
    torch.testing.assert_close(padded[:2, : runner.sample_vocab], eager)
    runner.allocator.free(pages)


def test_warm_up_walks_prefill_and_decode_buckets_and_gives_pages_back(runner: ModelRunner, monkeypatch):
    prefills, prefill = [], warmup.warm_up_prefill
    monkeypatch.setattr(warmup, "warm_up_prefill", lambda runner, n: prefills.append(n) or prefill(runner, n))
    free = runner.allocator.num_free
    warmup.warm_up(runner)
    assert runner.allocator.num_free == free
    assert not runner.graphs.runners
    # Every power of two from 16 to the largest size warmed (CPU_WARMUP_TOKENS here), each once.
    assert prefills == [16, 32, 64]


def test_nextn_graph_inputs_load_hidden_states_and_pad_a_draft_extend_batch():
    pool = _pool(page_size=2)
    inputs = GraphInputs(max_batch_size=4, tokens_per_request=3, max_pages=4, pool=pool, padding_page=8,
                         hidden=(5, torch.float16))
    assert inputs.hidden is not None and inputs.hidden.shape == (12, 5) and inputs.hidden.dtype == torch.float16
    real = _real_batch(pool, [7, 4], [[1, 2, 3, 4], [5, 6]], ForwardMode.DRAFT_EXTEND, per_request=3)
    hidden = torch.arange(30, dtype=torch.float16).view(6, 5)
    static = inputs.load(torch.arange(6), real, batch_size=4, hidden=hidden)
    assert static.mode is ForwardMode.DRAFT_EXTEND and static.num_tokens == 12
    assert torch.equal(inputs.hidden[:6], hidden)
    assert static.positions.tolist() == [4, 5, 6, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert static.seq_lens.tolist() == [7, 4, 3, 3] and static.out_cache_loc.tolist()[6:] == [16, 17, 16] * 2
    with pytest.raises(ValueError, match="hidden states go with graphs of the NextN layer"):
        inputs.load(torch.arange(6), real, batch_size=4)
    target = GraphInputs(max_batch_size=4, tokens_per_request=3, max_pages=4, pool=pool, padding_page=8)
    assert target.hidden is None
    with pytest.raises(ValueError, match="hidden states go with graphs of the NextN layer"):
        target.load(torch.arange(6), real, batch_size=4, hidden=hidden)
