"""Prompt-lookup speculative decoding: fewer steps for text that repeats, and the output a user gets unchanged:
greedy equal to HF and to the engine without drafts, sampling with its distribution kept."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.config import EngineConfig
from engine.request import Request
from engine.sampler import Sampler, SamplingState, apply_logit_processors, target_weights
from engine.sampling_params import SamplingParams
from engine.speculation import PAUSE_STEPS, NgramIndex, NgramSpeculator, best_draft_length
from tests.engine.test_engine_correctness import LONG_SYSTEM, assert_all_blocks_free, assert_matches_hf
from tests.support.engine import QUESTIONS, chat_prompt, make_engine, run_to_completion

MAX_NEW = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
# Answers that copy from the prompt, where drafts get accepted ...
REPEATING = [
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Copy this list exactly:\n- red apples\n- green pears\n- yellow bananas\n- purple grapes\n- orange oranges",
    "Rewrite this code with better names:\ndef f(x, y):\n    z = x + y\n    return z * z\n\ndef g(x):\n    return f(x, x)\n",
]
# ... and plain chat, where few are.
PLAIN = [QUESTIONS[0], QUESTIONS[3]]


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [chat_prompt(smollm2.tokenizer, q) for q in REPEATING + PLAIN]


def drafting_engine(smollm2, **settings):
    settings.setdefault("num_kv_blocks", 256)
    settings.setdefault("speculation_max_batch", 8)
    return make_engine(smollm2, speculation="ngram", **settings)


# ---- drafts ------------------------------------------------------------------------------------


def test_index_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    assert index.propose(tokens, 2) == [6, 7]  # "2 3 4" last went on with 6 7, not with 5 9


def test_index_prefers_the_longest_match():
    index = NgramIndex(max_n=3)
    # "4" alone last went on with 9, but "3 4" only ever with 5
    assert index.propose([3, 4, 5, 6, 4, 9, 0, 3, 4], 2) == [5, 6]


def test_index_repeats_a_short_period_past_the_end_and_finds_nothing_in_new_text():
    index = NgramIndex(max_n=3)
    assert index.propose([7, 8, 7, 8, 7], 5) == [8, 7, 8, 7, 8]
    assert NgramIndex().propose([1, 2, 3, 4], 3) == []


def test_index_is_fed_incrementally():
    index = NgramIndex(max_n=2)
    tokens = [5, 6, 7]
    assert index.propose(tokens, 2) == []
    tokens += [5, 6]
    assert index.propose(tokens, 2) == [7, 5]
    tokens += [1, 5]
    assert index.propose(tokens, 3) == [6, 1, 5]  # the latest "5" went on with 6 1, then 5 again


def test_index_with_a_minimum_length_ignores_single_token_matches():
    tokens = [4, 9, 1, 2, 3, 0, 4]
    assert NgramIndex(max_n=3, min_n=1).propose(tokens, 2) == [9, 1]
    assert NgramIndex(max_n=3, min_n=2).propose(tokens, 2) == []


def test_a_sequence_whose_drafts_keep_failing_pauses_longer_each_time():
    speculator = NgramSpeculator(EngineConfig(speculation="ngram", device="cpu"), max_model_len=512)
    request = Request("r", 0, [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=100))
    request.output_token_ids = [3]
    request.num_computed_tokens = request.num_tokens - 1
    skipped = []  # steps without drafts after each run of rejected ones
    for _ in range(3):
        while True:
            speculator.propose([request])
            if not request.draft_token_ids:
                break
            speculator.record(request, len(request.draft_token_ids), 0)
        count = 1
        while not request.draft_token_ids:
            speculator.propose([request])
            count += 1
        skipped.append(count - 1)
    assert skipped == [PAUSE_STEPS, 2 * PAUSE_STEPS, 4 * PAUSE_STEPS]
    speculator.record(request, 4, 4)  # accepted drafts: back to drafting, the next pause short again
    speculator.propose([request])
    assert request.draft_token_ids


def test_draft_length_follows_the_acceptance_and_the_cost_of_a_row():
    assert best_draft_length(0.9, 4, row_cost=0.18) == 4
    assert best_draft_length(0.5, 4, row_cost=0.18) == 2
    assert best_draft_length(0.1, 4, row_cost=0.18) == 0  # a plain step does better
    assert best_draft_length(0.1, 4, row_cost=0.0) == 4  # free rows: always worth a try


# ---- greedy: exact -----------------------------------------------------------------------------


def test_greedy_with_drafts_matches_hf_and_itself_without(smollm2, prompts, hf_greedy):
    plain = make_engine(smollm2, num_kv_blocks=256, speculation="off")
    without = run_to_completion(plain, prompts, GREEDY)
    engine = drafting_engine(smollm2)
    results = run_to_completion(engine, prompts, GREEDY)
    assert results == without
    assert_matches_hf(results, prompts, hf_greedy, MAX_NEW)
    stats = engine.stats
    assert plain.stats.spec_draft_tokens_total == 0
    assert stats.spec_accepted_tokens_total >= 20  # the copying answers really were drafted
    assert stats.generation_tokens_total == plain.stats.generation_tokens_total
    assert_all_blocks_free(engine)


def test_one_stream_at_a_time_takes_fewer_steps(smollm2, prompts):
    """The default (auto) drafts on the CPU for a lone stream; each draft costs no more than one step."""
    engine = make_engine(smollm2, num_kv_blocks=64)
    plain = make_engine(smollm2, num_kv_blocks=64, speculation="off")
    for prompt in prompts[:1]:
        assert run_to_completion(engine, [prompt], GREEDY) == run_to_completion(plain, [prompt], GREEDY)
    assert engine.stats.spec_acceptance_rate > 0.5
    assert engine.stats.steps_total * 2 < plain.stats.steps_total
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("dtype, drafting", [("float32", True), ("bfloat16", False)])
def test_auto_drafts_in_float32_but_not_in_bfloat16(dtype, drafting):
    """In bfloat16 a drafted step's rounding could change a greedy reply with the load. (With packed weights
    the drafts are verified inside the fused decode step: tests/engine/test_engine_quantized.py.)"""
    speculator = NgramSpeculator(EngineConfig(dtype=dtype, device="cpu"), 512)
    request = Request("r", 0, [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=100))
    request.output_token_ids = [3]
    request.num_computed_tokens = request.num_tokens - 1
    speculator.propose([request])
    assert bool(request.draft_token_ids) is drafting


def test_with_a_fused_decode_drafts_are_weighed_against_a_sequences_share_of_the_step():
    """Packed weights: a draft row costs arithmetic, about as much at any batch, so among 4 sequences a
    sequence with middling acceptance does not draft; alone again, it drafts at once (it was not paused)."""

    def about_to_decode(index: int) -> Request:
        request = Request(f"r{index}", 0, [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=100))
        request.output_token_ids = [3]
        request.num_computed_tokens = request.num_tokens - 1
        return request

    speculator = NgramSpeculator(EngineConfig(device="cpu"), 512, fused_decode=True)
    batch = [about_to_decode(i) for i in range(4)]
    speculator.propose(batch)
    assert not any(request.draft_token_ids for request in batch)
    speculator.propose(batch[:1])
    assert batch[0].draft_token_ids
    unfused = NgramSpeculator(EngineConfig(device="cpu"), 512)
    unfused.propose(batch)
    assert all(request.draft_token_ids for request in batch)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_drafts_keeps_output_exact(smollm2, prompts, hf_greedy, mode):
    """Every answer runs MAX_NEW tokens (EOS ignored), so the sequences outgrow a small pool; up to EOS
    they are HF's answer, and all of it is what the engine gives without drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    longest = max(len(p) for p in prompts) + MAX_NEW
    settings = {"num_kv_blocks": -(-longest // 16) + 4, "preemption_mode": mode, "enable_prefix_caching": False}
    engine = drafting_engine(smollm2, **settings)
    results = run_to_completion(engine, prompts, params)
    counters = engine.scheduler.counters
    assert (counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute) > 0
    assert engine.stats.spec_accepted_tokens_total > 0
    assert results == run_to_completion(make_engine(smollm2, speculation="off", **settings), prompts, params)
    for number, prompt in enumerate(prompts):
        expected = hf_greedy(prompt, MAX_NEW)
        assert results[f"r{number}"][0][: len(expected)] == expected
    assert_all_blocks_free(engine)
    if mode == "swap":
        assert len(engine.blocks.free_cpu_blocks) == engine.blocks.num_cpu_blocks


def test_shared_prefix_and_copy_on_write_with_drafts(smollm2, hf_greedy):
    """n=2 siblings share the prompt's blocks and write drafts into their shared last block (copy-on-write);
    the second round finds the system prompt in the prefix cache."""
    prompts = [chat_prompt(smollm2.tokenizer, q, system=LONG_SYSTEM) for q in REPEATING[:2]]
    engine = drafting_engine(smollm2)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_NEW)
    first = run_to_completion(engine, prompts[:1], params)
    results = run_to_completion(engine, prompts, params)
    counters = engine.scheduler.counters
    assert counters.prefix_cache_hits > 0 and counters.copy_on_write_blocks > 0
    assert engine.stats.spec_accepted_tokens_total > 0
    assert_matches_hf(first, prompts[:1], hf_greedy, MAX_NEW)
    assert_matches_hf(results, prompts, hf_greedy, MAX_NEW)
    assert_all_blocks_free(engine)


# ---- where a sequence ends -----------------------------------------------------------------------


def texts(engine, prompt, params) -> tuple[list[int], str, str]:
    engine.add_request("x", prompt, params)
    tokens, text, reason = [], "", None
    while engine.has_unfinished:
        for output in engine.step():
            delta = output.deltas[0]
            tokens += delta.token_ids
            text += delta.text
            reason = delta.finish_reason or reason
    return tokens, text, reason


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"max_tokens": 7}, "length"),  # ends inside an accepted run of drafts
        ({"max_tokens": MAX_NEW, "stop": ("lazy dog. The",)}, "stop"),
        ({"max_tokens": MAX_NEW, "min_tokens": 12, "stop_token_ids": "."}, "stop"),  # the second sentence's end
    ],
    ids=["max_tokens", "stop_string", "stop_token_after_min_tokens"],
)
def test_drafts_never_run_past_an_end(smollm2, prompts, fields, reason):
    if "stop_token_ids" in fields:
        fields = {**fields, "stop_token_ids": tuple(smollm2.tokenizer.encode(".", add_special_tokens=False))}
    params = SamplingParams(temperature=0.0, **fields)
    engine = drafting_engine(smollm2)
    result = texts(engine, prompts[0], params)
    expected = texts(make_engine(smollm2, num_kv_blocks=256, speculation="off"), prompts[0], params)
    assert result == expected
    assert result[2] == reason
    assert engine.stats.spec_accepted_tokens_total > 0
    assert len(result[0]) <= params.max_tokens
    assert_all_blocks_free(engine)


