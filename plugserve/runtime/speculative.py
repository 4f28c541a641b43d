"""Speculative decoding with the target's own NextN (MTP) layer as the draft: chains (EAGLE with topk 1) and
EAGLE-2 trees (topk > 1).

A running request's tokens are x_0 .. x_{L-1}. The target's KV holds positions 0 .. L - 2 (as without
speculation), and so does the NextN layer's (position i read x_{i+1} and the target's final normed hidden state
at i, as the checkpoints' MTP layer was trained); `SpeculativeWorker.hidden` keeps the NextN layer's output h' at
L - 2, which predicts x_L. One round of k steps:

  draft         d_1 from the logits of h' (a greedy request's: their argmax, kept where h' was computed, in
                `first_draft`); then k - 1 DECODE forwards of the NextN layer, step j at position
                L - 3 + j reading d_{j-1} and its own previous output (the NextN output at position i stands for
                the target's hidden state at i + 1, as both predict token i + 2) -> d_j.
  verify        one TARGET_VERIFY forward of x_{L-1}, d_1 .. d_k at positions L - 1 .. L - 1 + k.
  accept        `verify_drafts`: d_1 .. d_a and the target's token after them, a + 1 tokens (1 .. k + 1).
  draft extend  one DRAFT_EXTEND forward of the NextN layer at positions L - 1 .. L - 1 + a, reading the accepted
                tokens and the target's hidden states of the verify: its KV there (the draft steps' was
                provisional), and the next round's h' (its output at L - 1 + a). The forward is padded to the
                verify's layout, k + 1 tokens at positions L - 1 .. L - 1 + k whatever a is, so that its shape is
                fixed (one CUDA graph per batch size) and its layout needs no accepted length on the host; the
                padding rows (the verify's tokens and hidden states after the accepted ones) sit after the
                accepted rows, which attention (causal) and every other op (per token) keep exact, and they
                write only NextN KV past the accepted tokens, stale as below.

With topk > 1 a round drafts a tree of n = num_draft_tokens nodes, node 0 being x_{L-1} (`_draft_tree`):

  draft         the root's topk children from the logits of h', scored by log-probability. Then num_steps - 1
                expansions: the topk best nodes of the previous step's children (by cumulative log-probability)
                each get their topk children from one forward of the NextN layer. That forward runs in tree
                form over every node expanded so far (a forest of depth-1 roots, node of depth d at position
                L - 2 + d, seeing the prefix and its ancestors), so earlier depths are recomputed rather than kept:
                at most (num_steps - 1) * topk nodes, and no mask over KV the batch does not write. The n - 1
                best of all children (a child never scores above its parent, and a stable sort puts a parent
                first on ties, so every kept node's parent is kept) become the tree, in creation order.
  verify        one TARGET_VERIFY forward of the n nodes with the tree mask (`DraftTree`), node i in the slot of
                position L - 1 + i at position L - 1 + depth.
  accept        `verify_tree`: from the root, the child holding the target's argmax, as long as there is one;
                sampled requests try the children as candidates in turn, each kept with its share of the
                target's probability the rejected siblings leave (lossless: `_sample_tree_walks`).
  keep          the accepted nodes' target KV moves to the slots of positions L .. L - 1 + a, so the request's KV
                is in position order again; then draft extend as for chains, over the accepted nodes (padded
                with the last one).

KV a round writes past the accepted tokens is stale, never read: attention stops at a request's length and the next
round writes those positions again. A prefill (EXTEND) forward is followed by the NextN layer over the same
positions, each reading the token after it (after the prompt's last, the one just sampled). A prefix-cache hit
reuses the NextN layer's KV too; at a shared page's last position that KV read the token that followed in the
sequence that computed it. That costs acceptance at most: verification alone decides the output.

On a GPU the chains' draft DECODE steps, TARGET_VERIFY and DRAFT_EXTEND replay CUDA graphs (`graph_plans` in
`runtime/speculative_graphs.py`, which the runner captures at start-up for the decode batch sizes) when the decode
attention backends declare those modes; a tree's verify and draft forwards carry a per-round tree mask and run
eagerly. A round of greedy chains (every request greedy, without penalties) is one graph replay
(`greedy_round_forward`) when the decode
attention backends also plan on the device: draft steps, verify, greedy acceptance and draft extend, with one input
load, so that the host's time per round stays close to a decode step's. A batch past the largest graph runs
eagerly, with the same outputs.

Under tensor parallelism every rank has a SpeculativeWorker and runs every forward of a round. Rank 0's worker
sends the step's batch, inputs and kind (`rank_protocol.Step`: which of the paths above the round takes) before it
(`follow` runs it on the others); what rank 0 alone decides with its requests' state (tokens drawn with their
generators, acceptance under their penalties) goes to the others mid-step (`rank_protocol.from_leader`). Greedy
argmaxes (the round graph's drafts and acceptance, the first greedy draft, trees' top-k) are replicated instead:
every rank computes them from the same all-reduced, all-gathered logits (as every rank routes MoE tokens from the
same hidden states), and the round graph then needs no collective beyond the model's.

Under DP attention each rank's worker drafts and verifies its own DP group's requests (their KV and h' are on
the group's ranks), and rank 0 runs every group's step at once (`extend_groups`, `verify_groups`): a prefill step
for the groups with a prefill batch, then a round for those with a TARGET_VERIFY batch, each joined by every rank, a
group without such a batch on an IDLE one of no tokens, so that every rank runs the same forwards: the MLPs gather
every group's tokens (`ForwardBatch.dp_tokens`) and each LM head every group's rows (`GroupRows`). Rank 0 so sees every
group's logits and decides for every group's requests at once (drafts drawn, acceptance; trees' nodes are
gathered to it first), and `from_leader` carries every group's decision, each rank keeping its group's rows. Every
round's first draft is drawn from h' through that LM head (each rank's kept greedy token is its group's alone),
and the rounds run eagerly (`speculative_graphs.DP_EAGER`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from plugserve.core.distributed import SINGLE, ParallelGroup
from plugserve.core.forward_batch import DraftTree, ForwardBatch, ForwardMode
from plugserve.core.host_copy import to_device
from plugserve.core.interfaces import AttentionBackend
from plugserve.core.moved import moved_names
from plugserve.runtime import acceptance
from plugserve.runtime.cuda_graph_runner import CudaGraphRunner
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.rank_protocol import GroupRows, Header, Part, Step, from_leader, idle_part
from plugserve.runtime.sampling import SampleOutput, SamplingParams, draw, filtered_probs
from plugserve.runtime.server_args import ServerArgs, SpeculativeConfig, flag
from plugserve.runtime.speculative_graphs import DRAFT_EXTEND, DRAFT_STEP, ROUND, VERIFY, graph_plans

if TYPE_CHECKING:
    from plugserve.runtime.request import Request


def build_runner(args: ServerArgs, group: ParallelGroup = SINGLE, before_sizing: Callable[[], None] | None = None
                 ) -> ModelRunner:
    """This rank's ModelRunner, capturing the speculative round's forwards (`graph_plans`) when `args` asks for
    speculative decoding (checked first: `check_runner`); `before_sizing` as ModelRunner's."""
    spec = args.speculative
    runner = ModelRunner(args, group, graph_plans(spec, args.dp_attention_size) if spec is not None else None,
                         before_sizing=before_sizing)
    if spec is not None:
        check_runner(runner, spec)
    return runner


