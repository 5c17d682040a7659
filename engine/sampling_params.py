"""What a caller may ask of one generation, validated with the offending parameter named."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    """A bad sampling parameter; `param` names it the way the OpenAI API does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20
MAX_N = 16


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: until the context is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k >= 0: the chosen token plus k alternatives
    skip_special_tokens: bool = True
    # Constrained decoding: makes one `engine.guide.Guide` per sequence (JSON schema, tool calls, ...).
    guide_factory: object | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParameter(param, message)

        def finite(value: float) -> bool:
            return isinstance(value, (int, float)) and math.isfinite(value)

        check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"n must be an integer between 1 and {MAX_N}")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "max_tokens must be a positive integer",
        )
        check(
            finite(self.temperature) and 0.0 <= self.temperature <= 2.0,
            "temperature",
            "temperature must be between 0 and 2",
        )
        check(finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "top_k must be -1, 0 or a positive integer")
        check(finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "min_p must be between 0 and 1")
        check(
            finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "presence_penalty must be between -2 and 2",
        )
        check(
            finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "frequency_penalty must be between -2 and 2",
        )
        check(
            finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            "repetition_penalty must be in (0, 2]",
        )
        check(
            all(isinstance(t, int) and finite(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
            "logit_bias",
            "logit_bias maps token ids to values between -100 and 100",
        )
        check(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
            "seed",
            "seed must be a 64-bit integer",
        )
        check(
            len(self.stop) <= 4 and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop takes up to 4 non-empty strings",
        )
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative integers",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            "min_tokens must be a non-negative integer",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "min_tokens must not exceed max_tokens",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"logprobs must be between 0 and {MAX_LOGPROBS}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
