"""LoRA adapters on the embedded SmolLM2: the base and three PEFT adapters in one batch, each equal to HF
transformers + PEFT (float32) token for token, with a shared system prompt in the prefix cache and a pool
that holds two adapters (so requests wait for a slot and adapters are evicted and loaded again)."""

from __future__ import annotations

import copy

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.test_lora import make_adapter, run_mixed
from tests.support.engine import QUESTIONS, chat_prompt, hf_greedy_tokens

pytestmark = pytest.mark.real_model

MAX_NEW = 8
ADAPTERS = {
    "support": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "legal": dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "sales": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"]),
}
SYSTEM = "You are the support assistant of a company that sells bicycles. Answer briefly and politely. " * 2


def test_embedded_model_mixed_batch_matches_hf_peft(smollm2, hf_smollm2, tmp_path):
    from peft import PeftModel

    folders = {
        name: make_adapter(hf_smollm2, tmp_path / name, seed, **settings)
        for seed, (name, settings) in enumerate(ADAPTERS.items())
    }
    names: list[str | None] = [None, *ADAPTERS]
    jobs = []
    for number, question in enumerate(QUESTIONS[:4]):
        prompt = chat_prompt(smollm2.tokenizer, question, system=SYSTEM)
        jobs.extend((names[(number + k) % len(names)], prompt) for k in range(len(names)))
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, max_loras=2), smollm2)
    for name, folder in folders.items():
        engine.register_adapter(name, str(folder))
    results = run_mixed(engine, jobs, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert engine.scheduler.counters.prefix_cache_hits > 0
    assert engine.adapters.stats.evictions > 0
    expected: dict[str | None, list[list[int]]] = {}
    for adapter in names:
        model = (
            hf_smollm2 if adapter is None else PeftModel.from_pretrained(copy.deepcopy(hf_smollm2), folders[adapter])
        )
        prompts = [prompt for name, prompt in jobs if name == adapter]
        expected[adapter] = [hf_greedy_tokens(model, prompt, MAX_NEW, min_new_tokens=MAX_NEW) for prompt in prompts]
        del model
    seen: dict[str | None, int] = {}
    for (adapter, _), tokens in zip(jobs, results, strict=True):
        index = seen.get(adapter, 0)
        seen[adapter] = index + 1
        assert tokens == expected[adapter][index], f"adapter {adapter} diverged from HF + PEFT"
    assert len({tuple(expected[name][0]) for name in names}) == len(names), "adapters must change the output"
