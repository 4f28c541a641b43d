"""Speculative decoding with the target's own NextN (MTP) layer as the draft: chains (EAGLE with topk 1).

A running request's tokens are x_0 .. x_{L-1}. The target's KV holds positions 0 .. L - 2 (as without
speculation), and so does the NextN layer's (position i read x_{i+1} and the target's final normed hidden state
at i, as the checkpoints' MTP layer was trained); `SpeculativeWorker.hidden` keeps the NextN layer's output h' at
L - 2, which predicts x_L. One round of k steps:

  draft         d_1 from the logits of h'; then k - 1 DECODE forwards of the NextN layer, step j at position
                L - 3 + j reading d_{j-1} and its own previous output (the NextN output at position i stands for
                the target's hidden state at i + 1, as both predict token i + 2) -> d_j.
  verify        one TARGET_VERIFY forward of x_{L-1}, d_1 .. d_k at positions L - 1 .. L - 1 + k.
  accept        `verify_drafts`: d_1 .. d_a and the target's token after them, a + 1 tokens (1 .. k + 1).
  draft extend  one DRAFT_EXTEND forward of the NextN layer at positions L - 1 .. L - 1 + a, reading the accepted
                tokens and the target's hidden states of the verify: its KV there (the draft steps' was
                provisional), and the next round's h'.

KV a round writes past the accepted tokens is stale, never read: attention stops at a request's length and the next
round writes those positions again. A prefill (EXTEND) forward is followed by the NextN layer over the same
positions, each reading the token after it (after the prompt's last, the one just sampled). A prefix-cache hit
reuses the NextN layer's KV too; at a shared page's last position that KV read the token that followed in the
sequence that computed it. That costs acceptance at most: verification alone decides the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from plugserve.core.block_table import to_device
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.interfaces import AttentionBackend
from plugserve.core.sampling import SampleOutput, SamplingParams, apply_penalties, draw, filtered_probs, row_noise
from plugserve.core.server_args import SpeculativeConfig, flag

if TYPE_CHECKING:
    from plugserve.core.model_runner import ModelRunner
    from plugserve.core.request import Request


class SpeculativeWorker:
    """Drafts with the NextN layer, verifies with the target, and keeps the draft's state per request (its KV in
    the pool's NextN layer, h' by block-table row)."""

    def __init__(self, runner: ModelRunner, config: SpeculativeConfig) -> None:
        if runner.model.nextn is None:
            raise ValueError(f"{flag('speculative_algorithm')} {config.algorithm}: the model has no NextN layer to "
                             f"draft with (the checkpoint lacks model.layers.{runner.config.num_hidden_layers}"
                             ".eh_proj), and a separate draft model is not supported yet")
        self.runner, self.model, self.num_steps = runner, runner.model, config.num_steps
        # h' [rows, hidden] in the model dtype: one row per block-table row, i.e. per request holding KV.
        self.hidden = torch.zeros(runner.block_table.num_rows, runner.config.hidden_size, dtype=runner.dtype,
                                  device=runner.device)
        # Since start: requests verified (one per request and round), and the tokens those rounds produced.
        self.verify_steps = self.accepted_tokens = 0

    @property
    def accept_length(self) -> float | None:
        """Mean tokens a request gets from one verify (its accepted drafts and the target's token after them); None
        before the first."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else None

    @torch.inference_mode()
    def extend(self, batch: ForwardBatch, input_ids: torch.Tensor, next_ids: torch.Tensor, sample_rows: torch.Tensor,
               table_rows: Sequence[int], sample: Callable[[torch.Tensor], SampleOutput]) -> SampleOutput:
        """A prefill forward, then the NextN layer over its positions.

        input_ids [T] int64; next_ids [T] int64, the token after each (rows `sample_rows` [S] int64 are overwritten
        with the tokens sampled there); table_rows: the block-table rows of the S requests sampled; `sample` turns
        their logits [S, vocab] float32 into tokens."""
        hidden, attention = self._target(input_ids, batch)
        sampled = sample(self._logits(hidden[sample_rows]))
        next_ids = next_ids.index_copy(0, sample_rows, sampled.token_ids)
        drafted = self.model.forward_nextn(next_ids, hidden, batch, attention)
        self.hidden[self._rows(table_rows)] = drafted[sample_rows]
        return sampled

    @torch.inference_mode()
    def verify(self, batch: ForwardBatch, input_ids: torch.Tensor, requests: Sequence[Request],
               default_generator: torch.Generator | None) -> SampleOutput:
        """One round for the requests of a TARGET_VERIFY `batch` (k + 1 tokens each): draft, verify, accept, draft
        extend. input_ids [B * (k + 1)] int64 hold each request's last token at its first row (the drafts go in
        the others). Returns `verify_drafts`' output."""
        b, n = batch.batch_size, self.num_steps + 1
        rows = self._rows([r.table_row for r in requests])
        drafts, draft_probs = self._draft(batch, requests, rows, default_generator)
        ids = torch.cat([input_ids.view(b, n)[:, :1], drafts], dim=1)
        hidden, _ = self._target(ids.view(-1), batch)
        out = verify_drafts(self._logits(hidden).view(b, n, -1), drafts, draft_probs, [r.params for r in requests],
                            [r.prompt_ids for r in requests], [r.output_ids[: r.num_resolved] for r in requests],
                            [r.generator for r in requests], default_generator)
        self._draft_extend(batch, hidden, out, rows)
        return out

    def _draft(self, verify: ForwardBatch, requests: Sequence[Request], rows: torch.Tensor,
               default_generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The k drafts of each request of `verify` (`rows` [B] int64: their block-table rows): [B, k] int64, and
        the distributions they were drawn from, [B, k, vocab] float32 (None when every request is greedy)."""
        k = self.num_steps
        params, generators = [r.params for r in requests], [r.generator for r in requests]
        hidden = self.hidden[rows]
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for step in range(k):
            if step:
                # Step j = step + 1 sits at position L - 3 + j of a request whose verify ends at L - 1 + k.
                seq_lens = [s - k - 1 + step for s in verify.seq_lens_cpu]
                batch = ForwardBatch.build(ForwardMode.DECODE, seq_lens, [1] * len(seq_lens), verify.block_table,
                                           verify.kv_pool)
                hidden = self._nextn(tokens[-1], hidden, batch)
            token, q = _draft_tokens(self._logits(hidden), params, generators, default_generator)
            tokens.append(token)
            if q is not None:
                probs.append(q)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None

    def _draft_extend(self, verify: ForwardBatch, hidden: torch.Tensor, out: SampleOutput, rows: torch.Tensor) -> None:
        """The NextN layer over each request's accepted tokens (hidden [B * (k + 1), H]: the verify's); keeps h'."""
        n = self.num_steps + 1
        assert out.accept_lens is not None
        lens = [a + 1 for a in out.accept_lens.tolist()]  # the batch's layout needs them on the host
        self.verify_steps += len(lens)
        self.accepted_tokens += sum(lens)
        seq_lens = [s - n + m for s, m in zip(verify.seq_lens_cpu, lens, strict=True)]
        batch = ForwardBatch.build(ForwardMode.DRAFT_EXTEND, seq_lens, lens, verify.block_table, verify.kv_pool)
        picked = to_device(torch.tensor([i * n + j for i, m in enumerate(lens) for j in range(m)]), hidden.device)
        drafted = self._nextn(out.token_ids.view(-1)[picked], hidden[picked], batch)
        self.hidden[rows] = drafted[batch.cu_extend_lens[1:].long() - 1]

    def _target(self, input_ids: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, AttentionBackend]:
        """The target's final hidden states [T, hidden] (normed, what the NextN layer reads), and the backend
        planned for `batch`."""
        attention = self.runner.attention_for(batch)
        attention.plan(batch)
        return self.model(input_ids, batch, attention), attention

    def _nextn(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        self.runner.prepare(batch)
        attention = self.runner.attention_for(batch)
        attention.plan(batch)
        return self.model.forward_nextn(next_ids, hidden, batch, attention)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, sample_vocab] float32."""
        return self.model.compute_logits(hidden)[:, : self.runner.sample_vocab]

    def _rows(self, table_rows: Sequence[int]) -> torch.Tensor:
        return to_device(torch.tensor(table_rows, dtype=torch.int64), self.hidden.device)


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


def verify_drafts(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                  params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]],
                  generators: list[torch.Generator | None], default_generator: torch.Generator | None
                  ) -> SampleOutput:
    """Which drafts the target accepts, and its token after them.

    logits [B, k + 1, V] float32: the target's at x_{L-1}, d_1 .. d_k; drafts [B, k] int64; draft_probs
    [B, k, V] float32, the normalized distributions the sampled requests' drafts were drawn from (None when all
    are greedy). prompt_ids / output_ids / generators as `sample` takes them.

    Greedy requests accept the longest run of drafts equal to the target's argmax, then take its argmax after
    them. Sampled ones accept d_j with probability min(1, p(d_j) / q(d_j)) in turn (p: the target's distribution
    before d_j under the request's temperature and filters, q the draft's); the first rejected one is replaced
    by a draw from max(p - q, 0) renormalized, and when all are accepted a bonus token is drawn from p after
    d_k: each token is distributed as the target's own sampling would draw it. Penalties count the drafts
    before a position as generated tokens.

    Returns token_ids [B, k + 1] (request b's tokens are its first accept_lens[b] + 1), accept_lens [B], and the
    logprobs `sample` would report at each position.
    """
    b, n, vocab = logits.shape
    k, device = n - 1, logits.device
    if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
        host = drafts.tolist()
        logits = apply_penalties(logits.reshape(b * n, vocab), [p for p in params for _ in range(n)],
                                 [ids for ids in prompt_ids for _ in range(n)],
                                 [out + host[i][:j] for i, out in enumerate(output_ids) for j in range(n)]
                                 ).view(b, n, vocab)
    target = logits.argmax(dim=-1)  # [B, k + 1]
    accept_lens = (drafts == target[:, :k]).long().cumprod(dim=1).sum(dim=1)
    bonus = target.gather(1, accept_lens[:, None]).squeeze(1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        assert draft_probs is not None, "sampled requests need the distributions their drafts were drawn from"
        index = to_device(torch.tensor(rows), device)
        picked = [params[i] for i in rows]
        row_generators = [generators[i] for i in rows]
        p = filtered_probs(logits[index].reshape(-1, vocab), [x for x in picked for _ in range(n)]).view(-1, n, vocab)
        p = p / p.sum(dim=-1, keepdim=True)
        q = torch.cat([draft_probs[index], torch.zeros_like(p[:, :1])], dim=1)  # no draft after d_k: [R, k + 1, V]
        d = drafts[index][:, :, None]
        u = row_noise((len(rows), k), row_generators, default_generator, device, exponential=False)
        accepted = u * q[:, :k].gather(2, d).squeeze(2) < p[:, :k].gather(2, d).squeeze(2)
        lens = accepted.long().cumprod(dim=1).sum(dim=1)
        at = lens[:, None, None].expand(-1, 1, vocab)
        p_at, q_at = p.gather(1, at).squeeze(1), q.gather(1, at).squeeze(1)
        residual = (p_at - q_at).clamp_min(0)
        # All zero only when p <= q everywhere, i.e. p = q, where nothing is rejected: rounding's corner.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_at)
        accept_lens = accept_lens.index_copy(0, index, lens)
        bonus = bonus.index_copy(0, index, draw(residual, row_generators, default_generator))
    tokens = torch.cat([drafts, bonus[:, None]], dim=1).scatter(1, accept_lens[:, None], bonus[:, None])

    want_logprobs, top = any(x.logprobs for x in params), max(x.top_logprobs for x in params)
    logprobs = top_values = top_ids = None
    if want_logprobs or top:
        all_logprobs = torch.log_softmax(logits, dim=-1)
        if want_logprobs:
            logprobs = all_logprobs.gather(2, tokens[:, :, None]).squeeze(2)
        if top:
            top_values, top_ids = all_logprobs.topk(top, dim=-1)
    return SampleOutput(tokens, logprobs, top_ids, top_values, accept_lens)
