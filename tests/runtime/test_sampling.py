import pytest
import torch

from plugserve.runtime.sampling import SampleOutput, SamplingParams, make_generator, mask_by_bits, sample

# A known distribution over 8 tokens; logits = log(probs), so temperature 1 samples it exactly.
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()


def _sample(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]] | None = None,
            output_ids: list[list[int]] | None = None,
            generators: list[torch.Generator | None] | None = None) -> SampleOutput:
    batch = len(params)
    return sample(logits, params, prompt_ids or [[] for _ in range(batch)], output_ids or [[] for _ in range(batch)],
                  generators or [None] * batch)


def _draw(params: SamplingParams, draws: int = 20_000, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """Token frequencies [V] int64 over `draws` unseeded rows sampled in one call."""
    torch.manual_seed(0)
    out = _sample(logits.expand(draws, -1), [params] * draws)
    return torch.bincount(out.token_ids, minlength=logits.shape[-1])


def _assert_matches(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Support is exactly expected's, and a chi-square over it is far below anything a wrong distribution gives."""
    assert (counts > 0).tolist() == (expected > 0).tolist()
    kept = expected > 0
    want = counts.sum() * expected[kept] / expected[kept].sum()
    chi_square = ((counts[kept] - want) ** 2 / want).sum().item()
    assert chi_square < 30, chi_square


def _full_logprobs(out: SampleOutput, row: int, vocab: int) -> torch.Tensor:
    """Rebuild a row's whole log-softmax [V] from top_logprobs = V."""
    return torch.empty(vocab).scatter_(0, out.top_logprob_ids[row], out.top_logprob_values[row])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": -5}, "max_new_tokens must be >= 1, got -5"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be >= 0, got nan"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be -1 or >= 0 (-1 and 0: disabled), got -2"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -3.0}, "presence_penalty must be in [-2, 2], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"n": 0}, "n must be in [1, 64], got 0"),
        ({"n": 65}, "n must be in [1, 64], got 65"),
        ({"top_logprobs": 21}, "top_logprobs must be in [0, 20], got 21"),
        ({"seed": -1}, "seed must be None or in [0, 2^64) (a torch generator's), got -1"),
        ({"seed": 2**64}, "seed must be None or in [0, 2^64) (a torch generator's), got 18446744073709551616"),
        ({"stop": ["ok", ""]}, "stop must be at most 16 non-empty strings, got ['ok', '']"),
        ({"stop": ["x"] * 17}, "stop must be at most 16 non-empty strings"),
    ],
)
def test_validate_names_the_field_and_its_range(fields: dict, message: str):
    with pytest.raises(ValueError) as error:
        SamplingParams(**fields).validate()
    assert str(error.value).startswith(message)


def test_validate_accepts_defaults_and_edges():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, frequency_penalty=-2, presence_penalty=2, n=64,
                   top_logprobs=20, seed=0, stop=["x"] * 16).validate()


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5, top_k=2).is_greedy


def test_greedy_rows_are_argmax_beside_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=0, top_p=0.1, min_p=0.5),
              SamplingParams(temperature=2.0, top_k=3)]
    out = _sample(logits, params)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    for row in (0, 2, 4):
        assert out.token_ids[row] == logits[row].argmax()


def test_top_k_1_is_greedy():
    torch.manual_seed(2)
    logits = torch.randn(32, 100)
    out = _sample(logits, [SamplingParams(temperature=1.3, top_k=1)] * 32)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(), [0, 1, 2, 3, 4, 5, 6, 7]),
        (SamplingParams(top_k=3), [0, 1, 2]),
        (SamplingParams(top_p=0.6), [0, 1]),  # mass before token 1 is 0.40 < 0.6, before token 2 is 0.65
        (SamplingParams(top_p=0.9), [0, 1, 2, 3]),
        (SamplingParams(min_p=0.3), [0, 1, 2]),  # keeps p >= 0.12
        # top-p within the top-k set renormalized: [0.5, 0.3125, 0.1875], so 0.7 is reached by two tokens.
        (SamplingParams(top_k=3, top_p=0.7), [0, 1]),
        (SamplingParams(top_k=5, min_p=0.5), [0, 1]),
        (SamplingParams(top_k=6, top_p=0.95, min_p=0.1), [0, 1, 2, 3, 4]),
    ],
)
def test_filters_keep_exactly_their_support_and_sample_it_renormalized(params: SamplingParams, kept: list[int]):
    expected = torch.zeros(8)
    expected[kept] = PROBS[kept]
    _assert_matches(_draw(params), expected)


