"""Fair share through the prefill phase: a team that turns up while another team's long prompts hold the
seats and the step's token budget gets its prompt into the next step; the prefills that give way resume
without recomputing anything, leak no blocks, and every output stays token-exact."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.scheduler import FIRST_TOKEN_STEP_PREFILL, ScheduledBatch
from engine.tenancy import Tenancy


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir)))


def prompt_of(number: int, length: int) -> list[int]:
    return [50 + (number * 97 + i * 13) % 4000 for i in range(length)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class Recorder:
    """Every step's batch as (request id, tokens scheduled) pairs, and each request's outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.batches: list[list[tuple[str, int]]] = []
        self.outputs: dict[str, list[int]] = {}
        self.first_token_step: dict[str, int] = {}
        schedule = engine.scheduler.schedule

        def recorded() -> ScheduledBatch:
            batch = schedule()
            self.batches.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
            return batch

        engine.scheduler.schedule = recorded  # type: ignore[method-assign]

    def step(self) -> None:
        for output in self.engine.step():
            for delta in output.deltas:
                if delta.token_ids:
                    self.first_token_step.setdefault(output.request_id, len(self.batches))
                self.outputs.setdefault(output.request_id, []).extend(delta.token_ids)

    def drain(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished:
                return
            self.step()
        raise AssertionError("the engine stopped making progress")

    def tokens_computed(self, request_id: str) -> int:
        return sum(n for batch in self.batches for rid, n in batch if rid == request_id)


def reference_outputs(tiny, prompts: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    """Each request alone, first come first served, in a roomy pool: what every schedule must reproduce."""
    reference = LLMEngine(EngineConfig(num_kv_blocks=256, scheduling="fcfs", enable_prefix_caching=False), tiny)
    recorder = Recorder(reference)
    for request_id, (prompt, max_tokens) in prompts.items():
        reference.add_request(request_id, prompt, params(max_tokens))
    recorder.drain()
    return recorder.outputs


@pytest.mark.parametrize("seats", [1, 2])
def test_a_new_teams_prompt_gets_into_the_next_step_while_another_teams_prefills_hold_the_seats(tiny, seats):
    """Team a's 200-token prompts take 7 steps each at 32 tokens a step: every seat (and the whole budget)
    holds a partial prefill of theirs when team b's short prompt arrives. Before: b waited for a's prefill
    and then `fair_min_run_steps` of its decode."""
    config = EngineConfig(
        num_kv_blocks=128, block_size=16, max_num_seqs=seats, max_num_batched_tokens=32, enable_prefix_caching=False
    )
    engine = LLMEngine(config, tiny)
    recorder = Recorder(engine)
    prompts = {f"a{n}": (prompt_of(n, 200), 4) for n in range(3)}
    for request_id, (prompt, max_tokens) in prompts.items():
        engine.add_request(request_id, prompt, params(max_tokens), Tenancy(team="a"))
    recorder.step()
    recorder.step()
    running = engine.scheduler.running
    assert len(running) >= 1 and all(r.team == "a" and 0 < r.num_computed_tokens < 200 for r in running)
    prompts["b0"] = (prompt_of(99, 8), 4)
    engine.add_request("b0", prompts["b0"][0], params(4), Tenancy(team="b"))
    recorder.step()
    assert ("b0", 8) in recorder.batches[-1], f"b's prompt waited: {recorder.batches[-1]}"
    assert recorder.first_token_step["b0"] == len(recorder.batches)  # its first token came with that step
    recorder.drain()
    assert recorder.outputs == reference_outputs(tiny, prompts)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_yielded_prefills_resume_where_they_stopped_and_leak_no_blocks(tiny):
    """Three teams' first chunks take one seat in turn while long prompts are still prefilling: every prompt
    token is computed exactly once (no recompute, prefix caching off so no cache can hide one), the
    outputs are token-exact, and the pool is whole again at the end."""
    config = EngineConfig(
        num_kv_blocks=64, block_size=16, max_num_seqs=1, max_num_batched_tokens=32, enable_prefix_caching=False
    )
    engine = LLMEngine(config, tiny)
    recorder = Recorder(engine)
    prompts: dict[str, tuple[list[int], int]] = {}
    arrivals = {0: ("a", 150), 1: ("a", 90), 2: ("b", 120), 4: ("c", 70), 6: ("b", 40)}
    for step in range(8):
        if step in arrivals:
            team, length = arrivals[step]
            request_id = f"{team}-{step}"
            prompts[request_id] = (prompt_of(step, length), 3)
            engine.add_request(request_id, prompts[request_id][0], params(3), Tenancy(team=team))
        recorder.step()
    recorder.drain()
    counters = engine.scheduler.counters
    assert counters.preemptions_fair > 0, "no prefill gave way: the test is not testing yields"
    assert counters.preemptions_recompute == counters.preemptions_swap == 0
    for request_id, (prompt, max_tokens) in prompts.items():
        # the prompt once, then each output token but the last fed back once
        assert recorder.tokens_computed(request_id) == len(prompt) + max_tokens - 1, request_id
    assert recorder.outputs == reference_outputs(tiny, prompts)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_prefill_that_gave_way_takes_what_the_step_has_left(tiny):
    """A newcomer's first chunk needs the blocks a partial prefill holds: the prefill yields and gives them
    back, and the seat, tokens and blocks the newcomer leaves in that step go to it at once, not a step
    later (a 2-core CPU runs such a step for the newcomer's tokens alone otherwise)."""
    config = EngineConfig(
        num_kv_blocks=5, block_size=8, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    engine = LLMEngine(config, tiny)
    recorder = Recorder(engine)
    prompts = {"a-long": (prompt_of(1, 36), 4)}
    engine.add_request("a-long", prompts["a-long"][0], params(4), Tenancy(team="a"))
    recorder.step()
    recorder.step()  # 32 of its 36 tokens: 4 of the 5 blocks
    prompts["b-short"] = (prompt_of(2, 12), 2)
    engine.add_request("b-short", prompts["b-short"][0], params(2), Tenancy(team="b"))
    recorder.step()
    assert engine.scheduler.counters.preemptions_fair == 1
    assert recorder.batches[-1] == [("b-short", 12), ("a-long", 4)], "the step left a seat and 4 tokens idle"
    recorder.drain()
    assert recorder.outputs == reference_outputs(tiny, prompts)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_held_blocks_are_given_back_when_the_pool_runs_short(tiny, prefix_caching):
    """A yielded prefill's blocks are what a newcomer needs: they are released (full blocks stay in the
    prefix cache), nothing leaks, and the outputs stay exact."""
    config = EngineConfig(
        num_kv_blocks=16, block_size=16, max_num_seqs=1, max_num_batched_tokens=32, enable_prefix_caching=prefix_caching
    )
    engine = LLMEngine(config, tiny)
    recorder = Recorder(engine)
    prompts = {"a-long": (prompt_of(1, 200), 4)}
    engine.add_request("a-long", prompts["a-long"][0], params(4), Tenancy(team="a"))
    for _ in range(4):
        recorder.step()  # 128 of its 200 tokens: 8 blocks held of 16
    prompts["b-long"] = (prompt_of(2, 180), 4)
    engine.add_request("b-long", prompts["b-long"][0], params(4), Tenancy(team="b"))
    recorder.drain()
    assert engine.scheduler.counters.preemptions_fair > 0
    assert recorder.outputs == reference_outputs(tiny, prompts)
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert sorted(blocks.free_block_ids()) == list(range(blocks.num_blocks))


def test_a_newcomers_first_token_step_carries_little_of_the_others_prefill(tiny):
    """On a CPU a step's time is its tokens: the step that computes the newcomer's first token carries at
    most FIRST_TOKEN_STEP_PREFILL prefill tokens of the team served more; the next one is full again. Steps
    bounded by tokens alone (max_step_seconds 0), so team a's first step is a whole one and a is ahead when b
    comes (with the time bound the first step is the floor's, engine/step_budget.py)."""
    config = EngineConfig(
        num_kv_blocks=512, block_size=16, max_num_seqs=8, max_num_batched_tokens=1024, max_step_seconds=0.0
    )
    engine = LLMEngine(config, tiny)
    recorder = Recorder(engine)
    for n in range(6):
        engine.add_request(f"a{n}", prompt_of(n, 400), params(2), Tenancy(team="a"))
    recorder.step()
    engine.add_request("b0", prompt_of(50, 10), params(2), Tenancy(team="b"))
    recorder.step()
    newcomer_step = recorder.batches[-1]
    assert ("b0", 10) in newcomer_step
    assert sum(n for rid, n in newcomer_step if rid.startswith("a") and n > 1) <= FIRST_TOKEN_STEP_PREFILL
    recorder.step()
    assert sum(n for _, n in recorder.batches[-1]) == 1024  # a's prefill has the whole budget back
    recorder.drain()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_one_team_alone_keeps_full_steps(tiny):
    """No other team, no cut: a single team's prefill fills every step's budget as before."""
    config = EngineConfig(num_kv_blocks=512, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
    engine = LLMEngine(config, tiny)
    recorder = Recorder(engine)
    for n in range(6):
        engine.add_request(f"a{n}", prompt_of(n, 300), params(2), Tenancy(team="a"))
    for _ in range(6):
        recorder.step()
    assert all(sum(n for _, n in batch) == 256 for batch in recorder.batches)
    recorder.drain()
