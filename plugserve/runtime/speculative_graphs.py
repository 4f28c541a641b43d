"""The CUDA graphs of a speculative round (`runtime/speculative.py`): the plans the runner captures
(`graph_plans`), their labels, and a round of greedy chains as one forward (`greedy_round_forward`).

Under DP attention a round runs eagerly: every group's draft and verify forwards gather the other groups' tokens
at the step's sizes, which a graph would fix per group and per rank alike (`replay_dp` does so for plain DECODE);
`CudaGraphs.status` says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.interfaces import AttentionBackend
from plugserve.runtime.cuda_graph_runner import GraphForward, GraphPlan, GraphPlans
from plugserve.runtime.server_args import SpeculativeConfig

if TYPE_CHECKING:
    from plugserve.core.models.deepseek import DeepseekForCausalLM

# Labels of the speculative forwards captured in CUDA graphs (`graph_plans`).
VERIFY, DRAFT_STEP, DRAFT_EXTEND, ROUND = "TARGET_VERIFY", "draft DECODE", "DRAFT_EXTEND", "greedy round"


# Why no speculative forward is captured under DP attention (`CudaGraphs.status`).
DP_EAGER = ("speculative rounds run eagerly under DP attention: no graph holds a round's forwards over every DP "
            "group's tokens yet")


def graph_plans(config: SpeculativeConfig, dp_size: int = 1) -> GraphPlans:
    """The forwards a speculative round replays from CUDA graphs, for the runner to capture: the target's
    TARGET_VERIFY (logits to verify, hidden states for the draft extend), the NextN layer's draft DECODE steps
    (logits to draft from, hidden states for the next step) and its DRAFT_EXTEND padded to num_draft_tokens
    (hidden states: h', and the greedy tokens: the next round's first greedy draft), and for chains the greedy
    round, all of them in one graph. Draft trees verify and draft in tree form, eagerly, and share DRAFT_EXTEND
    with chains. Under DP attention (`dp_size` > 1) none: the round runs eagerly (module docstring)."""
    if dp_size > 1:
        return GraphPlans([], (DP_EAGER,))
    n = config.num_draft_tokens
    extend = GraphPlan.of_model(DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND, n, nextn=True, logits=False, greedy=True,
                                hidden=True)
    if config.topk > 1:
        return GraphPlans([extend], ("draft trees verify and draft eagerly: no attention backend runs tree attention "
                                     "under CUDA graphs",))
    num_steps = config.num_steps
    return GraphPlans([
        GraphPlan.of_model(VERIFY, ForwardMode.TARGET_VERIFY, n, hidden=True),
        GraphPlan.of_model(DRAFT_STEP, ForwardMode.DECODE, 1, nextn=True, hidden=True),
        extend,
        GraphPlan(ROUND, ForwardMode.TARGET_VERIFY, n,
                  lambda model, sample_vocab: greedy_round_forward(model, num_steps, sample_vocab, plan_in_graph),
                  reads_hidden=True, hidden=True,
                  modes=(ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND), plans_inside=True),
    ])


def plan_in_graph(attention: AttentionBackend, batch: ForwardBatch) -> None:
    """How the round's graph plans each of its forwards' attention: recorded in the capture
    (`graph_plan_on_device`)."""
    attention.plan_capture(batch)


def greedy_round_forward(model: DeepseekForCausalLM, num_steps: int, sample_vocab: int,
                         plan: Callable[[AttentionBackend, ForwardBatch], None]) -> GraphForward:
    """A round of greedy chains as one forward, for the round graph: the k - 1 draft DECODE steps, the
    TARGET_VERIFY, greedy acceptance and the padded DRAFT_EXTEND of `SpeculativeWorker.verify`, planning attention
    for each sub-batch with `plan` (plan_capture in a graph: the backend must plan on the device). It takes the
    TARGET_VERIFY batch of B requests of n = num_steps + 1 tokens, input_ids [B * n] int64 (each request's last
    token, then its first draft d_1; the rest is unread) and hidden [>= B, H], h' of each request in its first B
    rows. Outputs: the target's greedy tokens [B * n] int64 (request b's first accept_lens[b] + 1 are its round's),
    accept_lens [B] int64, the verify's logits [B * n, sample_vocab] float32, and the next round's h' [B, H] and its
    greedy token [B] int64."""

    def forward(input_ids: torch.Tensor, hidden: torch.Tensor | None, batch: ForwardBatch,
                attention: AttentionBackend) -> tuple[torch.Tensor, ...]:
        assert hidden is not None
        b = batch.batch_size
        n = num_steps + 1
        first = input_ids.view(b, n)
        drafts, state = [first[:, 1]], hidden[:b]
        for step in range(1, num_steps):
            decode = batch.token_as_decode(step - 1)  # step j = step + 1 at the verify's token j - 2
            plan(attention, decode)
            state = model.forward_nextn(drafts[-1], state, decode, attention)
            drafts.append(model.compute_logits(state)[:, :sample_vocab].argmax(dim=-1))
        drafted = torch.stack(drafts, dim=1)
        plan(attention, batch)
        target_hidden = model(torch.cat([first[:, :1], drafted], dim=1).view(-1), batch, attention)
        logits = model.compute_logits(target_hidden)[:, :sample_vocab]
        target = logits.argmax(dim=-1).view(b, n)
        accept_lens = (drafted == target[:, :num_steps]).long().cumprod(dim=1).sum(dim=1)
        extend = dataclasses.replace(batch, mode=ForwardMode.DRAFT_EXTEND)
        plan(attention, extend)
        out = model.forward_nextn(target.view(-1), target_hidden, extend, attention)
        kept = out[torch.arange(0, b * n, n, device=out.device) + accept_lens]
        return (target.view(-1), accept_lens, logits, kept,
                model.compute_logits(kept)[:, :sample_vocab].argmax(dim=-1))

    return forward