def test_filters_in_a_mixed_batch_keep_each_rows_support():
    torch.manual_seed(3)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.3), SamplingParams()]
    out = _sample(LOGITS.expand(4 * 5000, -1), params * 5000)
    tokens = out.token_ids.view(5000, 4)
    assert set(tokens[:, 0].tolist()) == {0, 1}
    assert set(tokens[:, 1].tolist()) == {0, 1}
    assert set(tokens[:, 2].tolist()) == {0, 1, 2}
    assert set(tokens[:, 3].tolist()) == set(range(8))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature: float):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    counts = _draw(SamplingParams(temperature=temperature), draws=50_000, logits=logits)
    _assert_matches(counts, torch.softmax(logits / temperature, dim=-1))


def test_seeded_request_draws_the_same_alone_or_batched():
    torch.manual_seed(4)
    steps = [torch.randn(5, 64) for _ in range(6)]
    seeded = SamplingParams(temperature=1.0, seed=1234)

    generator = make_generator(seeded.seed, "cpu")
    alone = [_sample(step[2:3], [seeded], generators=[generator]).token_ids.item() for step in steps]

    # Neighbours turn on every filter path (sort, top-k, min-p), penalties, logprobs and other generators.
    neighbours = [SamplingParams(top_p=0.8, top_k=10), SamplingParams(temperature=0),
                  SamplingParams(min_p=0.2, seed=99, repetition_penalty=1.3, top_logprobs=3),
                  SamplingParams(temperature=0.5, frequency_penalty=1.0, logprobs=True)]
    generator = make_generator(1234, "cpu")
    others = [None, None, make_generator(99, "cpu"), None]
    batched = []
    for step in steps:
        params = [*neighbours[:2], seeded, *neighbours[2:]]
        out = _sample(step, params, prompt_ids=[[1, 2]] * 5, output_ids=[[3]] * 5,
                      generators=[*others[:2], generator, *others[2:]])
        batched.append(out.token_ids[2].item())
    assert batched == alone

    generator = make_generator(4321, "cpu")
    other_seed = [_sample(step[2:3], [seeded], generators=[generator]).token_ids.item() for step in steps]
    assert other_seed != alone


def test_make_generator():
    assert make_generator(None, "cpu") is None
    first, second = make_generator(7, "cpu"), make_generator(7, "cpu")
    assert torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=second))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[3.0, 2.0, -1.0, -1.5, 0.5, 1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, top_logprobs=6)
    # Token 0 from the prompt and token 2 from the output are seen; token 4 twice, still penalized once.
    out = _sample(logits, [params], prompt_ids=[[0, 4]], output_ids=[[2, 4]])
    penalized = torch.tensor([1.5, 2.0, -2.0, -1.5, 0.25, 1.0])
    assert out.token_ids.item() == 1  # was 0 before the penalty
    torch.testing.assert_close(_full_logprobs(out, 0, 6), torch.log_softmax(penalized, dim=-1))


def test_repetition_penalty_makes_greedy_pick_the_unseen_negative():
    logits = torch.tensor([[-1.0, -5.0, -1.5]])
    out = _sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)], prompt_ids=[[0]])
    assert out.token_ids.item() == 2


def test_frequency_and_presence_penalties_count_only_generated_tokens():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.5, 3.0]])
    params = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25, top_logprobs=5)
    out = _sample(logits, [params], prompt_ids=[[0, 0, 3]], output_ids=[[4, 4, 4, 1]])
    penalized = torch.tensor([2.0, 1.5 - 0.5 - 0.25, 0.0, 0.5, 3.0 - 1.5 - 0.25])
    assert out.token_ids.item() == 0  # token 4 falls from 3.0 to 1.25; prompt token 0 keeps its 2.0
    torch.testing.assert_close(_full_logprobs(out, 0, 5), torch.log_softmax(penalized, dim=-1))