def test_no_drafts_above_the_batch_threshold(smollm2, prompts):
    engine = make_engine(smollm2, num_kv_blocks=256, speculation="ngram", speculation_max_batch=2)
    for number, prompt in enumerate(prompts[:3]):
        engine.add_request(f"r{number}", prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for _ in range(12):
        engine.step()
    assert len(engine.scheduler.running) == 3
    assert engine.stats.spec_draft_tokens_total == 0


# ---- sampling: the distribution kept -------------------------------------------------------------


def test_sampled_output_with_drafts_honours_logprobs_and_penalties(smollm2, prompts):
    engine = drafting_engine(smollm2)
    params = SamplingParams(temperature=0.7, top_p=0.95, presence_penalty=0.2, logprobs=2, max_tokens=MAX_NEW)
    for number, prompt in enumerate(prompts[:3]):
        engine.add_request(f"r{number}", prompt, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    while engine.has_unfinished:
        for output in engine.step():
            delta = output.deltas[0]
            tokens.setdefault(output.request_id, []).extend(delta.token_ids)
            logprobs.setdefault(output.request_id, []).extend(delta.logprobs)
    assert engine.stats.spec_accepted_tokens_total > 0
    for request_id, ids in tokens.items():
        assert 0 < len(ids) <= MAX_NEW
        assert [entry.token_id for entry in logprobs[request_id]] == ids
        assert all(len(entry.top) == 2 for entry in logprobs[request_id])
    assert_all_blocks_free(engine)


def test_a_seeded_reply_is_the_same_with_drafts_or_without(smollm2, prompts):
    """A seed fixes the reply: drafting (which depends on the batch) must not change a sampled token."""
    params = SamplingParams(n=2, temperature=0.7, top_p=0.95, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    without = run_to_completion(make_engine(smollm2, num_kv_blocks=256, speculation="off"), prompts[:3], params)
    engine = drafting_engine(smollm2)
    assert run_to_completion(engine, prompts[:3], params) == without
    assert engine.stats.spec_accepted_tokens_total >= 10  # the seeded copies really were drafted
    assert_all_blocks_free(engine)


VOCAB = 8
DRAWS = 40_000


@pytest.mark.parametrize(
    ("params", "draft"),
    [
        ({"temperature": 1.0}, 1),  # a likely draft
        ({"temperature": 0.7}, 6),  # an unlikely one
        ({"temperature": 1.3, "top_k": 4}, 2),  # inside the top-k
        ({"temperature": 1.0, "top_p": 0.8}, 7),  # outside the nucleus: always rejected
        ({"temperature": 1.0, "frequency_penalty": 1.5}, 0),  # a penalised token
    ],
)
def test_drafted_rows_keep_the_distribution(params, draft):
    """A drafted row keeps its draft with probability p(draft) and otherwise draws another token: the tokens
    must follow p, the distribution the sampler draws from (chi-square over many rows, fixed seed)."""
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]]).repeat(DRAWS, 1)
    states = [SamplingState(SamplingParams(**params), [0], [0, 0]) for _ in range(DRAWS)]
    weights = target_weights(apply_logit_processors(logits[:1], states[:1]), states[:1])[0].double()
    probability = weights / weights.sum()
    result = Sampler()(logits, states, [draft] * DRAWS)
    observed = torch.bincount(torch.tensor(result.token_ids), minlength=VOCAB).double()
    support = probability > 0
    assert not observed[~support].any()
    assert chisquare(observed[support], probability[support] * DRAWS).pvalue > 1e-3
    accepted = sum(result.accepted)
    assert accepted == result.token_ids.count(draft)  # accepted exactly when the draft is the token drawn
    assert abs(accepted / DRAWS - float(probability[draft])) < 0.01  # kept with probability p(draft)


def test_a_seeded_row_draws_the_same_token_with_a_draft_or_without():
    """A seeded row is sampled as without a draft, and its draft holds exactly when it is that token."""
    logits = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    states = [SamplingState(SamplingParams(temperature=1.0, seed=9), [], [0] * i, seed=9 + i % 4) for i in range(64)]
    without = Sampler()(logits, states).token_ids
    drafts: list[int | None] = [token if i % 2 else (token + 1) % 256 for i, token in enumerate(without)]
    drafts[5] = None
    result = Sampler()(logits, states, drafts)
    assert result.token_ids == without
    assert result.accepted == [draft == token for draft, token in zip(drafts, without)]


def test_greedy_rows_accept_exactly_the_argmax():
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    best = logits.argmax(dim=-1).tolist()
    states = [SamplingState(SamplingParams(temperature=0.0), [], []) for _ in range(3)]
    result = Sampler()(logits, states, [best[0], (best[1] + 1) % 256, None])
    assert result.token_ids == best
    assert result.accepted == [True, False, False]
