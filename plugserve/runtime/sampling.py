"""Per-request sampling parameters, and one batched sampler that turns a step's logits into tokens on their device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from plugserve.core.host_copy import to_device

# Temperatures below this sample greedily, as in SGLang: dividing float32 logits by a smaller one overflows.
GREEDY_TEMPERATURE = 1e-6
_F32 = torch.finfo(torch.float32)


@dataclass
class SamplingParams:
    """One request's sampling, with SGLang/vLLM semantics (the server maps OpenAI names such as max_tokens)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE): greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0  # over generated tokens: logit -= frequency_penalty * count
    presence_penalty: float = 0.0  # over generated tokens: logit -= presence_penalty * (count > 0)
    repetition_penalty: float = 1.0  # over prompt and generated tokens: positive logits divided, negative multiplied
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit before sampling
    # Structured output (SGLang's names; at most one): the output must match this JSON schema (a JSON string),
    # regular expression or EBNF grammar. runtime/grammar.py compiles them.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first field out of its allowed range."""
        # Each rule is written as the condition that must hold, so that NaN fails it.
        rules = [
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1 or >= 0 (-1 and 0: disabled)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("n", 1 <= self.n <= 64, "in [1, 64]"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "in [0, 20]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**64, "None or in [0, 2^64) (a torch generator's)"),
            ("stop", len(self.stop) <= 16 and all(self.stop), "at most 16 non-empty strings"),
            ("logit_bias", all(-100 <= b <= 100 for b in self.logit_bias.values()), "biases in [-100, 100]"),
            ("json_schema", sum(g is not None for g in self.grammar) <= 1, "alone: give one of json_schema, regex "
             "and ebnf"),
        ]
        for name, ok, allowed in rules:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the tokens generated so far."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def grammar(self) -> tuple[str | None, str | None, str | None]:
        """The structured-output constraint: (json_schema, regex, ebnf), at most one of them set."""
        return self.json_schema, self.regex, self.ebnf

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


@dataclass
class SampleOutput:
    """What `sample` picked for a batch of B requests; every tensor lives on the logits' device.

    Rows that did not ask for logprobs still get them when another row did; the caller keeps what each asked for
    (a row with top_logprobs < K takes the first top_logprobs columns).
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: log-probability of the chosen token (None if no row asked)
    top_logprob_ids: torch.Tensor | None  # [B, K] int64, K = max top_logprobs in the batch (None if 0)
    top_logprob_values: torch.Tensor | None  # [B, K] float32, sorted descending
    # Speculative verification: [B] int64 drafts accepted per request; every tensor above then has one row per
    # verified position, [B, N, ...], and request b's tokens are its first accept_lens[b] + 1.
    accept_lens: torch.Tensor | None = None

    def runs(self) -> tuple[list[list[int]], list[list[float]] | None, list[list[tuple[tuple[int, float], ...]]],
                            list[int]]:
        """On the host, per request: its run of tokens (one, or a verified run), their logprobs (None where no row
        asked), their top logprobs as (id, logprob) pairs (empty where none was asked), and the run's length."""
        tokens, logprobs, top_ids, top_values = (
            None if t is None else t.tolist()
            for t in (self.token_ids, self.logprobs, self.top_logprob_ids, self.top_logprob_values))
        assert tokens is not None
        if self.accept_lens is None:  # one token per sampled request: runs of one
            tokens, logprobs, top_ids, top_values = (
                None if v is None else [[x] for x in v] for v in (tokens, logprobs, top_ids, top_values))
            counts = [1] * len(tokens)  # type: ignore[arg-type]
        else:  # each request's run of accepted tokens and the target's after them
            counts = [a + 1 for a in self.accept_lens.tolist()]
        if top_ids is None:
            tops = [[()] * len(run) for run in tokens]  # type: ignore[union-attr]
        else:
            tops = [[tuple(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
                    for ids, values in zip(top_ids, top_values, strict=True)]  # type: ignore[arg-type]
        return tokens, logprobs, tops, counts  # type: ignore[return-value]

    def split(self, counts: Sequence[int]) -> list[SampleOutput]:
        """The outputs of consecutive runs of `counts` requests (sum(counts) = B): each DP group's of a
        speculative round decided for every group at once."""
        parts = [None if t is None else t.split(list(counts)) for t in (getattr(self, f.name) for f in fields(self))]
        return [SampleOutput(*(None if p is None else p[i] for p in parts)) for i in range(len(counts))]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The generator a seeded request keeps for its whole life (None when unseeded: it uses the default one)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> SampleOutput:
    """Pick one token per request from logits [B, V] float32 (one row per request; not modified).

    prompt_ids / output_ids: each request's prompt and the tokens it has generated so far (for the penalties).
    generators: per request, its own generator (`make_generator`) or None for `default_generator` (the engine's,
    seeded by --seed; None: torch's global one); a seeded request draws only from its own, so its tokens do not
    depend on what it is batched with.

    token_bitmask: [B, ceil(V / 32)] int32 on the logits' device, bit j of a row set where token j is allowed
    (structured output, `runtime/grammar.py`); None: every token is.

    Logprobs come from the penalized logits before logit_bias, the grammar's mask, temperature and
    top-k/top-p/min-p: they are then defined for greedy rows too (temperature 0) and do not change with the
    sampling knobs, as the model's own view of the next token after the penalties the request asked for (a
    masked token's -inf would be a logprob JSON cannot carry).
    """
    logits = apply_penalties(logits.float(), params, prompt_ids, output_ids)
    want_logprobs = any(p.logprobs for p in params)
    k = max(p.top_logprobs for p in params)
    all_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs or k else None
    logits = constrain(logits, params, token_bitmask)

    token_ids = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        index = to_device(torch.tensor(rows), logits.device)
        picked = [params[i] for i in rows]
        sampled = draw(filtered_probs(logits[index], picked), [generators[i] for i in rows], default_generator)
        token_ids = token_ids.index_copy(0, index, sampled)

    logprobs = top_values = top_ids = None
    if want_logprobs:
        logprobs = all_logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if k:
        top_values, top_ids = all_logprobs.topk(k, dim=-1)
    return SampleOutput(token_ids, logprobs, top_ids, top_values)


def constrain(logits: torch.Tensor, params: list[SamplingParams], token_bitmask: torch.Tensor | None
              ) -> torch.Tensor:
    """logits [B, V] float32 with each row's logit_bias added and the tokens `token_bitmask` ([B, ceil(V / 32)]
    int32, or None) clears set to -inf: a new tensor, or `logits` itself when nothing applies."""
    biased = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias.items()]
    if not biased and token_bitmask is None:
        return logits
    logits = logits.clone()
    if biased:
        rows, tokens, biases = zip(*biased, strict=True)
        index = to_device(torch.tensor([rows, tokens], dtype=torch.int64), logits.device)
        logits.index_put_((index[0], index[1]), to_device(torch.tensor(biases, dtype=torch.float32), logits.device),
                          accumulate=True)
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask)
    return logits


def apply_token_bitmask(logits: torch.Tensor, token_bitmask: torch.Tensor) -> None:
    """Set logits [B, V] float32 to -inf where bit (j % 32) of token_bitmask[b, j // 32] ([B, ceil(V / 32)] int32)
    is clear, in place: on the CPU by xgrammar's kernel (one pass, where `mask_by_bits` builds [B, V] int64
    temporaries and takes several times as long at a decode batch), elsewhere by `mask_by_bits` on the device."""
    if logits.device.type == "cpu":
        from xgrammar import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, token_bitmask)
    else:
        mask_by_bits(logits, token_bitmask)


def mask_by_bits(logits: torch.Tensor, token_bitmask: torch.Tensor) -> None:
    """`apply_token_bitmask` in a few element-wise ops on the logits' device."""
    vocab = logits.shape[-1]
    tokens = torch.arange(vocab, device=logits.device)
    allowed = (token_bitmask[:, tokens // 32] >> (tokens % 32)) & 1
    logits.masked_fill_(allowed == 0, -torch.inf)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What non-greedy rows sample from: logits [R, V] float32 -> softmax(logits / temperature) with the tokens
    top-k, top-p and min-p exclude zeroed, [R, V] float32, not renormalized."""
    return _filter(torch.softmax(logits / _column([p.temperature for p in params], logits.device), dim=-1), params)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None],
         default_generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [R, V] float32 (rows need not sum to 1), in proportion to it: [R] int64."""
    # Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i / sum(p). It is blind to a
    # row's scale, which makes renormalizing the filtered rows unnecessary, and each row reads only its own noise,
    # which a seeded row draws from its own generator.
    noise = row_noise(probs.shape, generators, default_generator, probs.device, exponential=True)
    # An exact 0 in the noise would make an excluded token's 0 / 0 a NaN, which argmax would pick.
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def row_noise(shape: torch.Size | tuple[int, ...], generators: list[torch.Generator | None],
              default_generator: torch.Generator | None, device: torch.device, exponential: bool) -> torch.Tensor:
    """Float32 noise of `shape` [R, ...], Exp(1) or U[0, 1): row r from generators[r], or from `default_generator`
    when that is None."""
    noise = torch.empty(shape, device=device)

    def fill(rows: torch.Tensor, generator: torch.Generator | None) -> None:
        if exponential:
            rows.exponential_(generator=generator)
        else:
            rows.uniform_(generator=generator)

    if any(g is None for g in generators):
        fill(noise, default_generator)
    for row, generator in enumerate(generators):
        if generator is not None:
            fill(noise[row], generator)
    return noise


def _filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the tokens top-k, top-p and min-p exclude: probs [R, V] float32 -> [R, V] float32, not renormalized.

    Each filter sees what the one before kept (as in HF and vLLM): top-p measures mass within the top-k set,
    renormalized. Tokens tied with the k-th largest all stay. A row whose knob is off passes that filter
    unchanged even when another row turns it on, so a row samples the same whatever it is batched with.
    """
    vocab, device = probs.shape[-1], probs.device
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # 0: disabled
    top_k = to_device(torch.tensor(top_ks), device)[:, None] if any(top_ks) else None
    if any(p.top_p < 1 for p in params):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        if top_k is not None:
            sorted_probs = sorted_probs.masked_fill(sorted_probs < _kth_largest(sorted_probs, top_k), 0.0)
        top_p = _column([p.top_p for p in params], device)
        # Keep the shortest prefix whose mass reaches top_p of the kept mass: a token stays while the mass before it
        # is below that, so the first one always does. top_p = 1 rows skip the test instead of trusting the rounding
        # of cumsum.
        limit = torch.where(top_p < 1, top_p * sorted_probs.sum(dim=-1, keepdim=True), torch.inf)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= limit, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    elif top_k is not None:
        # No sort needed: the k-th largest comes from a top-k of the largest k in the batch.
        probs = probs.masked_fill(probs < _kth_largest(probs.topk(max(top_ks), dim=-1).values, top_k), 0.0)
    if any(p.min_p > 0 for p in params):
        # The most likely token survives top-k and top-p, so its probability is the max of the unfiltered row.
        min_p = _column([p.min_p for p in params], device)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _kth_largest(values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """values [R, >= max k] float32 sorted descending, top_k [R, 1] int64 (0: disabled) -> [R, 1] float32.

    Disabled rows get 0, which no probability is below.
    """
    return values.gather(1, (top_k - 1).clamp_min(0)).masked_fill(top_k == 0, 0.0)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]]
) -> torch.Tensor:
    """logits [B, V] float32 -> penalized [B, V] float32: a new tensor, or `logits` itself when no row penalizes.

    Only the rows with a penalty pay for counting their tokens.
    """
    vocab, device = logits.shape[-1], logits.device
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if rows:
        index = to_device(torch.tensor(rows), device)
        # Extreme penalties (1e-300, 1e300) stay finite in float32, and so do the logits they scale: an inf or
        # NaN logit would be sampled and reported as a logprob that JSON cannot carry.
        penalty = _column([params[i].repetition_penalty for i in rows], device).clamp(_F32.tiny, _F32.max)
        seen = _token_counts([prompt_ids[i] + output_ids[i] for i in rows], vocab, device) > 0
        picked = logits[index]
        picked = torch.where(seen, torch.where(picked > 0, picked / penalty, picked * penalty), picked)
        picked = picked.clamp(_F32.min, _F32.max)
        logits = logits.index_copy(0, index, picked)
    rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0 or p.presence_penalty != 0]
    if rows:
        index = to_device(torch.tensor(rows), device)
        frequency = _column([params[i].frequency_penalty for i in rows], device)
        presence = _column([params[i].presence_penalty for i in rows], device)
        counts = _token_counts([output_ids[i] for i in rows], vocab, device)
        logits = logits.index_copy(0, index, logits[index] - frequency * counts - presence * (counts > 0))
    return logits


def _token_counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row of `ids` (ragged): [R, V] float32."""
    width = max(map(len, ids))
    padded = to_device(torch.tensor([row + [0] * (width - len(row)) for row in ids], dtype=torch.int64), device)
    lengths = to_device(torch.tensor([len(row) for row in ids]), device)
    # Padding points at token 0 but adds 0 to it.
    valid = (torch.arange(width, device=device) < lengths[:, None]).float()
    return torch.zeros(len(ids), vocab, device=device).scatter_add_(1, padded, valid)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """One float per row -> [R, 1] float32, to broadcast over the vocab."""
    return to_device(torch.tensor(values, dtype=torch.float32), device)[:, None]
