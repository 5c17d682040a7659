"""The correctness oracle for the engine tests: the same weights through HF transformers."""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import hf_greedy_tokens


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """The same weights through HF transformers: the correctness oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm2):
    """Greedy continuation by HF `generate`, memoised per (prompt, length)."""
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_token_ids), max_new_tokens)
        if key not in memo:
            memo[key] = hf_greedy_tokens(
                hf_smollm2, prompt_token_ids, max_new_tokens, pad_token_id=hf_smollm2.config.eos_token_id
            )
        return memo[key]

    return generate
