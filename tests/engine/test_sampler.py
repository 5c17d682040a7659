"""The sampler: what a user of temperature, top-k/p, penalties, seeds and logprobs would notice."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

import kernels
from engine.sampler import (
    Sampler,
    SamplingState,
    apply_logit_processors,
    blocked_argmax,
    inverse_cdf_sample,
    keyed_uniform,
    truncation_thresholds,
)
from engine.sampling_params import SamplingParams

VOCAB = 1024  # a multiple of the block size, like real vocabularies: the blocked fast paths run
EOS = 2


@pytest.fixture(autouse=True)
def fixed_global_seed():
    """Unseeded rows draw from torch's global generator: fixed here so statistical checks cannot flake."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True, params=["native", "torch"])
def sampling_path(request):
    """Every behaviour holds on both paths: the native sampler (kernels/sampling.py) and the torch ops."""
    if request.param == "native" and not kernels.native_sampling_available(torch.zeros(1, 2)):
        pytest.skip("the native CPU kernels can't be built here")
    kernels.use_native_cpu(request.param == "native")
    yield request.param
    kernels.use_native_cpu(True)


def state(prompt=(), output=(), seed=None, eos=EOS, **params) -> SamplingState:
    sampling = SamplingParams(seed=seed, **params)
    return SamplingState(sampling, list(prompt), list(output), seed, eos)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    return Sampler()(logits, states).token_ids


def test_greedy_picks_the_argmax_of_every_row():
    logits = random_logits(16)
    assert sample(logits, [state(temperature=0.0) for _ in range(16)]) == logits.argmax(dim=-1).tolist()


def test_greedy_rows_keep_their_argmax_next_to_sampled_rows():
    logits = random_logits(8)
    states = [state(temperature=0.0 if row % 2 else 1.0) for row in range(8)]
    tokens = sample(logits, states)
    assert tokens[1::2] == logits[1::2].argmax(dim=-1).tolist()


def test_sampler_leaves_the_callers_logits_untouched():
    logits = random_logits(4)
    before = logits.clone()
    sample(logits, [state(temperature=0.7, top_p=0.5, logit_bias={3: 5.0}, presence_penalty=1.0, output=[1])] * 4)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("vocab", [49152, 1024, 1000, 64])
def test_blocked_argmax_is_torch_argmax_on_awkward_rows(vocab):
    logits = random_logits(7, vocab=vocab)
    logits[1] = 0.0  # all tied: the first index
    logits[2, [5, vocab - 1]] = 100.0  # tie across blocks
    logits[3, [vocab - 2, vocab - 1]] = 100.0  # tie inside the last block
    logits[4] = float("-inf")
    logits[5, :-1] = float("-inf")
    logits[6] = logits[6].to(torch.bfloat16).float()  # bf16 models give many ties
    assert torch.equal(blocked_argmax(logits), logits.argmax(dim=-1))


def test_zero_probability_tokens_are_never_sampled():
    weights = torch.zeros(4000, VOCAB)
    weights[:, [0, 255, 256, 700, VOCAB - 1]] = torch.tensor([1e-30, 1.0, 1e-6, 2.0, 0.5])
    weights[::2, 255] = 0.0
    tokens = set(inverse_cdf_sample(weights, torch.rand(4000)).tolist())
    assert tokens <= {0, 255, 256, 700, VOCAB - 1} and {255, 700, VOCAB - 1} <= tokens


def test_logit_bias_forces_a_token():
    logits = random_logits(2)
    states = [state(temperature=0.0, logit_bias={7: 100.0}), state(temperature=1.0, logit_bias={7: 100.0})]
    assert sample(logits, states) == [7, 7]


def test_logit_bias_bans_the_favourite_token():
    logits = random_logits(1)
    favourite = int(logits.argmax())
    second = int(logits[0].topk(2).indices[1])
    assert sample(logits, [state(temperature=0.0, logit_bias={favourite: -100.0})]) == [second]


