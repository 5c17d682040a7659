"""Background requests (Batch API lines) in the engine: they sit out the step that computes a foreground
request's first token, never two steps running, and their output is what it would have been alone."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.tenancy import Tenancy

BACKGROUND = Tenancy(team="batch", priority=1_000_000, background=True)
FOREGROUND = Tenancy(team="chat")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir)))


def prompt_of(number: int, length: int = 20) -> list[int]:
    return [50 + (number * 97 + i * 13) % 4000 for i in range(length)]


def engine_of(tiny) -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=8), tiny)


def step_collecting(engine: LLMEngine, outputs: dict[str, list[int]]) -> None:
    for output in engine.step():
        for delta in output.deltas:
            outputs.setdefault(output.request_id, []).extend(delta.token_ids)


def computed(engine: LLMEngine, request_id: str) -> int:
    return engine.groups[request_id].sequences[0].num_computed_tokens


def test_a_foreground_first_token_step_carries_no_background_work(tiny):
    engine = engine_of(tiny)
    for number in range(4):
        engine.add_request(f"bg{number}", prompt_of(number), GREEDY, BACKGROUND)
    outputs: dict[str, list[int]] = {}
    for _ in range(3):
        step_collecting(engine, outputs)
    before = {f"bg{number}": computed(engine, f"bg{number}") for number in range(4)}
    engine.add_request("chat", prompt_of(9, 40), SamplingParams(temperature=0.0, max_tokens=4), FOREGROUND)
    step_collecting(engine, outputs)
    assert engine.stats.scheduled_seqs_last_step == 1 and engine.stats.scheduled_tokens_last_step == 40
    assert len(outputs["chat"]) == 1  # its first token, in a step of its own
    assert {request_id: computed(engine, request_id) for request_id in before} == before  # they waited
    step_collecting(engine, outputs)
    assert engine.stats.scheduled_seqs_last_step == 5  # and went on at once
    while engine.has_unfinished:
        step_collecting(engine, outputs)
    alone = engine_of(tiny)
    expected: dict[str, list[int]] = {}
    for number in range(4):
        alone.add_request(f"bg{number}", prompt_of(number), GREEDY, BACKGROUND)
    while alone.has_unfinished:
        step_collecting(alone, expected)
    assert {request_id: outputs[request_id] for request_id in expected} == expected
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_foreground_requests_starting_every_step_leave_the_background_half_the_steps(tiny):
    engine = engine_of(tiny)
    engine.add_request("bg", prompt_of(1), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), BACKGROUND)
    outputs: dict[str, list[int]] = {}
    step_collecting(engine, outputs)
    for number in range(20):
        engine.add_request(f"chat{number}", prompt_of(number + 2, 8), SamplingParams(max_tokens=1), FOREGROUND)
        step_collecting(engine, outputs)
    assert len(outputs["bg"]) == 1 + 10


def test_the_engine_counts_the_background_seats_and_tokens(tiny):
    engine = engine_of(tiny)
    for number in range(3):
        engine.add_request(f"bg{number}", prompt_of(number), GREEDY, BACKGROUND)
    engine.add_request("chat", prompt_of(9), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), FOREGROUND)
    outputs: dict[str, list[int]] = {}
    step_collecting(engine, outputs)
    assert engine.stats.num_running == 4 and engine.stats.num_running_background == 3
    while engine.has_unfinished:
        step_collecting(engine, outputs)
    assert engine.stats.generation_tokens_background_total == 3 * GREEDY.max_tokens
    assert engine.stats.generation_tokens_total == 3 * GREEDY.max_tokens + 5
    assert engine.stats.scheduled_background_seqs_total >= 3 * GREEDY.max_tokens
    assert engine.stats.num_running_background == 0
