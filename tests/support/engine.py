"""Helpers for driving the synchronous engine in tests."""

from __future__ import annotations

from pathlib import Path

import torch

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

# What the tests' tiny random models share: SmolLM2's vocabulary and special tokens, two layers, grouped heads.
TINY_LLAMA = {
    "vocab_size": 49_152,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


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


def hf_greedy_tokens(model, prompt: list[int], max_new_tokens: int, **options) -> list[int]:
    """The tokens HF transformers' `generate` adds to `prompt` greedily: the correctness oracle of the engine
    tests. `options` go to `generate` (pad_token_id is 2, SmolLM2's and the tiny models' end of text)."""
    options.setdefault("pad_token_id", 2)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **options,
        )
    return out[0, len(prompt) :].tolist()


def tiny_llama_checkpoint(folder: Path, tokenizer, **config) -> Path:
    """A random Llama (seed 0) of TINY_LLAMA's shape saved as a checkpoint folder, with `tokenizer` (SmolLM2's)
    saved beside it; `config`: the LlamaConfig fields a test chooses (its widths, a tied head or not, the spread
    of the weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config})).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
