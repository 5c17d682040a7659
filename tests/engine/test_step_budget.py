"""A step's token budget follows its measured time: where a token is slow (a bigger model, a slower CPU), a
step of `max_num_batched_tokens` would keep a request that arrives mid-step waiting for seconds, so the
budget shrinks to about `max_step_seconds` of work; where tokens are cheap it stays whole."""

from __future__ import annotations

import time

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.step_budget import FLOOR_TOKENS, StepBudget
from engine.tenancy import Tenancy
from tests.engine.test_fair_prefill import Recorder, prompt_of, reference_outputs

SECONDS_PER_TOKEN = 0.0005  # what the slowed runner below costs a token: 2048 tokens ~ 1 s


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir)))


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def slowed(engine: LLMEngine) -> LLMEngine:
    """The tiny model with a real model's cost per token: each forward sleeps in proportion to its tokens."""
    forward = engine.runner.forward

    def slow_forward(requests, num_new_tokens):  # type: ignore[no-untyped-def]
        time.sleep(SECONDS_PER_TOKEN * sum(num_new_tokens))
        return forward(requests, num_new_tokens)

    engine.runner.forward = slow_forward  # type: ignore[method-assign]
    return engine


def test_the_budget_is_the_step_time_over_the_measured_cost_of_a_token():
    budget = StepBudget(max_num_batched_tokens=2048, max_step_seconds=1.0)
    assert budget.tokens == FLOOR_TOKENS  # nothing measured yet: a short step, which measures
    assert StepBudget(max_num_batched_tokens=128, max_step_seconds=1.0).tokens == 128  # never above the cap
    budget.observe(2048, 3.0)
    assert budget.tokens == int(1.0 / (3.0 / 2048))
    budget.observe(64, 60.0)  # a small step is mostly fixed cost: not a token's price
    assert budget.tokens == int(1.0 / (3.0 / 2048))
    budget.observe(2048, 30.0)  # a very slow model: never below the floor
    assert budget.tokens == FLOOR_TOKENS
    fast = StepBudget(max_num_batched_tokens=2048, max_step_seconds=1.0)
    fast.observe(2048, 0.01)
    assert fast.tokens == 2048
    off = StepBudget(max_num_batched_tokens=2048, max_step_seconds=0.0)
    off.observe(2048, 3.0)
    assert off.tokens == 2048


def test_max_step_seconds_must_not_be_negative():
    with pytest.raises(ValueError, match="max_step_seconds"):
        EngineConfig(max_step_seconds=-1.0)


def test_slow_steps_shrink_so_a_newcomer_waits_one_short_step_and_outputs_stay_exact(tiny):
    """Team a floods 12 prompts of 400 tokens at 0.5 ms a token: a 2048-token step would take about a second,
    and team b's request, arriving mid-step, would wait for it. With max_step_seconds 0.25 the first step,
    with nothing measured yet, carries the floor (where it was a whole 2048-token step), every later one at
    most ~500 tokens, b's prompt and first token come in the step after it arrives, and every output equals the
    one each request gets alone."""
    config = EngineConfig(
        num_kv_blocks=1024,
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        max_step_seconds=0.25,
        enable_prefix_caching=False,
    )
    engine = slowed(LLMEngine(config, tiny))
    recorder = Recorder(engine)
    prompts = {f"a{n}": (prompt_of(n, 400), 4) for n in range(12)}
    for request_id, (prompt, max_tokens) in prompts.items():
        engine.add_request(request_id, prompt, params(max_tokens), Tenancy(team="a"))
    for _ in range(3):
        recorder.step()
    step_tokens = [sum(n for _, n in batch) for batch in recorder.batches]
    assert step_tokens[0] == FLOOR_TOKENS  # nothing measured to go by yet
    assert all(tokens <= 0.25 / SECONDS_PER_TOKEN for tokens in step_tokens), step_tokens
    prompts["b0"] = (prompt_of(99, 8), 4)
    engine.add_request("b0", prompts["b0"][0], params(4), Tenancy(team="b"))
    recorder.step()
    assert ("b0", 8) in recorder.batches[-1]
    assert recorder.first_token_step["b0"] == len(recorder.batches)
    recorder.drain()
    assert all(sum(n for _, n in batch) <= 0.25 / SECONDS_PER_TOKEN for batch in recorder.batches)
    assert recorder.outputs == reference_outputs(tiny, prompts)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.stats.step_token_budget <= 0.25 / SECONDS_PER_TOKEN


def test_cheap_tokens_keep_whole_steps(tiny):
    """The tiny model unslowed: a 2048-token step takes milliseconds, so after the first step (the floor, which
    measures that) the budget is whole."""
    config = EngineConfig(num_kv_blocks=1024, max_num_seqs=8, max_num_batched_tokens=1024, enable_prefix_caching=False)
    engine = LLMEngine(config, tiny)
    recorder = Recorder(engine)
    for n in range(8):
        engine.add_request(f"a{n}", prompt_of(n, 400), params(2), Tenancy(team="a"))
    for _ in range(3):
        recorder.step()
    assert [sum(n for _, n in batch) for batch in recorder.batches] == [FLOOR_TOKENS, 1024, 1024]
