"""Helpers for driving the synchronous engine in tests."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a short poem about the sea and the wind that moves the waves at night.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits.",
    "What is 12 times 12? Answer with a number and then explain how you computed it step by step.",
    "Translate 'good morning' into Spanish, French and German, and say which language is hardest to learn "
    "for an English speaker, giving reasons drawn from grammar, pronunciation and vocabulary.",
    "Name a famous scientist and describe one of their discoveries in detail, including the year it was made "
    "and why it mattered for the people who lived at the time and for us today. " * 3,
]


def chat_prompt(tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, max_steps: int = 10_000):
    """Submit all prompts at once, step until done; returns {request_id: {index: token ids}}."""
    results: dict[str, dict[int, list[int]]] = {}
    for number, prompt in enumerate(prompts):
        engine.add_request(f"r{number}", prompt, params)
        results[f"r{number}"] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            for delta in output.deltas:
                results[output.request_id].setdefault(delta.index, []).extend(delta.token_ids)
    assert not engine.has_unfinished, "engine did not finish"
    return results


def make_engine(loaded, **settings) -> LLMEngine:
    settings.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(**settings), loaded)
