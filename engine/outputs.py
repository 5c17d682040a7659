"""What the engine hands back: per-step deltas for each of a request's n sequences."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class SequenceDelta:
    index: int  # which of the request's n sequences
    text: str  # new text since the last delta (stop strings already cut)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"


@dataclass
class RequestOutput:
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    deltas: list[SequenceDelta]
    finished: bool = False  # all n sequences have finished
    error: str | None = None  # set when the engine failed this request
    scheduled_at: float | None = None  # time.monotonic() when the engine first gave it a step (None: not yet)
