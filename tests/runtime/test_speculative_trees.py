"""Speculative decoding with EAGLE-2 draft trees (topk > 1): greedy outputs equal those without speculation token
for token, whichever child of the tree the target's tokens are found at; the NextN layer grows its trees from the
state the rounds leave; flags and sampled requests are refused where trees cannot serve them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from plugserve.core.forward_batch import DraftTree, ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from plugserve.runtime.acceptance import verify_tree
from plugserve.runtime.engine import Engine
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from tests.checkpoints import add_mtp_layer, random_hf_model, save_hf_model, tiny_v3_config
from tests.engine_checks import assert_every_page_is_back
from tests.paged_runner import load_reference_model
from tests.runtime.test_speculative import (
    GREEDY,
    PROMPTS,
    SAMPLED,
    TARGET_LOGITS,
    _args,
    _outputs,
    _target_probs,
    check_seeded_sampling,
)

TREE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 8}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 (random weights) with a NextN layer."""
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path_factory.mktemp("v3-nextn-trees"))
    add_mtp_layer(directory, num_layers=3)
    return directory


@pytest.fixture(scope="module")
def plain(checkpoint):
    engine = Engine(_args(checkpoint))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def trees(checkpoint):
    engine = Engine(_args(checkpoint, **TREE))
    yield engine
    engine.shutdown()


def test_a_tree_mask_and_positions_follow_the_parents():
    tree = DraftTree.of(torch.tensor([[-1, 0, 0, 1, 2, 3]]))
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert tree.mask[0].long().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                                            [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]]
    pool = MLAKVPool(1, 4, 4, 8, 4, torch.float32, "cpu")
    batch = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [9], [6], torch.tensor([[2, 0, 3]], dtype=torch.int32),
                               pool)
    treed = batch.with_tree(tree)
    assert treed.positions.tolist() == [3, 4, 4, 5, 5, 6]
    assert torch.equal(treed.out_cache_loc, batch.out_cache_loc)  # node i keeps the slot of position 3 + i
    with pytest.raises(ValueError, match="precede"):
        DraftTree.of(torch.tensor([[-1, 2, 0]]))


def test_greedy_tree_verification_walks_the_children_holding_the_targets_argmax():
    # Request 0: the target's argmax path is 0 -> 2 -> 4 (second children), then its token 7 at node 4; request 1:
    # no child of the root holds the argmax.
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2], [-1, 0, 0, 1, 1, 2]])
    tokens = torch.tensor([[9, 1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 5]])
    argmax = torch.tensor([[2, 3, 4, 0, 7, 0], [6, 4, 0, 0, 0, 0]])
    logits = torch.zeros(2, 6, 10).scatter_(2, argmax[:, :, None], 1.0)
    greedy = SamplingParams(temperature=0, logprobs=True)
    out, path = verify_tree(logits, tokens, parents, [greedy] * 2, [[0]] * 2, [[]] * 2)
    assert out.accept_lens.tolist() == [2, 0]
    assert out.token_ids[0, :3].tolist() == [2, 4, 7] and out.token_ids[1, :1].tolist() == [6]
    assert path.tolist() == [[0, 2, 4, 4, 4, 4], [0] * 6]
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs[0, :3], logits[0, [0, 2, 4]].log_softmax(-1).amax(-1))


