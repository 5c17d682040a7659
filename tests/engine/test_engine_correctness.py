"""Greedy output equals HF transformers `generate`, token for token, whatever the engine did on the way."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.tenancy import Tenancy
from tests.support.engine import QUESTIONS, chat_prompt, make_engine, run_to_completion

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
LONG_SYSTEM = (
    "You are the support assistant of a company that sells bicycles, helmets and spare parts. Answer briefly, "
    "politely and precisely; when you do not know, say so and suggest contacting the shop. " * 3
)


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [chat_prompt(smollm2.tokenizer, q) for q in QUESTIONS]


def assert_matches_hf(results, prompts, hf_greedy, max_new=MAX_NEW):
    for number, prompt in enumerate(prompts):
        expected = hf_greedy(prompt, max_new)
        for index, tokens in results[f"r{number}"].items():
            assert tokens == expected, f"request {number} sequence {index} diverged from HF"


def assert_all_blocks_free(engine):
    assert engine.blocks.num_used_blocks == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_prompts_have_different_lengths(prompts):
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) == len(prompts)


def test_default_batching_matches_hf(smollm2, prompts, hf_greedy):
    engine = make_engine(smollm2, num_kv_blocks=256)
    results = run_to_completion(engine, prompts, GREEDY)
    assert_matches_hf(results, prompts, hf_greedy)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_output_exact(smollm2, prompts, hf_greedy, mode):
    longest = max(len(p) for p in prompts) + MAX_NEW
    engine = make_engine(
        smollm2, num_kv_blocks=-(-longest // 16) + 6, preemption_mode=mode, enable_prefix_caching=False
    )
    results = run_to_completion(engine, prompts, GREEDY)
    counters = engine.scheduler.counters
    assert (counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute) > 0
    assert_matches_hf(results, prompts, hf_greedy)
    assert_all_blocks_free(engine)
    if mode == "swap":
        assert len(engine.blocks.free_cpu_blocks) == engine.blocks.num_cpu_blocks


def test_shared_prefix_hits_cache_and_matches_hf(smollm2, hf_greedy):
    prompts = [chat_prompt(smollm2.tokenizer, q, system=LONG_SYSTEM) for q in QUESTIONS[:8]]
    engine = make_engine(smollm2, num_kv_blocks=256)
    first = run_to_completion(engine, prompts[:1], GREEDY)  # warms the cache with the shared system prompt
    results = run_to_completion(engine, prompts, GREEDY)
    assert engine.scheduler.counters.prefix_cache_hits >= 7 * 16 * (
        len(chat_prompt(smollm2.tokenizer, "", LONG_SYSTEM)) // 16 - 1
    )
    assert_matches_hf(first, prompts[:1], hf_greedy)
    assert_matches_hf(results, prompts, hf_greedy)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("scheduling", ["fair", "fcfs"])
def test_requests_arriving_together_compute_their_shared_start_once(smollm2, hf_greedy, scheduling):
    prompts = [chat_prompt(smollm2.tokenizer, q, system=LONG_SYSTEM) for q in QUESTIONS[:8]]
    shared_blocks = len(chat_prompt(smollm2.tokenizer, "", LONG_SYSTEM)) // 16 - 1
    engine = make_engine(smollm2, num_kv_blocks=256, scheduling=scheduling)
    results = run_to_completion(engine, prompts, GREEDY)  # one burst, nothing cached before it
    assert engine.scheduler.counters.prefix_cache_hits >= 7 * 16 * shared_blocks
    assert_matches_hf(results, prompts, hf_greedy)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("teams", [("a", "a"), ("a", "b")])
def test_only_a_team_that_may_share_a_prompt_waits_for_it(smollm2, teams):
    prompt = chat_prompt(smollm2.tokenizer, QUESTIONS[0], system=LONG_SYSTEM)
    engine = make_engine(smollm2, num_kv_blocks=256)
    for number, team in enumerate(teams):
        engine.add_request(f"r{number}", prompt, GREEDY, Tenancy(team=team))
    engine.step()
    same_team = teams[0] == teams[1]
    # one team: the second request waits a step and then finds the prompt cached; two teams keep their caches
    # apart, so neither waits for the other
    assert engine.stats.scheduled_seqs_last_step == (1 if same_team else 2)
    engine.step()
    assert engine.scheduler.counters.prefix_cache_hits == (len(prompt) - 1) // 16 * 16 * same_team


def test_chunked_prefill_matches_hf(smollm2, prompts, hf_greedy):
    engine = make_engine(smollm2, num_kv_blocks=256, max_num_batched_tokens=32)
    results = run_to_completion(engine, prompts, GREEDY)
    assert max(len(p) for p in prompts) > 32  # so prefills really were chunked
    assert_matches_hf(results, prompts, hf_greedy)
    assert_all_blocks_free(engine)


def test_n3_shares_prompt_blocks_with_copy_on_write(smollm2, prompts, hf_greedy):
    engine = make_engine(smollm2, num_kv_blocks=256)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW)
    results = run_to_completion(engine, prompts, params)
    assert engine.scheduler.counters.copy_on_write_blocks > 0
    for number in range(len(prompts)):
        assert sorted(results[f"r{number}"]) == [0, 1, 2]
    assert_matches_hf(results, prompts, hf_greedy)
    assert_all_blocks_free(engine)


def test_n3_sampled_sequences_differ_but_greedy_twin_matches(smollm2, prompts, hf_greedy):
    engine = make_engine(smollm2, num_kv_blocks=256)
    sampled = run_to_completion(engine, prompts[:2], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_NEW))
    assert any(len({tuple(t) for t in seqs.values()}) > 1 for seqs in sampled.values())
    assert_all_blocks_free(engine)


def test_abort_midway_returns_every_block(smollm2, prompts):
    engine = make_engine(smollm2, num_kv_blocks=256)
    for number, prompt in enumerate(prompts):
        engine.add_request(f"r{number}", prompt, SamplingParams(n=2, temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    for number in range(len(prompts)):
        output = engine.abort(f"r{number}")
        assert output.finished and all(d.finish_reason == "abort" for d in output.deltas)
    assert not engine.has_unfinished
    assert_all_blocks_free(engine)