def test_min_tokens_blocks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 5], logits[0, 9] = 10.0, 9.0, 8.0
    early = dict(temperature=0.0, min_tokens=3, stop_token_ids=(5,), output=[11, 12])
    assert sample(logits, [state(**early)]) == [9]
    assert sample(logits, [state(**{**early, "output": [11, 12, 13]})]) == [EOS]


def test_min_tokens_eos_is_never_sampled():
    logits = torch.zeros(200, VOCAB)
    logits[:, EOS] = 5.0
    tokens = sample(logits, [state(temperature=1.0, min_tokens=1) for _ in range(200)])
    assert EOS not in tokens


def test_ignore_eos_leaves_eos_alone_under_min_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    assert sample(logits, [state(temperature=0.0, min_tokens=5, eos=None)]) == [EOS]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, :4] = torch.tensor([2.0, -2.0, 3.0, -3.0])
    processed = apply_logit_processors(logits, [state(prompt=[0, 1], output=[1], repetition_penalty=2.0)])
    assert processed[0, :4].tolist() == [1.0, -4.0, 3.0, -3.0]


def test_presence_and_frequency_penalties_subtract_per_repeat():
    logits = torch.zeros(1, VOCAB)
    processed = apply_logit_processors(
        logits, [state(prompt=[9], output=[4, 4, 4, 6], presence_penalty=0.5, frequency_penalty=0.25)]
    )
    assert processed[0, 4].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert processed[0, 6].item() == pytest.approx(-(0.5 + 0.25))
    assert processed[0, 9].item() == 0.0  # prompt tokens are not penalised by presence/frequency


def test_frequency_penalty_lowers_how_often_a_repeated_token_is_sampled():
    logits = torch.zeros(4000, 4)
    plain = torch.tensor(sample(logits, [state(temperature=1.0, seed=i) for i in range(4000)]))
    penalised = torch.tensor(
        sample(logits, [state(temperature=1.0, seed=i, output=[0] * 3, frequency_penalty=0.5) for i in range(4000)])
    )
    assert (penalised == 0).float().mean() < 0.6 * (plain == 0).float().mean()


def test_plain_rows_are_not_copied_for_penalty_work():
    logits = random_logits(3)
    assert apply_logit_processors(logits, [state(output=[1, 2, 3]) for _ in range(3)]) is logits


def test_top_k_1_equals_greedy():
    logits = random_logits(32)
    assert sample(logits, [state(temperature=1.5, top_k=1) for _ in range(32)]) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = random_logits(32)
    assert sample(logits, [state(temperature=1.5, top_p=1e-6) for _ in range(32)]) == logits.argmax(dim=-1).tolist()


def test_top_k_samples_only_among_the_k_best():
    logits = random_logits(1).expand(500, VOCAB)
    best = set(logits[0].topk(5).indices.tolist())
    assert set(sample(logits, [state(temperature=2.0, top_k=5) for _ in range(500)])) <= best


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, 4)
    tokens = sample(logits, [state(temperature=1.0, min_p=0.2) for _ in range(2000)])
    assert set(tokens) == {0, 1, 2}