def _tree_of_the_targets_tokens(engine: Engine, expected: dict[tuple[int, ...], list[int]], wrong_every: int = 0
                                 ) -> Callable:
    """A test double for `SpeculativeWorker._draft_tree`: 8 nodes whose path of the target's greedy continuation
    (`expected`, by prompt) d1, d2, d3 runs through second children only (0 -> 2 -> 5 -> 7), beside wrong
    siblings and a wrong branch holding d2 under a wrong d1; `wrong_every` n > 0 spoils the path at an output
    index i with (i + prompt length) % n == 0, so that requests of one batch accept different lengths."""
    parents = [-1, 0, 0, 1, 2, 2, 5, 5]

    def draft(verify: ForwardBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        by_row = {r.table_row: r for r in engine.scheduler.running}
        drafts = []
        for row in rows.tolist():
            request = by_row[row]
            done = request.num_resolved
            right = expected[tuple(request.prompt_ids)][done : done + 3]
            for j in range(3):
                if wrong_every and (done + j + len(request.prompt_ids)) % wrong_every == 0:
                    right[j] = (right[j] + 1) % 320
            d1, d2, d3 = right
            drafts.append([(d1 + 1) % 320, d1, d2, (d2 + 1) % 320, d2, (d3 + 1) % 320, d3])
        return torch.tensor(drafts), torch.tensor([parents] * len(drafts))

    return draft


def test_greedy_outputs_with_the_nextn_layers_trees_equal_those_without_speculation(plain, trees):
    assert _outputs(trees.generate(PROMPTS, GREEDY)) == _outputs(plain.generate(PROMPTS, GREEDY))
    assert_every_page_is_back(trees)


@pytest.mark.parametrize("wrong_every", [0, 3])
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
def test_paths_accepted_off_the_first_child_equal_the_targets_greedy_tokens(plain, trees, monkeypatch, params,
                                                                            wrong_every):
    """Accepted nodes sit in other slots than their positions' until their KV is moved there: the rounds after
    read it, so any slip changes the tokens."""
    expected = plain.generate(PROMPTS, params)
    by_prompt = {tuple(p): r.token_ids + [0] * 8 for p, r in zip(PROMPTS, expected[:: params.n], strict=True)}
    worker = trees.scheduler.spec
    monkeypatch.setattr(worker, "_draft_tree", _tree_of_the_targets_tokens(trees, by_prompt, wrong_every))
    before = (worker.verify_steps, worker.accepted_tokens)
    results = trees.generate(PROMPTS, params)
    assert _outputs(results) == _outputs(expected)
    for got, want in zip(results, expected, strict=True):
        assert [(t.token_id, t.top and [i for i, _ in t.top]) for t in got.logprobs] == \
               [(t.token_id, t.top and [i for i, _ in t.top]) for t in want.logprobs]
        assert torch.allclose(torch.tensor([t.logprob for t in got.logprobs]),
                              torch.tensor([t.logprob for t in want.logprobs]), atol=1e-4)
    accept_length = (worker.accepted_tokens - before[1]) / (worker.verify_steps - before[0])
    assert accept_length > (3.0 if wrong_every == 0 else 1.5)
    assert_every_page_is_back(trees)


def _reference_nextn_logprobs(model, tokens: list[int], path: list[int]) -> torch.Tensor:
    """The NextN layer's log-probabilities [V] after `tokens` and the drafts `path`, from scratch on a fresh pool: the
    target over all but the last token, the NextN layer over the same positions reading the token after each, then
    one NextN decode step per draft, reading it and the NextN layer's own previous output."""
    n = len(tokens)
    pool = MLAKVPool(model.num_kv_layers, n + len(path), 1, model.config.kv_lora_rank,
                     model.config.qk_rope_head_dim, torch.float32, "cpu")
    table = torch.arange(n + len(path), dtype=torch.int32)[None]
    with torch.inference_mode():
        batch = ForwardBatch.build(ForwardMode.EXTEND, [n - 1], [n - 1], table, pool)
        hidden = model(torch.tensor(tokens[:-1]), batch)
        hidden = model.forward_nextn(torch.tensor(tokens[1:]), hidden, batch)[-1:]
        for step, token in enumerate(path, start=1):
            batch = ForwardBatch.build(ForwardMode.DECODE, [n - 1 + step], [1], table, pool)
            hidden = model.forward_nextn(torch.tensor([token]), hidden, batch)
        return model.compute_logits(hidden)[0].log_softmax(-1)


def test_the_nextn_layer_grows_its_trees_from_the_state_the_rounds_leave(checkpoint, trees, monkeypatch):
    """Every node's token is among the topk the NextN layer computes from scratch after the sequence so far and
    the node's ancestors: its tree forwards read the right KV, positions and hidden states."""
    worker, seen = trees.scheduler.spec, []
    real = worker._draft_tree

    def spy(verify: ForwardBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        drafts, parents = real(verify, rows)
        by_row = {r.table_row: r for r in trees.scheduler.running}
        for row, nodes, up in zip(rows.tolist(), drafts.tolist(), parents.tolist(), strict=True):
            request = by_row[row]
            seen.append((request.prompt_ids + request.output_ids[: request.num_resolved], [0, *nodes], up))
        return drafts, parents

    monkeypatch.setattr(worker, "_draft_tree", spy)
    trees.generate([[11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42]], GREEDY)
    model = load_reference_model(checkpoint)
    topk = TREE["speculative_eagle_topk"]
    assert len(seen) >= 2 * 3
    for tokens, nodes, parents in seen:
        assert len(nodes) == TREE["speculative_num_draft_tokens"] and parents[0] == -1
        for i in range(1, len(nodes)):
            path, j = [], parents[i]
            while j > 0:
                path.insert(0, nodes[j])
                j = parents[j]
            assert 0 <= parents[i] < i
            logprobs = _reference_nextn_logprobs(model, tokens, path)
            assert nodes[i] in logprobs.topk(topk).indices.tolist()


def test_trees_need_a_decode_backend_declaring_tree_verify(checkpoint, monkeypatch):
    caps = dataclasses.replace(TorchRefAttention.capabilities, tree_verify=False)
    monkeypatch.setattr(TorchRefAttention, "capabilities", caps)
    with pytest.raises(ValueError, match=r"--speculative-eagle-topk 2: .*torch_ref does not"):
        Engine(_args(checkpoint, **TREE))


def test_draft_token_counts_a_tree_cannot_hold_are_refused():
    flags = {**TREE, "model_preset": "tiny"}
    assert ServerArgs(**{**flags, "speculative_num_draft_tokens": 11}).speculative.num_draft_tokens == 11
    with pytest.raises(ValueError, match=r"--speculative-num-draft-tokens 12 is more than .* at most 11"):
        ServerArgs(**{**flags, "speculative_num_draft_tokens": 12})
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        ServerArgs(**{**flags, "speculative_num_draft_tokens": 1})


# A tree over 4 tokens whose target distribution depends on depth only (as TARGET_LOGITS on position): the root's
# candidates 0, 1, 2; node 1 (token 0) has candidates 0, 3; node 2 (token 1) has candidate 1.
TREE_TOKENS = torch.tensor([[3, 0, 1, 2, 0, 3, 1]])
TREE_PARENTS = torch.tensor([[-1, 0, 0, 0, 1, 1, 2]])
DEPTH_LOGITS = TARGET_LOGITS[[0, 1, 1, 1, 2, 2, 2]]  # [n, V]: a node's logits are its depth's


def _two_tokens(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes t1 * 4 + t2 [rows], accept_lens [rows]) of one verify of the tree per row, the second token drawn
    straight from the target where the walk stopped at the root, as the next round would."""
    generator = torch.Generator().manual_seed(0)
    out, _ = verify_tree(DEPTH_LOGITS.expand(rows, -1, -1), TREE_TOKENS.expand(rows, -1),
                         TREE_PARENTS.expand(rows, -1), [SAMPLED] * rows, [[0]] * rows, [[]] * rows, [None] * rows,
                         generator)
    fresh = torch.multinomial(_target_probs()[1], rows, replacement=True, generator=generator)
    second = torch.where(out.accept_lens >= 1, out.token_ids[:, 1], fresh)
    return out.token_ids[:, 0] * 4 + second, out.accept_lens


def test_sampling_a_tree_keeps_the_targets_distribution():
    """Total variation between 40000 draws of two tokens and the target's joint distribution (12 cells) is about
    0.01 from sampling noise. The accept lengths follow: the first token is kept exactly when it is a root
    candidate (probability p(0) + p(1) + p(2)), the second when it is one of its node's; a walk keeping each
    candidate with its plain probability instead of its share of what the rejected siblings leave would keep the
    first with 1 - (1 - p(0))(1 - p(1))(1 - p(2)), far off."""
    p = _target_probs()
    joint = (p[0][:, None] * p[1][None, :]).flatten()
    codes, accept_lens = _two_tokens(40000)
    counts = torch.bincount(codes, minlength=16).float() / len(codes)
    assert 0.5 * (counts - joint).abs().sum().item() < 0.025
    first_kept = p[0][:3].sum().item()
    second_kept = (p[0][0] * (p[1][0] + p[1][3]) + p[0][1] * p[1][1]).item()
    assert abs((accept_lens >= 1).float().mean().item() - first_kept) < 0.01
    assert abs((accept_lens == 2).float().mean().item() - second_kept) < 0.01
    assert abs((1 - (1 - p[0][:3]).prod()).item() - first_kept) > 0.05  # the check tells the two rules apart


def test_sampled_requests_with_trees_stay_in_the_targets_top_k_and_repeat_with_their_seed(trees):
    check_seeded_sampling(trees)


CHAINS = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
TRITON = {"decode_attention_backend": "triton"}
SHORT = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)


def _triton_outputs(checkpoint, **flags) -> list[tuple]:
    # Room for the two requests only: the warm-up walks each decode batch size up to it through the interpreter.
    engine = Engine(_args(checkpoint, **TRITON, max_running_requests=2, **flags))
    try:
        return _outputs(engine.generate(PROMPTS[:2], SHORT))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def triton_plain(checkpoint) -> list[tuple]:
    """Greedy outputs of two short requests on the Triton decode backend without speculation."""
    return _triton_outputs(checkpoint)


@pytest.mark.parametrize("speculation", [CHAINS, TREE], ids=["chains", "trees"])
def test_rounds_on_the_triton_decode_backend_equal_its_outputs_without_speculation(checkpoint, triton_plain,
                                                                                   speculation):
    """The Triton attention backend's TARGET_VERIFY and DRAFT_EXTEND, causal or tree-masked (interpreted on the
    CPU, compiled on a GPU): greedy tokens with speculation equal the same backend's without."""
    assert _triton_outputs(checkpoint, **speculation) == triton_plain