def test_penalties_apply_only_to_their_rows_and_leave_the_input_alone():
    logits = torch.tensor([[1.0, 2.0, 0.0]] * 3)
    before = logits.clone()
    params = [SamplingParams(temperature=0, top_logprobs=3), SamplingParams(temperature=0, frequency_penalty=2.0),
              SamplingParams(temperature=0, repetition_penalty=4.0, presence_penalty=-1.0)]
    out = _sample(logits, params, prompt_ids=[[1]] * 3, output_ids=[[1], [1], []])
    assert out.token_ids.tolist() == [1, 0, 0]  # row 1: 2 - 2 = 0; row 2: 2 / 4 = 0.5, presence sees no output
    assert torch.equal(logits, before)


def test_logprobs_are_log_softmax_of_penalized_logits_before_temperature():
    torch.manual_seed(5)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.7, logprobs=True), SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=1.5, top_k=5, logprobs=True),
              SamplingParams(temperature=0.9, presence_penalty=1.0, logprobs=True)]
    output_ids = [[], [], [], [7, 8]]
    out = _sample(logits, params, output_ids=output_ids)
    penalized = logits.clone()
    penalized[3, [7, 8]] -= 1.0
    expected = torch.log_softmax(penalized, dim=-1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected)


def test_top_logprobs_are_the_k_largest_sorted_descending():
    torch.manual_seed(6)
    logits = torch.randn(3, 40)
    params = [SamplingParams(top_logprobs=2), SamplingParams(temperature=0, top_logprobs=5), SamplingParams()]
    out = _sample(logits, params)
    assert out.logprobs is None
    assert out.top_logprob_ids.shape == (3, 5) and out.top_logprob_ids.dtype == torch.int64
    full = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.top_logprob_values, full.gather(1, out.top_logprob_ids))
    assert torch.all(out.top_logprob_values[:, :-1] >= out.top_logprob_values[:, 1:])
    assert out.top_logprob_ids.tolist() == full.argsort(dim=-1, descending=True)[:, :5].tolist()


def test_no_logprobs_when_nobody_asks():
    out = _sample(torch.randn(2, 10), [SamplingParams(), SamplingParams(temperature=0)])
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprob_values is None


def test_mixed_batch_in_one_call():
    torch.manual_seed(7)
    logits = torch.randn(6, 20)
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(top_k=2, seed=5),
              SamplingParams(top_p=0.3, temperature=0.8), SamplingParams(min_p=0.9, repetition_penalty=1.2),
              SamplingParams(temperature=0, frequency_penalty=0.5, top_logprobs=4), SamplingParams(temperature=3.0)]
    generators = [None, make_generator(5, "cpu"), None, None, None, None]
    out = _sample(logits, params, prompt_ids=[[0, 1]] * 6, output_ids=[[2], [3], [4], [5], [6, 6], []],
                  generators=generators)
    assert out.token_ids.shape == (6,) and out.logprobs.shape == (6,) and out.top_logprob_values.shape == (6, 4)
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[1].item() in logits[1].topk(2).indices.tolist()
    sorted_probs, order = torch.softmax(logits[2] / 0.8, dim=-1).sort(descending=True)
    assert out.token_ids[2].item() in order[sorted_probs.cumsum(0) - sorted_probs < 0.3].tolist()
    seen = logits[3, [0, 1, 5]]  # prompt 0, 1 and output 5
    penalized = logits[3].index_put((torch.tensor([0, 1, 5]),), torch.where(seen > 0, seen / 1.2, seen * 1.2))
    probs = torch.softmax(penalized, dim=-1)
    assert probs[out.token_ids[3]] >= 0.9 * probs.max()
    assert out.token_ids[4] == logits[4].index_put((torch.tensor([6]),), logits[4, 6] - 2 * 0.5).argmax()
    assert 0 <= out.token_ids[5] < 20


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 1e30, 1e300])
def test_extreme_repetition_penalties_keep_logits_and_logprobs_finite(penalty):
    """The API fuzzer's find: repetition_penalty 5e-324 (0 in float32) made inf logits, and a 500 when the
    logprobs were written as JSON."""
    logits = LOGITS[None] + 2.0  # positive and negative logits: divided and multiplied
    params = SamplingParams(temperature=1.0, repetition_penalty=penalty, logprobs=True, top_logprobs=3, seed=1)
    out = _sample(logits, [params], prompt_ids=[list(range(logits.shape[-1]))], generators=[torch.Generator()])
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprob_values).all()
    assert 0 <= int(out.token_ids[0]) < logits.shape[-1]


