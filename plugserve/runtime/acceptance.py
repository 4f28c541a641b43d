"""Acceptance of speculative drafts: which drafted tokens the target keeps, greedy or by rejection sampling
(lossless: the output keeps the target's distribution), for chains and for EAGLE-2 trees."""

from __future__ import annotations

import torch

from plugserve.core.host_copy import to_device
from plugserve.runtime.sampling import SampleOutput, SamplingParams, apply_penalties, draw, filtered_probs, row_noise


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
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:  # the accepted drafts are the target's argmax, and so is the token after them
        return with_logprobs(logits, target, accept_lens, params)
    bonus = target.gather(1, accept_lens[:, None]).squeeze(1)
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
    return with_logprobs(logits, tokens, accept_lens, params)


def verify_tree(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, params: list[SamplingParams],
                prompt_ids: list[list[int]], output_ids: list[list[int]],
                generators: list[torch.Generator | None] | None = None,
                default_generator: torch.Generator | None = None) -> tuple[SampleOutput, torch.Tensor]:
    """Which path of each request's draft tree the target accepts, and its token after it.

    logits [B, n, V] float32: the target's at every node; tokens [B, n] int64, node 0 the request's last token;
    parents [B, n] int64 as `DraftTree` takes them (siblings hold different tokens). prompt_ids / output_ids /
    generators as `sample` takes them (generators None: every request's is None); penalties count a node's
    ancestors (the root excepted) as generated tokens.

    Greedy requests: from the root, the walk moves to the child holding the target's argmax at the current node
    while there is one; the target's argmax at the last node follows. Sampled requests (`_sample_tree_walks`):
    the children are candidates tried in turn, each kept with its probability under what the target's
    distribution at the node leaves after the rejected ones, so that every token is distributed as the target's
    own sampling would draw it. Returns the SampleOutput of `verify_drafts` (token_ids [B, n]) and path [B, n]
    int64: the nodes the tokens were taken at, the root first, the last repeated past the accepted ones.
    """
    b, n, vocab = logits.shape
    if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
        host_tokens, host_parents = tokens.tolist(), parents.tolist()

        def before(row: int, node: int) -> list[int]:
            """The tokens of node's ancestors below the root, and its own, in order."""
            path = []
            while node > 0:
                path.append(host_tokens[row][node])
                node = host_parents[row][node]
            return path[::-1]

        logits = apply_penalties(logits.reshape(b * n, vocab), [p for p in params for _ in range(n)],
                                 [ids for ids in prompt_ids for _ in range(n)],
                                 [out + before(i, j) for i, out in enumerate(output_ids) for j in range(n)]
                                 ).view(b, n, vocab)
    target = logits.argmax(dim=-1)  # [B, n]
    nodes = torch.arange(n, device=logits.device)
    # next_node[b, i]: the child of node i holding the target's token there, -1 when none does.
    hit = (parents[:, None, :] == nodes[None, :, None]) & (tokens[:, None, :] == target[:, :, None])
    next_node = torch.where(hit.any(dim=-1), hit.long().argmax(dim=-1), -1)
    steps = [torch.zeros(b, dtype=torch.int64, device=logits.device)]
    for _ in range(n - 1):  # no path is longer than the tree's n - 1 drafts
        child = next_node.gather(1, steps[-1][:, None]).squeeze(1)
        steps.append(torch.where(child >= 0, child, steps[-1]))
    path = torch.stack(steps, dim=1)
    accept_lens = (path[:, 1:] != path[:, :-1]).sum(dim=1)
    bonus = target.gather(1, path.gather(1, accept_lens[:, None])).squeeze(1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        index = to_device(torch.tensor(rows), logits.device)
        walks = _sample_tree_walks(logits[index], tokens[index], parents[index], [params[i] for i in rows],
                                   [generators[i] if generators else None for i in rows], default_generator)
        path, accept_lens, bonus = (x.index_copy(0, index, y) for x, y in zip((path, accept_lens, bonus), walks,
                                                                              strict=True))
    out = torch.cat([tokens.gather(1, path[:, 1:]), bonus[:, None]], dim=1).scatter(1, accept_lens[:, None],
                                                                                     bonus[:, None])
    path_logits = logits.gather(1, path[:, :, None].expand(b, n, vocab))
    return with_logprobs(path_logits, out, accept_lens, params), path


def _sample_tree_walks(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None], default_generator: torch.Generator | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_tree` for sampled requests: logits [R, n, V] float32 (penalties applied), tokens / parents [R, n]
    int64 -> (path [R, n], accept_lens [R], bonus [R]) as `verify_tree` returns them.

    At node v, with p the target's distribution there (the request's temperature and filters, normalized), the
    children c_1, c_2 ... (deterministic candidates, such as EAGLE-2's top-k) are tried in node order: c_j is
    kept with probability p(c_j) / (1 - p(c_1) - ... - p(c_{j-1})), i.e. with its share of what the rejected
    siblings leave, and the walk moves to it; when none is kept (or v is a leaf) the bonus token is drawn from p
    without the rejected candidates. So token t is kept at c_j with probability p(t) and drawn as the bonus with
    probability p(t) too, the chain of those terms being sampling without replacement from p. One uniform per
    node (each node is tried at most once); the walk itself runs on the host over the candidates' probabilities."""
    (r, n, vocab), device = logits.shape, logits.device
    probs = filtered_probs(logits.reshape(r * n, vocab), [x for x in params for _ in range(n)]).view(r, n, vocab)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    rows = torch.arange(r, device=device)
    candidate_probs = probs[rows[:, None], parents.clamp_min(0), tokens].tolist()  # p of node c's token at its parent
    uniforms = row_noise((r, n), generators, default_generator, device, exponential=False).tolist()
    host_parents, host_tokens = parents.tolist(), tokens.tolist()
    walks, lens, ends, rejected = [], [], [], []  # per request: path, drafts kept, last node, tokens rejected there
    for row in range(r):
        walk = [0]
        while True:
            left, kept, tried = 1.0, None, []
            for child in (c for c in range(1, n) if host_parents[row][c] == walk[-1]):
                p = candidate_probs[row][child]
                if p > 0 and uniforms[row][child] * left < p:
                    kept = child
                    break
                left -= p
                tried.append(host_tokens[row][child])
            if kept is None:
                break
            walk.append(kept)
        walks.append(walk + [walk[-1]] * (n - len(walk)))
        lens.append(len(walk) - 1)
        ends.append(walk[-1])
        rejected.append(tried)
    at_end = probs[rows, to_device(torch.tensor(ends), device)]
    residual = at_end
    cells = [(row, token) for row, tokens_there in enumerate(rejected) for token in tokens_there]
    if cells:
        at = to_device(torch.tensor(cells), device)
        residual = residual.index_put((at[:, 0], at[:, 1]), torch.zeros((), device=device))
    # All zero only through rounding (the last candidate holding all that was left is kept for certain).
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, at_end)
    path, accept_lens = to_device(torch.tensor(walks), device), to_device(torch.tensor(lens), device)
    return path, accept_lens, draw(residual, generators, default_generator)


def with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, accept_lens: torch.Tensor,
                   params: list[SamplingParams]) -> SampleOutput:
    """The SampleOutput of tokens [B, n] int64 drawn from logits [B, n, V] float32, with the logprobs `sample`
    would report."""
    want_logprobs, top = any(x.logprobs for x in params), max(x.top_logprobs for x in params)
    logprobs = top_values = top_ids = None
    if want_logprobs or top:
        all_logprobs = torch.log_softmax(logits, dim=-1)
        if want_logprobs:
            logprobs = all_logprobs.gather(2, tokens[:, :, None]).squeeze(2)
        if top:
            top_values, top_ids = all_logprobs.topk(top, dim=-1)
    return SampleOutput(tokens, logprobs, top_ids, top_values, accept_lens)