def follow(runner: ModelRunner) -> None:
    """Ranks 1..P-1: `runner.follow`, with a SpeculativeWorker for rank 0's speculative steps when speculating."""
    spec = runner.args.speculative
    runner.follow(None if spec is None else SpeculativeWorker(runner, spec).follow)


def check_runner(runner: ModelRunner, config: SpeculativeConfig) -> None:
    """Raises, naming the flag, when `runner` cannot draft as `config` asks (no NextN layer; trees without a
    tree-verifying decode backend): before any warm-up forward would reach the missing part."""
    if runner.model.nextn is None:
        raise ValueError(f"{flag('speculative_algorithm')} {config.algorithm}: the model has no NextN layer to "
                         f"draft with (the checkpoint lacks model.layers.{runner.config.num_hidden_layers}"
                         f".eh_proj): give one with {flag('speculative_draft_model_path')}")
    if config.topk > 1:
        for bucket in runner.backends.decode_buckets:
            if not bucket.backend.capabilities.tree_verify:
                raise ValueError(f"{flag('speculative_eagle_topk')} {config.topk}: draft trees need a decode "
                                 f"attention backend that declares tree_verify, and {bucket.backend.name} does "
                                 f"not (choose one that does with {flag('decode_attention_backend')}, e.g. "
                                 "torch_ref, or draft chains with topk 1)")


