"""The constrained-decoding hook: a guide's mask binds every sampling setting, and `done` stops."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from tests.support.engine import chat_prompt, make_engine, run_to_completion


class DigitsGuide:
    """Allows only the given tokens, and is complete after `length` of them."""

    def __init__(self, allowed: list[int], vocab: int, length: int) -> None:
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[allowed] = True
        self.length = length
        self.seen: list[int] = []

    def allowed_tokens(self):
        return self.mask

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)

    @property
    def done(self) -> bool:
        return len(self.seen) >= self.length


class DigitsFactory:
    def __init__(self, allowed, vocab, length):
        self.allowed, self.vocab, self.length = allowed, vocab, length
        self.made: list[DigitsGuide] = []

    def new_guide(self):
        guide = DigitsGuide(self.allowed, self.vocab, self.length)
        self.made.append(guide)
        return guide


def test_guided_sequences_use_only_allowed_tokens_and_stop_when_done(smollm2):
    tokenizer = smollm2.tokenizer
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    factory = DigitsFactory(digits, smollm2.shape.vocab_size, length=5)
    engine = make_engine(smollm2, num_kv_blocks=64)
    prompt = chat_prompt(tokenizer, "Write a poem about cats.")
    params = SamplingParams(
        n=3,
        temperature=1.5,
        top_p=0.95,
        seed=3,
        max_tokens=50,
        logit_bias={tokenizer.convert_tokens_to_ids("Cats"): 100.0},
        guide_factory=factory,
    )
    results = run_to_completion(engine, [prompt], params)
    assert len(factory.made) == 3  # one guide per sequence
    for tokens in results["r0"].values():
        assert len(tokens) == 5 and set(tokens) <= set(digits)
    assert engine.blocks.num_used_blocks == 0
