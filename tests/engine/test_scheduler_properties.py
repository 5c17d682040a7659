"""Scheduler invariants on a tiny random Llama: budgets hold, blocks balance, outputs don't depend on batching."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir)))


request_specs = st.lists(
    st.tuples(
        st.integers(1, 40),  # prompt length
        st.integers(1, 12),  # max tokens
        st.integers(1, 2),  # n
        st.booleans(),  # starts with the shared prefix
        st.one_of(st.none(), st.integers(1, 6)),  # abort after this many steps
    ),
    min_size=1,
    max_size=6,
)
engine_settings = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([8, 16]),
        "extra_blocks": st.integers(0, 6),
        "max_num_seqs": st.integers(2, 6),
        "max_num_batched_tokens": st.sampled_from([16, 24, 64]),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "enable_prefix_caching": st.booleans(),
    }
)
SHARED = [7 + (i * 31) % 900 for i in range(24)]


def build_prompts(specs):
    prompts = []
    for number, (length, _, _, shared, _) in enumerate(specs):
        own = [50 + (number * 97 + i * 13) % 4000 for i in range(length)]
        prompts.append((SHARED + own)[:length] if shared else own)
    return prompts


def run(engine, specs, prompts, check=None):
    outputs: dict[str, dict[int, list[int]]] = {}
    for number, ((_, max_tokens, n, _, _), prompt) in enumerate(zip(specs, prompts)):
        params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"r{number}", prompt, params)
        outputs[f"r{number}"] = {}
    finish: dict[str, dict[int, str]] = {key: {} for key in outputs}
    step = 0
    while engine.has_unfinished:
        step += 1
        assert step < 2000, "the engine stopped making progress"
        for number, spec in enumerate(specs):
            if spec[4] == step and f"r{number}" in engine.groups:
                result = engine.abort(f"r{number}")
                for delta in result.deltas:
                    finish[f"r{number}"][delta.index] = delta.finish_reason
        for output in engine.step():
            for delta in output.deltas:
                outputs[output.request_id].setdefault(delta.index, []).extend(delta.token_ids)
                if delta.finish_reason:
                    finish[output.request_id][delta.index] = delta.finish_reason
        if check:
            check(engine)
    return outputs, finish


def check_step(engine: LLMEngine) -> None:
    scheduler, blocks = engine.scheduler, engine.blocks
    stats = engine.stats
    assert stats.scheduled_tokens_last_step <= engine.config.max_num_batched_tokens
    assert len(scheduler.running) <= engine.config.max_num_seqs
    expected = [0] * blocks.num_blocks
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
        assert len(request.block_ids) * blocks.block_size >= request.num_computed_tokens
        for block_id in request.block_ids:
            expected[block_id] += 1
    for request in list(scheduler.waiting) + list(scheduler.swapped):
        assert request.block_ids == []
    assert blocks.ref_counts == expected


@given(specs=request_specs, settings_=engine_settings)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_batching_gives_the_same_tokens_and_returns_every_block(tiny, specs, settings_):
    prompts = build_prompts(specs)
    block_size = settings_.pop("block_size")
    extra = settings_.pop("extra_blocks")
    largest = max(len(p) + spec[1] for p, spec in zip(prompts, specs))
    num_blocks = -(-largest // block_size) + 1 + extra
    engine = LLMEngine(EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **settings_), tiny)
    outputs, finish = run(engine, specs, prompts, check_step)

    reference = LLMEngine(EngineConfig(num_kv_blocks=512, enable_prefix_caching=False), tiny)
    expected, _ = run(reference, [(*s[:4], None) for s in specs], prompts)

    for number, spec in enumerate(specs):
        key = f"r{number}"
        for index in range(spec[2]):
            tokens = outputs[key].get(index, [])
            if finish[key].get(index) == "abort":
                assert tokens == expected[key][index][: len(tokens)]
            else:
                assert finish[key][index] == "length"
                assert tokens == expected[key][index]
    assert blocks_all_free(engine)


def blocks_all_free(engine: LLMEngine) -> bool:
    blocks = engine.blocks
    return blocks.num_free_blocks == blocks.num_blocks and len(blocks.free_cpu_blocks) == blocks.num_cpu_blocks


def test_request_larger_than_the_pool_is_rejected_not_queued(tiny):
    from engine.llm_engine import EngineRejected

    engine = LLMEngine(EngineConfig(num_kv_blocks=4, block_size=16), tiny)
    with pytest.raises(EngineRejected) as rejected:
        engine.add_request("big", list(range(10, 60)), SamplingParams(max_tokens=20))
    assert rejected.value.code == "context_length_exceeded"
    assert not engine.has_unfinished


def test_prompt_over_the_context_is_rejected(tiny):
    from engine.llm_engine import EngineRejected

    engine = LLMEngine(EngineConfig(num_kv_blocks=512), tiny)
    with pytest.raises(EngineRejected) as rejected:
        engine.add_request("long", [5] * 500, SamplingParams(max_tokens=100))
    assert rejected.value.code == "context_length_exceeded" and "512" in str(rejected.value)
