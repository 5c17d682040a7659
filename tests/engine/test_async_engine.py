"""The async front: streaming deltas, abort, stats, and a failing request that fails alone."""

from __future__ import annotations

import asyncio
import sys

import pytest

from engine.async_engine import GIL_SWITCH_INTERVAL_S, AsyncEngine, EngineRejected
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.support.engine import chat_prompt


@pytest.fixture(scope="module")
def engine(smollm2):
    engine = AsyncEngine.start(EngineConfig(num_kv_blocks=128, max_num_seqs=8), loaded=smollm2)
    yield engine
    engine.shutdown()


async def collect(engine, request_id, prompt, params):
    text, tokens, finish, outputs = {}, {}, {}, []
    async for output in engine.generate(request_id, prompt, params):
        outputs.append(output)
        for delta in output.deltas:
            text[delta.index] = text.get(delta.index, "") + delta.text
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
            if delta.finish_reason:
                finish[delta.index] = delta.finish_reason
    return text, tokens, finish, outputs


def wait_idle(engine, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine did not go idle: {engine.stats()}")


def test_streamed_text_is_the_decoded_tokens(engine, smollm2):
    prompt = chat_prompt(smollm2.tokenizer, "What is the capital of France?")
    text, tokens, finish, outputs = asyncio.run(
        collect(engine, "paris", prompt, SamplingParams(temperature=0.0, max_tokens=30))
    )
    assert "Paris" in text[0]
    assert text[0] == smollm2.tokenizer.decode(tokens[0], skip_special_tokens=True)
    assert finish[0] == "stop" and outputs[-1].finished
    assert len(outputs) > 2  # streamed, not one lump
    assert outputs[0].num_prompt_tokens == len(prompt)


def test_abort_ends_the_stream_and_frees_blocks(engine, smollm2):
    prompt = chat_prompt(smollm2.tokenizer, "Tell me a long story.")

    async def run():
        seen = []
        async for output in engine.generate("long", prompt, SamplingParams(max_tokens=400, ignore_eos=True)):
            seen.append(output)
            if len(seen) == 3:
                engine.abort("long")
        return seen

    seen = asyncio.run(run())
    assert seen[-1].finished and seen[-1].deltas[0].finish_reason == "abort"
    assert sum(len(d.token_ids) for o in seen for d in o.deltas) < 400
    wait_idle(engine)


def test_a_consumer_that_walks_away_aborts_its_request(engine, smollm2):
    prompt = chat_prompt(smollm2.tokenizer, "Count to one hundred.")

    async def run():
        stream = engine.generate("walker", prompt, SamplingParams(max_tokens=400, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(run())
    wait_idle(engine)


def test_concurrent_requests_all_finish_with_their_lengths(engine, smollm2):
    prompts = [chat_prompt(smollm2.tokenizer, f"Say the number {i}.") for i in range(12)]

    async def run():
        return await asyncio.gather(
            *[
                collect(engine, f"c{i}", p, SamplingParams(max_tokens=5 + i, ignore_eos=True, temperature=0.7, seed=i))
                for i, p in enumerate(prompts)
            ]
        )

    results = asyncio.run(run())
    for i, (_, tokens, finish, _) in enumerate(results):
        assert len(tokens[0]) == 5 + i and finish[0] == "length"
    stats = wait_idle(engine)
    assert stats.generation_tokens_total >= sum(5 + i for i in range(12))


def test_rejected_request_raises_before_streaming(engine):
    async def run():
        async for _ in engine.generate("huge", [5] * 9000, SamplingParams(max_tokens=10)):
            pass

    with pytest.raises(EngineRejected) as rejected:
        asyncio.run(run())
    assert rejected.value.code == "context_length_exceeded"


def test_a_request_that_breaks_the_model_step_fails_alone(smollm2):
    engine = AsyncEngine.start(EngineConfig(num_kv_blocks=128), loaded=smollm2)
    real_forward = engine.core.runner.forward

    def faulty_forward(requests, counts):
        if any(r.request_id == "poison" for r in requests):
            raise RuntimeError("injected fault")
        return real_forward(requests, counts)

    engine.core.runner.forward = faulty_forward
    prompt = chat_prompt(smollm2.tokenizer, "Hello there")
    try:

        async def run():
            return await asyncio.gather(
                collect(engine, "healthy", prompt, SamplingParams(temperature=0.0, max_tokens=8)),
                collect(engine, "poison", prompt, SamplingParams(temperature=0.0, max_tokens=8)),
            )

        healthy, poison = asyncio.run(run())
        assert healthy[2][0] in ("stop", "length") and healthy[1][0]
        assert poison[2][0] == "error" and "injected fault" in poison[3][-1].error
        wait_idle(engine)
        # the engine goes on serving
        after = asyncio.run(collect(engine, "after", prompt, SamplingParams(temperature=0.0, max_tokens=8)))
        assert after[1][0] == healthy[1][0]
    finally:
        engine.shutdown()


def test_a_request_that_cannot_be_added_fails_alone(smollm2):
    engine = AsyncEngine.start(EngineConfig(num_kv_blocks=64), loaded=smollm2)
    real_add = engine.core.add_request

    def faulty_add(request_id, prompt, params, *tenancy):
        if request_id == "broken":
            raise OverflowError("injected")
        return real_add(request_id, prompt, params, *tenancy)

    engine.core.add_request = faulty_add
    prompt = chat_prompt(smollm2.tokenizer, "Hello")
    try:
        with pytest.raises(OverflowError):
            asyncio.run(collect(engine, "broken", prompt, SamplingParams(max_tokens=4)))
        after = asyncio.run(collect(engine, "fine", prompt, SamplingParams(temperature=0.0, max_tokens=4)))
        assert after[1][0]
    finally:
        engine.shutdown()


def test_the_cached_prefix_digest_holds_a_finished_prompts_blocks_for_its_team_only(engine, smollm2):
    """What a replica reports to the router (engine.cached_prefix_digest) is what a later prompt would hit."""
    from app.scaleout.prefix_routing import digest, matched_blocks, prompt_blocks
    from engine.tenancy import Tenancy

    prompt = chat_prompt(smollm2.tokenizer, "Summarise our refund policy. " * 12)
    team = Tenancy(team="team:7")

    async def run() -> None:
        async for _ in engine.generate("digest", prompt, SamplingParams(max_tokens=2), team):
            pass

    asyncio.run(run())
    held = digest(engine.cached_prefix_digest())
    size = engine.config.block_size
    assert matched_blocks(prompt_blocks(prompt, size, team.cache_root), held) == (len(prompt) - 1) // size
    other = Tenancy(team="team:8").cache_root
    assert matched_blocks(prompt_blocks(prompt, size, other), held) == 0


def test_the_engine_thread_waits_at_most_a_fifth_of_a_millisecond_for_the_gil(smollm2):
    """The engine thread needs the GIL between its native kernels while the event loop streams tokens; with
    Python's default 5 ms a decode step (3-4 ms at one stream) could stall a whole step's length on it. A host's
    smaller interval is left as it is."""
    before = sys.getswitchinterval()
    try:
        for host, expected in ((0.005, GIL_SWITCH_INTERVAL_S), (0.0001, 0.0001)):
            sys.setswitchinterval(host)
            engine = AsyncEngine.start(EngineConfig(num_kv_blocks=16), loaded=smollm2)
            engine.shutdown()
            assert sys.getswitchinterval() == pytest.approx(expected, rel=0.02)  # kept in whole microseconds
        assert GIL_SWITCH_INTERVAL_S <= 0.0002
    finally:
        sys.setswitchinterval(before)