def reference_threshold(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> float:
    """The obvious version: sort everything, cut at k, then at the nucleus, then at min_p."""
    values = row.sort(descending=True).values
    if 0 < top_k < len(values):
        values = values[:top_k]
    probs = values.softmax(dim=-1)
    kept = int(((probs.cumsum(dim=-1) - probs) < top_p).sum()) if top_p < 1.0 else len(values)
    return max(values[kept - 1].item(), (row.max() + math.log(min_p)).item() if min_p > 0 else -math.inf)


@pytest.mark.parametrize("scale", [0.3, 3.0, 10.0])
def test_truncation_thresholds_match_a_full_sort(scale):
    logits = random_logits(6, vocab=5000, seed=1, scale=scale)
    top_k, top_p, min_p = [0, 40, 0, 300, 0, 7], [0.9, 0.95, 0.5, 1.0, 0.999, 0.3], [0.0, 0.0, 0.01, 0.0, 0.0, 0.2]
    got = truncation_thresholds(logits, top_k, top_p, min_p, top_p_candidates=16).squeeze(1).tolist()
    expected = [reference_threshold(logits[i], top_k[i], top_p[i], min_p[i]) for i in range(6)]
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("vocab", [4, VOCAB])
def test_samples_follow_the_temperature_scaled_distribution(vocab):
    spread = [0, 1, vocab // 2, vocab - 1]  # across blocks when there are several
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, spread] = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    tokens = torch.tensor(sample(logits.expand(20000, vocab), [state(temperature=0.5) for _ in range(20000)]))
    expected = torch.softmax(logits[0, spread] / 0.5, dim=-1)
    observed = torch.bincount(tokens, minlength=vocab)[spread].float() / len(tokens)
    assert observed.sum().item() == pytest.approx(1.0) and torch.allclose(observed, expected, atol=0.015)


def test_same_seed_gives_the_same_tokens_over_many_steps_whatever_the_batch():
    steps = [random_logits(1, seed=step, scale=1.0)[0] for step in range(40)]
    alone = state(temperature=1.0, seed=1234)
    batched = state(temperature=1.0, seed=1234)
    neighbours = [
        state(temperature=0.8, seed=7),
        state(temperature=1.0),
        state(temperature=0.0),
        state(temperature=1.2),
    ]
    tokens_alone, tokens_batched = [], []
    for step, row in enumerate(steps):
        tokens_alone.append(sample(row.unsqueeze(0), [alone])[0])
        # The seeded row moves around the batch and the batch changes size.
        batch = neighbours[: step % 4] + [batched] + neighbours[step % 4 :][: step % 3]
        logits = torch.stack([row if s is batched else random_logits(1, seed=1000 + step)[0] for s in batch])
        tokens_batched.append(sample(logits, batch)[next(i for i, s in enumerate(batch) if s is batched)])
        alone.output_token_ids.append(tokens_alone[-1])
        batched.output_token_ids.append(tokens_batched[-1])
    assert tokens_alone == tokens_batched
    assert len(set(tokens_alone)) > 10  # each position draws afresh


def test_different_seeds_give_different_tokens():
    logits = random_logits(1, scale=0.5)

    def run(seed: int) -> list[int]:
        row = state(seed=seed)
        for _ in range(20):
            row.output_token_ids.append(sample(logits, [row])[0])
        return row.output_token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_seeded_draws_are_uniform_across_seeds_and_positions():
    """The keyed uniforms that replace a generator per sequence: no bias by seed or by position."""
    draws = torch.tensor([keyed_uniform(seed, position) for seed in range(200) for position in range(100)])
    assert 0.0 <= draws.min() and draws.max() < 1.0
    counts = torch.histc(draws, bins=20, min=0.0, max=1.0)
    assert chisquare(counts.numpy()).pvalue > 1e-3
    by_position = draws.view(200, 100)
    assert torch.corrcoef(torch.stack([by_position[:, 0], by_position[:, 1]]))[0, 1].abs() < 0.2


def test_logprobs_top_is_sorted_and_the_chosen_logprob_is_the_raw_one():
    logits = random_logits(2)
    out = Sampler()(
        logits,
        [state(temperature=1.0, logprobs=5, presence_penalty=2.0, output=[3]), state(temperature=0.0, logprobs=5)],
    )
    raw = logits.log_softmax(dim=-1)
    for row, logprob in enumerate(out.logprobs):
        assert logprob.token_id == out.token_ids[row]
        assert logprob.logprob == pytest.approx(raw[row, logprob.token_id].item(), abs=1e-5)
        values = [value for _, value in logprob.top]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert all(value <= 0 for value in values) and sum(math.exp(v) for v in values) <= 1.0
        assert [token for token, _ in logprob.top] == raw[row].topk(5).indices.tolist()
    assert out.logprobs[1].top[0][0] == out.token_ids[1]  # greedy without penalties: the chosen is the best


def test_logprobs_only_for_rows_that_ask_and_zero_means_no_alternatives():
    out = Sampler()(random_logits(2), [state(temperature=0.0), state(temperature=0.0, logprobs=0)])
    assert out.logprobs[0] is None
    assert out.logprobs[1].top == [] and out.logprobs[1].logprob <= 0


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError):
        Sampler()(random_logits(3), [state()])