class Prefill(NamedTuple):
    """A DP group's prefill for `SpeculativeWorker.extend_groups`: input_ids [T] int64; next_ids [T] int64, the
    token after each (rows `sample_rows` [S] int64 are overwritten with the tokens sampled there); table_rows: the
    block-table rows of the S requests sampled; `sample` turns their logits [S, vocab] float32 into tokens."""

    batch: ForwardBatch
    input_ids: torch.Tensor
    next_ids: torch.Tensor
    sample_rows: torch.Tensor
    table_rows: Sequence[int]
    sample: Callable[[torch.Tensor], SampleOutput]


class Round(NamedTuple):
    """A DP group's TARGET_VERIFY batch for `SpeculativeWorker.verify_groups` (n = num_draft_tokens tokens per
    request): input_ids [B * n] int64 hold each request's last token at its first row (the drafts go in the
    others)."""

    batch: ForwardBatch
    input_ids: torch.Tensor
    requests: Sequence[Request]


class SpeculativeWorker:
    """Drafts with the NextN layer, verifies with the target, and keeps the draft's state per request (its KV in
    the pool's NextN layer, h' by block-table row). Under DP attention each rank's worker keeps its DP group's,
    and rank 0's decides for every group (module docstring)."""

    def __init__(self, runner: ModelRunner, config: SpeculativeConfig) -> None:
        check_runner(runner, config)
        self.runner, self.model, self.num_steps = runner, runner.model, config.num_steps
        self.topk, self.num_draft_tokens = config.topk, config.num_draft_tokens
        # h' [rows, hidden] in the model dtype: one row per block-table row, i.e. per request holding KV.
        self.hidden = torch.zeros(runner.block_table.num_rows, runner.config.hidden_size, dtype=runner.dtype,
                                  device=runner.device)
        # The greedy token of h' [rows] int64 (argmax of its logits): a greedy request's first draft of the next
        # round, computed where h' is (in the DRAFT_EXTEND graph), so that the round needs no lm head before it.
        self.first_draft = torch.zeros(runner.block_table.num_rows, dtype=torch.int64, device=runner.device)
        # Since start: requests verified (one per request and round), and the tokens those rounds produced.
        self.verify_steps = self.accepted_tokens = 0
        # How the step under way's rows split over the DP groups: set as it starts, alike on every rank.
        self.layout = GroupRows([0], 0, False)

    @property
    def accept_length(self) -> float | None:
        """Mean tokens a request gets from one verify (its accepted drafts and the target's token after them); None
        before the first."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else None

    @torch.inference_mode()
    def extend(self, batch: ForwardBatch, input_ids: torch.Tensor, next_ids: torch.Tensor, sample_rows: torch.Tensor,
               table_rows: Sequence[int], sample: Callable[[torch.Tensor], SampleOutput]) -> SampleOutput:
        """A prefill forward, then the NextN layer over its positions (the arguments as `Prefill` has them)."""
        (sampled,) = self.extend_groups([Prefill(batch, input_ids, next_ids, sample_rows, table_rows, sample)])
        assert sampled is not None
        return sampled

    @torch.inference_mode()
    def extend_groups(self, groups: Sequence[Prefill | None]) -> list[SampleOutput | None]:
        """`extend` of each DP group's prefill (None: the group idles through the step; one group without DP
        attention), every rank its group's: each group's sampled tokens (None for an idle one)."""
        parts = [None if g is None else Part(g.input_ids, g.batch, g.sample_rows,
                                             torch.cat([g.next_ids, self._rows(g.table_rows)])) for g in groups]
        headers = self._announce(parts, Step.SPEC_EXTEND)

        def sample(logits: torch.Tensor) -> list[SampleOutput | None]:
            return [None if g is None else g.sample(rows)
                    for g, rows in zip(groups, logits.split(self.layout.counts), strict=True)]

        sampled = self._extend(self._own(parts), headers, sample)
        assert sampled is not None
        return sampled

    def _extend(self, part: Part, headers: list[Header | None],
                sample: Callable[[torch.Tensor], list[SampleOutput | None]] | None) -> list[SampleOutput | None] | None:
        """`extend_groups` on every rank: this rank's group's `part` (its extra inputs: next ids [T], then the
        block-table rows [S] int64); `sample` None: another rank than 0, which gets rank 0's tokens."""
        self.layout = self._layout_of(headers, lambda h: h.num_sampled)
        assert part.extra is not None
        next_ids, rows = part.extra.split([part.input_ids.numel(), part.sample_rows.numel()])
        tokens_per_group = [0 if h is None else h.sizes[0] for h in headers]
        batch = dataclasses.replace(part.batch, dp_tokens=tokens_per_group if self.layout.dp else None)
        hidden, attention = self._target(part.input_ids, batch)
        logits = self._logits(hidden[part.sample_rows], 1)
        sampled = None if sample is None else sample(logits)
        (tokens,) = self._from_leader(
            None if sampled is None else [torch.cat([s.token_ids for s in sampled if s is not None])], [()])
        next_ids = next_ids.index_copy(0, part.sample_rows, tokens)
        self._keep(rows, self.model.forward_nextn(next_ids, hidden, batch, attention)[part.sample_rows])
        return sampled

    @torch.inference_mode()
    def follow(self, part: Part | None, headers: list[Header | None]) -> None:
        """Ranks 1..P-1: rank 0's speculative step (`rank_protocol.Step`) with the inputs it sent (None: this
        rank's DP group idles through it)."""
        own = self._idle() if part is None else part
        step = next(h.step for h in headers if h is not None)
        if step is Step.SPEC_EXTEND:
            self._extend(own, headers, None)
        else:
            self._round(step, own, headers, None, None)

    def _announce(self, parts: list[Part | None], step: Step) -> list[Header | None]:
        """Rank 0: every group's part of a speculative step to the other ranks; their headers."""
        headers = [Header.of(p, step) for p in parts]
        self.runner.announce(headers, parts)
        return headers

    def _layout_of(self, headers: list[Header | None], count: Callable[[Header], int]) -> GroupRows:
        """The step's `GroupRows`: `count` of each group's header (0 for an idle group)."""
        return GroupRows([0 if h is None else count(h) for h in headers], self.runner.dp_rank, self.runner.dp_size > 1)

    def _own(self, parts: Sequence[Part | None]) -> Part:
        """This rank's group's part of a step rank 0 runs (an idle one when it has none)."""
        part = parts[self.runner.dp_rank]
        return self._idle() if part is None else part

    def _idle(self) -> Part:
        """The part of a rank whose DP group idles through a speculative step: an IDLE batch of no requests, which
        runs every forward of the step on no tokens (joining their collectives) and keeps nothing."""
        idle = idle_part(self.runner.pool)
        return Part(idle.input_ids, idle.batch, idle.sample_rows, idle.input_ids)

    def _every_from_leader(self, tensors: Sequence[torch.Tensor] | None, shapes: Sequence[tuple[int, ...]]
                           ) -> list[torch.Tensor]:
        """Rank 0's int64 `tensors`, every group's rows [sum(counts), *shape] each, on every rank."""
        total = sum(self.layout.counts)
        return from_leader(self.runner.group, tensors, [(total, *s) for s in shapes], self.hidden.device)

    def _from_leader(self, tensors: Sequence[torch.Tensor] | None, shapes: Sequence[tuple[int, ...]]
                     ) -> list[torch.Tensor]:
        """`_every_from_leader`, this rank's group's rows of each."""
        return [self.layout.own(t) for t in self._every_from_leader(tensors, shapes)]

    @torch.inference_mode()
    def verify(self, batch: ForwardBatch, input_ids: torch.Tensor, requests: Sequence[Request],
               default_generator: torch.Generator | None) -> SampleOutput:
        """One round for the requests of a TARGET_VERIFY `batch` (the arguments as `Round` has them): draft,
        verify, accept, draft extend. Returns `verify_drafts`' output (`verify_tree`'s with topk > 1)."""
        (out,) = self.verify_groups([Round(batch, input_ids, requests)], default_generator)
        assert out is not None
        return out

    @torch.inference_mode()
    def verify_groups(self, groups: Sequence[Round | None], default_generator: torch.Generator | None
                      ) -> list[SampleOutput | None]:
        """`verify` of each DP group's batch (None: the group idles through the round; one group without DP
        attention), every rank drafting and verifying its group's requests and rank 0 accepting for all of them:
        each group's output (None for an idle one)."""
        requests = [r for g in groups if g is not None for r in g.requests]
        single = groups[0] if len(groups) == 1 else None
        if self.topk > 1:
            step = Step.SPEC_TREE
        elif single is None:  # DP attention: rank 0 draws every group's first draft from the gathered LM head
            step = Step.SPEC_CHAINS_SAMPLED
        elif self.runner.graphs.get(ROUND, single.batch) is not None and all(_plain_greedy(r.params) for r in requests):
            step = Step.SPEC_ROUND
        else:
            step = Step.SPEC_CHAINS_GREEDY if all(r.params.is_greedy for r in requests) else Step.SPEC_CHAINS_SAMPLED
        parts: list[Part | None] = [None] * len(groups)
        for i, group in enumerate(groups):
            if group is not None:
                rows = self._rows([r.table_row for r in group.requests])
                parts[i] = Part(group.input_ids, group.batch, rows[:0], rows)
        headers = self._announce(parts, step)
        out = self._round(step, self._own(parts), headers, requests, default_generator)
        assert out is not None and out.accept_lens is not None
        self.verify_steps += len(requests)
        self.accepted_tokens += len(requests) + int(out.accept_lens.sum())  # this waits for the round
        return [None if g is None else o for g, o in zip(groups, out.split(self.layout.counts), strict=True)]

    def _round(self, step: Step, part: Part, headers: list[Header | None], requests: Sequence[Request] | None,
               default_generator: torch.Generator | None) -> SampleOutput | None:
        """`verify_groups` on every rank along the path `step` names: this rank's group's `part` (its extra input:
        the block-table rows [B] int64); `requests` (every group's) None: another rank than 0, which gets what
        rank 0 decides and returns None."""
        self.layout = self._layout_of(headers, lambda h: len(h.seq_lens))
        batch, input_ids, rows = part.batch, part.input_ids, part.extra
        assert rows is not None
        b, n = batch.batch_size, self.num_draft_tokens
        if step is Step.SPEC_TREE:
            return self._verify_tree(batch, input_ids.view(b, n)[:, :1], requests, rows, default_generator)
        if step is Step.SPEC_ROUND:
            round_graph = self.runner.graphs.get(ROUND, batch)
            assert round_graph is not None, "every rank holds the same round graphs"
            return self._greedy_round(round_graph, batch, input_ids, requests, rows)
        drafts, draft_probs = self._draft(batch, requests, rows, default_generator,
                                          greedy=step is Step.SPEC_CHAINS_GREEDY)
        ids = torch.cat([input_ids.view(b, n)[:, :1], self.layout.own(drafts)], dim=1)
        hidden, logits = self._verify_chains(ids.view(-1), batch)
        out = None if requests is None else acceptance.verify_drafts(
            logits.view(len(requests), n, -1), drafts, draft_probs, [r.params for r in requests],
            [r.prompt_ids for r in requests], [r.penalty_ids for r in requests],
            [r.generator for r in requests], default_generator)
        tokens, accept_lens = self._from_leader(None if out is None else [out.token_ids, out.accept_lens], [(n,), ()])
        self._draft_extend(batch, hidden, tokens, accept_lens, rows)
        return out

    def _greedy_round(self, graph: CudaGraphRunner, batch: ForwardBatch, input_ids: torch.Tensor,
                      requests: Sequence[Request] | None, rows: torch.Tensor) -> SampleOutput | None:
        """`verify` of greedy chains in one replay of the round graph (`greedy_round_forward`); None without
        `requests` (on ranks 1..P-1)."""
        b, n = batch.batch_size, self.num_draft_tokens
        ids = input_ids.view(b, n).clone()
        ids[:, 1] = self.first_draft[rows]
        tokens, accept_lens, logits, drafted, greedy = graph.replay(ids.view(-1), batch, self.hidden[rows])
        self.hidden[rows] = drafted
        self.first_draft[rows] = greedy
        # The graph's outputs are rewritten by its next replay, which may come before the scheduler reads these.
        return None if requests is None else acceptance.with_logprobs(
            logits.view(b, n, -1), tokens.view(b, n).clone(), accept_lens.clone(), [r.params for r in requests])

    def _verify_chains(self, input_ids: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's TARGET_VERIFY forward of chains (input_ids [B * n] int64): hidden states [B * n, H] and
        logits [B * n, sample_vocab] float32 (every group's rows under DP attention), from its CUDA graph when one
        holds the batch."""
        graph = self.runner.graphs.get(VERIFY, batch)
        if graph is not None:
            logits, hidden = graph.replay(input_ids, batch)
            return hidden, logits[:, : self.runner.sample_vocab]
        n = self.num_draft_tokens
        hidden, _ = self._target(input_ids, self._step_batch(batch, n))
        return hidden, self._logits(hidden, n)

    def _verify_tree(self, batch: ForwardBatch, roots: torch.Tensor, requests: Sequence[Request] | None,
                     rows: torch.Tensor, default_generator: torch.Generator | None) -> SampleOutput | None:
        """`verify` with draft trees; roots [B, 1] int64: each request's last token. Rank 0 accepts for every
        group: their trees are gathered to it."""
        drafts, parents = self._draft_tree(batch, rows)
        tokens = torch.cat([roots, drafts], dim=1)
        b, n = tokens.shape
        hidden, _ = self._target(tokens.view(-1), self._step_batch(self._with_tree(batch, parents), n))
        logits = self._logits(hidden, n)
        trees = self.layout.gather(self.runner.model.rows, torch.cat([tokens, parents], dim=1))  # every group's
        every_tokens, every_parents = trees.split([n, n], dim=1)
        out, path = (None, None) if requests is None else acceptance.verify_tree(
            logits.view(len(requests), n, -1), every_tokens, every_parents, [r.params for r in requests],
            [r.prompt_ids for r in requests], [r.penalty_ids for r in requests],
            [r.generator for r in requests], default_generator)
        accepted, accept_lens, path = self._from_leader(
            None if out is None else [out.token_ids, out.accept_lens, path], [(n,), (), (n,)])
        slots = batch.out_cache_loc.view(b, n)
        batch.kv_pool.copy_slots(slots.gather(1, path[:, 1:]).view(-1), slots[:, 1:].reshape(-1),
                                 range(len(self.model.layers)))
        width = hidden.shape[-1]
        picked = hidden.view(b, n, width).gather(1, path[:, :, None].expand(b, n, width))
        self._draft_extend(batch, picked.view(b * n, width), accepted, accept_lens, rows)
        return out

    def _draft_tree(self, verify: ForwardBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft trees of the requests of `verify` (`rows` [B] int64: their block-table rows), EAGLE-2 style
        (see the module docstring): drafts [B, n - 1] int64, the tokens of nodes 1 .. n - 1, and parents [B, n]
        int64 as `DraftTree` takes them."""
        b, k, n = verify.batch_size, self.topk, self.num_draft_tokens
        device = rows.device
        hidden = self.hidden[rows]
        width = hidden.shape[-1]
        # Every child drafted (candidate), in creation order: score (cumulative log-probability), token, and the
        # candidate index of its parent (-1: the root).
        scores, tokens = torch.log_softmax(self._own_logits(hidden, 1), dim=-1).topk(k, dim=-1)
        cand_scores, cand_tokens = [scores], [tokens]
        cand_parents = [torch.full((b, k), -1, dtype=torch.int64, device=device)]
        # The nodes the next step expands: candidate index, score, token, the hidden state it reads (its parent's
        # NextN output) and its parent's index in the NextN layer's forest (-1: a root).
        frontier = torch.arange(k, device=device).expand(b, k)
        front_scores, front_tokens, front_hidden = scores, tokens, hidden[:, None].expand(b, k, width)
        front_parents = torch.full((b, k), -1, dtype=torch.int64, device=device)
        forest_tokens: list[torch.Tensor] = []
        forest_hidden: list[torch.Tensor] = []
        forest_parents: list[torch.Tensor] = []
        for step in range(1, self.num_steps):
            forest_tokens.append(front_tokens)
            forest_hidden.append(front_hidden)
            forest_parents.append(front_parents)
            m = step * k
            batch = verify if not b else ForwardBatch.build(
                ForwardMode.TARGET_VERIFY, [p + m for p in verify.prefix_lens_cpu], [m] * b, verify.block_table,
                verify.kv_pool)
            batch = self._with_tree(batch, torch.cat(forest_parents, dim=1))
            out = self._nextn(torch.cat(forest_tokens, dim=1).view(-1),
                              torch.cat(forest_hidden, dim=1).view(b * m, width), batch, m).view(b, m, width)[:, -k:]
            logits = self._own_logits(out.reshape(b * k, width), k)
            logprobs = torch.log_softmax(logits, dim=-1).view(b, k, logits.shape[-1])
            child_scores, child_tokens = logprobs.topk(k, dim=-1)  # [B, k (parent), k]
            child_scores = (front_scores[:, :, None] + child_scores).view(b, k * k)
            child_tokens = child_tokens.view(b, k * k)
            offset = k + (step - 1) * k * k
            cand_scores.append(child_scores)
            cand_tokens.append(child_tokens)
            cand_parents.append(frontier[:, :, None].expand(b, k, k).reshape(b, k * k))
            front_scores, best = child_scores.topk(k, dim=-1)
            parent = best // k  # the expanded node (of this step's k) each new frontier node hangs from
            frontier, front_tokens = offset + best, child_tokens.gather(1, best)
            front_hidden = out.gather(1, parent[:, :, None].expand(b, k, width))
            front_parents = (step - 1) * k + parent
        all_scores, all_parents = torch.cat(cand_scores, dim=1), torch.cat(cand_parents, dim=1)
        kept = all_scores.sort(dim=1, descending=True, stable=True).indices[:, : n - 1].sort(dim=1).values
        node_of = torch.zeros_like(all_parents).scatter_(1, kept, torch.arange(1, n, device=device).expand(b, n - 1))
        kept_parents = all_parents.gather(1, kept)
        parents = torch.where(kept_parents < 0, 0, node_of.gather(1, kept_parents.clamp_min(0)))
        root = torch.full((b, 1), -1, dtype=torch.int64, device=device)
        return torch.cat(cand_tokens, dim=1).gather(1, kept), torch.cat([root, parents], dim=1)

    def _draft(self, verify: ForwardBatch, requests: Sequence[Request] | None, rows: torch.Tensor,
               default_generator: torch.Generator | None, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The k drafts of each request of every group of the round, this rank's group's those of `verify` (`rows`
        [B] int64: their block-table rows; `greedy`: every request is, and there is one group): [R, k] int64, R
        every group's requests in group order (this rank's group's rows: `GroupRows.own`), and the distributions
        they were drawn from, [R, k, vocab] float32 (None when every request is greedy, and on ranks 1..P-1, which
        pass no `requests` and get rank 0's drafts)."""
        k = self.num_steps
        hidden = self.hidden[rows]
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for step in range(k):
            if step:
                # Step j = step + 1 sits at position L - 3 + j, the verify's token j - 2 (it starts at L - 1).
                hidden, logits = self._draft_step(self.layout.own(tokens[-1]), hidden,
                                                  verify.token_as_decode(step - 1))
            elif greedy:
                tokens.append(self.first_draft[rows])
                continue
            else:
                logits = self._logits(hidden, 1)
            token, q = (None, None) if requests is None else _draft_tokens(
                logits, [r.params for r in requests], [r.generator for r in requests], default_generator)
            tokens.append(self._every_from_leader(None if token is None else [token], [()])[0])
            if q is not None:
                probs.append(q)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None

    def _draft_extend(self, verify: ForwardBatch, hidden: torch.Tensor, tokens: torch.Tensor,
                      accept_lens: torch.Tensor, rows: torch.Tensor) -> None:
        """The NextN layer over each request's accepted tokens, padded to the verify's n per request (module
        docstring): tokens [B, n] int64 (request b's first accept_lens[b] + 1, accept_lens [B] int64), hidden
        [B * n, H] the target's at them (its hidden states of the verify, along the accepted path for trees),
        `verify` the chain-shaped TARGET_VERIFY batch. Keeps h'."""
        b, n = verify.batch_size, self.num_draft_tokens
        batch = dataclasses.replace(verify, mode=ForwardMode.DRAFT_EXTEND)
        # Row of each request's h': its last accepted token's.
        last = torch.arange(0, b * n, n, device=hidden.device) + accept_lens
        graph = self.runner.graphs.get(DRAFT_EXTEND, batch)
        if graph is not None:
            greedy, drafted = graph.replay(tokens.view(-1), batch, hidden)
            self._keep(rows, drafted[last], greedy[last])
        else:
            self._keep(rows, self._nextn(tokens.view(-1), hidden, batch, n)[last])

    def _keep(self, rows: torch.Tensor, drafted: torch.Tensor, greedy: torch.Tensor | None = None) -> None:
        """h' [B, H] of the requests at block-table rows [B] int64, and its greedy token [B] int64 (the argmax of its
        logits, computed here unless given; not under DP attention, whose rounds draw first drafts from h')."""
        self.hidden[rows] = drafted
        if greedy is not None:
            self.first_draft[rows] = greedy
        elif not self.layout.dp:
            self.first_draft[rows] = self._logits(drafted, 1).argmax(dim=-1)

    def _step_batch(self, batch: ForwardBatch, per: int) -> ForwardBatch:
        """`batch` as a forward of the step runs it: under DP attention with every group's token count (`per` per
        counted row of the step), and IDLE when this rank's group has no requests in it."""
        if not self.layout.dp:
            return batch
        return dataclasses.replace(batch, mode=batch.mode if batch.batch_size else ForwardMode.IDLE,
                                   dp_tokens=self.layout.times(per))

    def _with_tree(self, batch: ForwardBatch, parents: torch.Tensor) -> ForwardBatch:
        """`batch` with the draft trees of `parents` [B, m] int64 (an idle group's empty batch as it is)."""
        return batch.with_tree(DraftTree.of(parents)) if batch.batch_size else batch

    def _target(self, input_ids: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, AttentionBackend | None]:
        """The target's final hidden states [T, hidden] (normed, what the NextN layer reads), and the backend
        planned for `batch` (None for an IDLE one)."""
        attention = None
        if batch.mode is not ForwardMode.IDLE:
            attention = self.runner.backends.attention(batch)
            attention.plan(batch)
        return self.model(input_ids, batch, attention), attention

    def _draft_step(self, tokens: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft DECODE step of the NextN layer: tokens [B] int64 and hidden [B, H] -> its output [B, H] and
        logits [B, sample_vocab] float32 (every group's rows under DP attention), from its CUDA graph when one
        holds the batch."""
        graph = self.runner.graphs.get(DRAFT_STEP, batch)
        if graph is not None:
            logits, out = graph.replay(tokens, batch, hidden)
            return out, logits[:, : self.runner.sample_vocab]
        out = self._nextn(tokens, hidden, batch, 1)
        return out, self._logits(out, 1)

    def _nextn(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, per: int) -> torch.Tensor:
        """The NextN layer: next_ids [T] int64 and hidden [T, H] -> [T, H] (`per` tokens per counted row of the
        step), from its CUDA graph when one holds the batch (the graph's last output is its hidden states)."""
        graph = self.runner.graphs.get(DRAFT_STEP if batch.mode is ForwardMode.DECODE else DRAFT_EXTEND, batch)
        if graph is not None:
            return graph.replay(next_ids, batch, hidden)[-1]
        batch = self._step_batch(batch, per)
        attention = None
        if batch.mode is not ForwardMode.IDLE:
            self.runner.prepare(batch)
            attention = self.runner.backends.attention(batch)
            attention.plan(batch)
        return self.model.forward_nextn(next_ids, hidden, batch, attention)

    def _logits(self, hidden: torch.Tensor, per: int) -> torch.Tensor:
        """hidden [m, H] -> logits [m, sample_vocab] float32; under DP attention every group's rows in group order
        (each group's m: `per` per counted row of the step), as the LM head gathers them."""
        return self.model.compute_logits(hidden, self.layout.times(per))[:, : self.runner.sample_vocab]

    def _own_logits(self, hidden: torch.Tensor, per: int) -> torch.Tensor:
        """`_logits`, this rank's group's rows alone."""
        return self.layout.own(self._logits(hidden, per), per)

    def _rows(self, table_rows: Sequence[int]) -> torch.Tensor:
        return to_device(torch.tensor(table_rows, dtype=torch.int64), self.hidden.device)


def _plain_greedy(params: SamplingParams) -> bool:
    """Whether a request's tokens are the target's argmax as `verify_drafts` picks them with no host input."""
    return params.is_greedy and params.repetition_penalty == 1 and not params.frequency_penalty \
        and not params.presence_penalty


def _draft_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  default_generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per request from the draft's logits [B, V] float32: greedy requests its argmax, sampled
    ones a draw from q, its distribution under their temperature and filters. Returns [B] int64 and q [B, V]
    float32 normalized (None when every request is greedy; greedy rows of it are unused)."""
    tokens = logits.argmax(dim=-1)
    if all(p.is_greedy for p in params):
        return tokens, None
    q = filtered_probs(logits, params)
    q = q / q.sum(dim=-1, keepdim=True)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    index = to_device(torch.tensor(rows), logits.device)
    drawn = draw(q[index], [generators[i] for i in rows], default_generator)
    return tokens.index_copy(0, index, drawn), q


__getattr__ = moved_names(__name__)
