"""Prompt-lookup (n-gram) speculative decoding: drafts from a sequence's own text, no second model.

A sequence that repeats itself (code being rewritten, a quoted document, a list with a pattern) often goes
on the way an earlier occurrence of its last few tokens did. Before each step the drafter proposes, for a
sequence about to decode, the k tokens that followed the most recent earlier occurrence of its last n
tokens (n from MAX_NGRAM down to MIN_NGRAM). The scheduler gives the drafts KV slots after the decode
token, the runner computes all k + 1 positions in the one forward pass (query rows, causal among
themselves), and the engine keeps the drafts the model agrees with (engine/sampler.py: argmax for
greedy, rejection sampling otherwise) plus the model's own next token, then rolls the KV of the rest
back. Greedy output is what it would be without drafts; sampled output keeps its distribution.

Drafting pays while extra rows are cheap: at small batches a decode step's time goes mostly into reading
the weights, whatever the rows. Hence the batch-size threshold, and a pause for a sequence whose recent
drafts were mostly rejected.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.request import Request
from engine.runner import uses_decode_graphs

MAX_NGRAM = 3
# A match on a single token is mostly chance: drafts from one were rarely accepted in chat, and on the
# 2-core CPU a step verifying 2 / 4 drafts took about 1.3x / 1.7x a plain decode step (int4 and float32,
# SmolLM2-135M), so a draft pays only when about a fifth of its tokens or more are accepted.
MIN_NGRAM = 2
# A sequence pauses drafting when the decayed share of its drafts accepted falls below this ...
MIN_ACCEPTANCE = 0.2
# ... (judged once it has drafted this many tokens, decayed) for PAUSE_STEPS steps, doubled after each
# pause that did not help (up to MAX_PAUSE_STEPS), then tries again: text may start repeating later.
MIN_DRAFTED_TO_JUDGE = 8.0
PAUSE_STEPS = 16
MAX_PAUSE_STEPS = 256
DECAY = 0.8  # per drafted step, of the acceptance tallies: what the last few steps did counts most


class NgramIndex:
    """Where each n-gram (n <= max_n) of a growing token list last ended; fed the new tokens on each call."""

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = 1) -> None:
        self.max_n = max_n
        self.min_n = min_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams that end (exclusive) at or before this position are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (which only ever grows between calls); [] without a match."""
        length = len(tokens)
        # Every n-gram but those ending at the very end, which would only find themselves.
        for stop in range(self.num_indexed + 1, length):
            for n in range(1, min(self.max_n, stop) + 1):
                self.last_end[tuple(tokens[stop - n : stop])] = stop
        self.num_indexed = max(self.num_indexed, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            found = self.last_end.get(tuple(tokens[length - n :]))
            if found is not None:
                end = found
                # Copied LZ77-style: when the match ends near the end, the text repeats with period
                # length - end, and the draft goes on repeating it.
                draft: list[int] = []
                for i in range(k):
                    position = end + i
                    draft.append(tokens[position] if position < length else draft[position - length])
                return draft
        return []


@dataclass
class _SequenceDrafts:
    index: NgramIndex = field(default_factory=lambda: NgramIndex(MAX_NGRAM, MIN_NGRAM))
    drafted: float = 0.0  # decayed tallies of the sequence's recent drafts ...
    accepted: float = 0.0  # ... and of those the model agreed with
    paused_until_step: int = 0
    next_pause: int = PAUSE_STEPS


class NgramSpeculator:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        enabled = config.speculation == "ngram"
        if config.speculation == "auto":
            enabled = not uses_decode_graphs(config, config.torch_device)
        self.enabled = enabled
        self.k = config.num_speculative_tokens
        self.max_batch = config.speculation_max_batch
        self.max_model_len = max_model_len
        self.step = 0
        self._sequences: weakref.WeakKeyDictionary[Request, _SequenceDrafts] = weakref.WeakKeyDictionary()

    def propose(self, running: list[Request]) -> None:
        """Sets `draft_token_ids` of each running sequence worth drafting for this step; clears the rest's."""
        self.step += 1
        drafting = self.enabled and len(running) <= self.max_batch
        for request in running:
            request.draft_token_ids = self._draft(request) if drafting else []

    def _draft(self, request: Request) -> list[int]:
        params = request.params
        if (
            request.num_tokens - request.num_computed_tokens != 1  # not about to decode
            or not request.output_token_ids
            or request.guide is not None  # a guide's state advances token by token
            # A seeded sample must not depend on whether other traffic kept the batch small enough to draft.
            or (params.seed is not None and not params.greedy)
        ):
            return []
        # The step emits at most drafts + 1 tokens, and never past max_tokens or the context.
        room = min(
            self.k,
            (params.max_tokens or 0) - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if room <= 0:
            return []
        state = self._sequences.get(request)
        if state is None:
            state = self._sequences[request] = _SequenceDrafts()
        if self.step < state.paused_until_step:
            return []
        return state.index.propose(request.all_token_ids, room)

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        """What the model made of a sequence's drafts; pauses its drafting when they keep being rejected."""
        state = self._sequences.get(request)
        if state is None or not drafted:
            return
        state.drafted = state.drafted * DECAY + drafted
        state.accepted = state.accepted * DECAY + accepted
        if state.drafted < MIN_DRAFTED_TO_JUDGE:
            return
        if state.accepted < MIN_ACCEPTANCE * state.drafted:
            state.paused_until_step = self.step + state.next_pause
            state.next_pause = min(state.next_pause * 2, MAX_PAUSE_STEPS)
            state.drafted = state.accepted = 0.0
        else:
            state.next_pause = PAUSE_STEPS
