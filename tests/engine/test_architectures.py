"""Every family tokenmill runs gives HF transformers' greedy tokens on a tiny random checkpoint: in a batch of
prompts longer than any sliding window, with prefix sharing, preemption (recompute and swap) and speculation on
the way, and sampled replies stay reproducible under a seed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams
from engine.speculation import NgramIndex
from tests.engine.test_engine_correctness import LONG_SYSTEM, assert_all_blocks_free
from tests.support.engine import QUESTIONS, TINY_LLAMA, chat_prompt, hf_greedy_tokens, make_engine, run_to_completion

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
WINDOW = 24  # shorter than every prompt below, so sliding-window layers really cut
GEMMA_WINDOW = 6  # Gemma's capped scores spread attention thinly: a narrow window is what changes its tokens

TINY = {
    **TINY_LLAMA,
    "hidden_size": 64,
    "intermediate_size": 96,
    "initializer_range": 0.5,  # peaked logits: greedy choices far from ties
}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 24, "tie_word_embeddings": True},  # head_dim not hidden / heads
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": GEMMA_WINDOW,
        "initializer_range": 0.1,  # at 0.5 the embedding scale drowns the layers: one token over and over
        "attn_logit_softcapping": 5.0,  # small caps, so capping changes the scores these weights give
        "final_logit_softcapping": 8.0,
    },
    "gemma3_text": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": GEMMA_WINDOW,
        "initializer_range": 0.1,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
        },
    },
    "phi3": {"partial_rotary_factor": 0.75},  # rope over 12 of 16 head dims, as Phi-4-mini's 96 of 128
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],  # one dense layer among the sparse ones
    },
}


def build_tiny(folder: Path, family: str, tokenizer: Any) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**TINY, "vocab_size": len(tokenizer), **FAMILIES[family]}
    config = AutoConfig.for_model(family, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights (Gemma's are an offset from 1)
                parameter.copy_(torch.randn_like(parameter) * 0.3 + (0.0 if gemma else 1.0))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, smollm2) -> tuple[str, LoadedModel, Any]:
    from transformers import AutoModelForCausalLM

    name = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{name}")
    build_tiny(folder, name, smollm2.tokenizer)
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32", data_dir=str(folder.parent)))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return name, loaded, hf


def hf_greedy(hf: Any, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    return hf_greedy_tokens(hf, prompt, max_new)


def prompts_for(loaded: LoadedModel, system: str | None = None) -> list[list[int]]:
    return [chat_prompt(loaded.tokenizer, question, system) for question in QUESTIONS]


def assert_greedy_matches(results: dict[str, dict[int, list[int]]], prompts: list[list[int]], hf: Any) -> None:
    for number, prompt in enumerate(prompts):
        expected = hf_greedy(hf, prompt)
        for index, tokens in results[f"r{number}"].items():
            assert tokens == expected, f"request {number} (sequence {index}, {len(prompt)} prompt tokens) diverged"


def test_batch_matches_hf(family):
    name, loaded, hf = family
    prompts = prompts_for(loaded)
    assert max(len(p) for p in prompts) > 3 * WINDOW
    engine = make_engine(loaded, num_kv_blocks=256)
    results = run_to_completion(engine, prompts, GREEDY)
    assert_greedy_matches(results, prompts, hf)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_output_exact(family, mode):
    name, loaded, hf = family
    prompts = prompts_for(loaded)
    longest = max(len(p) for p in prompts) + MAX_NEW
    engine = make_engine(loaded, num_kv_blocks=-(-longest // 16) + 4, preemption_mode=mode, enable_prefix_caching=False)
    results = run_to_completion(engine, prompts, GREEDY)
    counters = engine.scheduler.counters
    assert (counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute) > 0
    assert_greedy_matches(results, prompts, hf)
    assert_all_blocks_free(engine)


def test_shared_prefix_and_chunked_prefill_match_hf(family):
    name, loaded, hf = family
    prompts = prompts_for(loaded, system=LONG_SYSTEM)[:4]
    engine = make_engine(loaded, num_kv_blocks=256, max_num_batched_tokens=64)
    run_to_completion(engine, prompts[:1], GREEDY)  # warms the cache with the shared system prompt
    results = run_to_completion(engine, prompts, GREEDY)
    assert engine.scheduler.counters.prefix_cache_hits > 0
    assert_greedy_matches(results, prompts, hf)
    assert_all_blocks_free(engine)


def test_speculation_keeps_greedy_output(family, monkeypatch):
    """Random weights rarely repeat themselves, so n-gram drafts would seldom come: the drafter here proposes
    HF's own next tokens with the last one wrong, so every drafted step verifies accepted and rejected rows."""
    name, loaded, hf = family
    prompts = prompts_for(loaded)[:3]
    expected = {tuple(prompt): hf_greedy(hf, prompt) for prompt in prompts}

    def oracle_drafts(index: NgramIndex, tokens: list[int], k: int) -> list[int]:
        prompt = next(p for p in expected if tuple(tokens[: len(p)]) == p)
        done = len(tokens) - len(prompt)
        drafts = list(expected[prompt][done : done + k])
        if len(drafts) >= 2:
            drafts[-1] = (drafts[-1] + 1) % loaded.shape.vocab_size
        return drafts

    monkeypatch.setattr(NgramIndex, "propose", oracle_drafts)
    engine = make_engine(loaded, num_kv_blocks=256, speculation="ngram", speculation_max_batch=8)
    results = run_to_completion(engine, prompts, GREEDY)
    stats = engine.stats
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert_greedy_matches(results, prompts, hf)
    assert_all_blocks_free(engine)  # rejected drafts' slots included


def test_seeded_sampling_is_reproducible(family):
    name, loaded, hf = family
    prompts = prompts_for(loaded)[:2]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_NEW)
    first = run_to_completion(make_engine(loaded, num_kv_blocks=256), prompts, params)
    second = run_to_completion(make_engine(loaded, num_kv_blocks=256, max_num_batched_tokens=32), prompts, params)
    assert first == second


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_folder(request, tmp_path_factory, smollm2) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}-q")
    build_tiny(folder, request.param, smollm2.tokenizer)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_packed_experts_answer_as_the_float_model_and_alike_in_any_batch(moe_folder, quantization):
    """Each expert's linears packed like any dense layer's: a reply is the same alone or in a batch (experts run
    per token group, rows never mix), and with int8 the first token mostly agrees with HF on float weights.
    (int4 on these Gaussian random weights moves near-ties: a dense tiny Mistral agreed on 1 of 8 too.)"""
    folder, hf = moe_folder
    config = EngineConfig(model=str(folder), dtype="float32", quantization=quantization, data_dir=str(folder.parent))
    loaded = load_model(config)
    packed = [linear for layer in loaded.model.layers for linear in layer.linears]
    assert all(type(linear).__name__ == "PackedLinear" for linear in packed) and len(packed) > 4 * 2
    prompts = prompts_for(loaded)
    settings = {"dtype": "float32", "quantization": quantization, "num_kv_blocks": 256}
    together = run_to_completion(make_engine(loaded, **settings), prompts, GREEDY)
    agree = 0
    for number, prompt in enumerate(prompts):
        alone = run_to_completion(make_engine(loaded, **settings), [prompt], GREEDY)["r0"][0]
        assert together[f"r{number}"][0] == alone
        agree += alone[0] == hf_greedy(hf, prompt, 1)[0]
    if quantization == "int8":
        assert agree >= len(prompts) - 2  # measured 7 of 8 (a dense tiny Mistral: 6 of 8)