def test_a_temperature_too_small_for_float32_is_greedy():
    logits = LOGITS.flip(0)[None]  # the most likely token last: a NaN row's argmax would say 0
    out = _sample(logits, [SamplingParams(temperature=5e-324, logprobs=True)])
    assert int(out.token_ids[0]) == int(logits.argmax()) and torch.isfinite(out.logprobs).all()


def test_logit_bias_moves_the_greedy_token_and_forces_one():
    greedy = SamplingParams(temperature=0)
    away = SamplingParams(temperature=0, logit_bias={0: -100.0})
    forced = SamplingParams(temperature=1, logit_bias={7: 100.0})  # 0.005 of the mass without it
    out = _sample(LOGITS.expand(3, -1), [greedy, away, forced])
    assert out.token_ids.tolist() == [0, 1, 7]
    # Only the row that asked is biased, and logprobs stay the model's (before the bias).
    assert out.logprobs is None
    logprobs = _sample(LOGITS[None], [SamplingParams(temperature=0, logit_bias={0: -100.0}, logprobs=True)]).logprobs
    assert logprobs.item() == pytest.approx(PROBS[1].log().item(), abs=1e-5)


def test_a_token_bitmask_allows_only_its_tokens():
    """Bit j % 32 of word j // 32 allows token j; rows greedy and sampled, over a vocab past one word."""
    vocab = 40
    logits = torch.randn(2, vocab)
    allowed = [{3, 33}, {39}]
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[row, t // 32] |= 1 << (t % 32)
    params = [SamplingParams(temperature=1), SamplingParams(temperature=0)]
    for _ in range(20):
        out = sample(logits, params, [[], []], [[], []], [None, None], token_bitmask=bitmask)
        assert out.token_ids[0].item() in allowed[0] and out.token_ids[1].item() == 39
    # A bit 31 (the int32's sign bit) allows its token too.
    bitmask = torch.tensor([[-(2**31), 0]], dtype=torch.int32)
    out = sample(logits[:1], [SamplingParams(temperature=0)], [[]], [[]], [None], token_bitmask=bitmask)
    assert out.token_ids.item() == 31


def test_the_devices_element_wise_mask_equals_xgrammars_kernel():
    """`mask_by_bits` (what a GPU runs) against xgrammar's CPU kernel (what the CPU runs), every bit pattern's
    tokens, sign bits and a vocabulary past the last whole word among them."""
    from xgrammar import apply_token_bitmask_inplace

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 32), generator=generator, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[1] = -1
    ours, theirs = logits.clone(), logits.clone()
    mask_by_bits(ours, bitmask)
    apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours[0]).all() and torch.equal(ours[1], logits[1])


def test_a_verified_output_splits_into_each_groups_requests():
    tokens = torch.arange(12).view(4, 3)
    out = SampleOutput(tokens, tokens.float(), None, None, torch.tensor([0, 2, 1, 0]))
    first, idle, last = out.split([1, 0, 3])
    assert first.token_ids.tolist() == [[0, 1, 2]] and first.accept_lens.tolist() == [0]  # type: ignore[union-attr]
    assert idle.token_ids.shape == (0, 3) and idle.top_logprob_ids is None
    assert last.logprobs.tolist() == tokens[1:].float().tolist()  # type: ignore[union-attr]
