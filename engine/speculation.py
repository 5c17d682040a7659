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
# A match on a single token is mostly chance: drafts from one were rarely accepted in chat.
MIN_NGRAM = 2
# What each draft row adds to a step, as a share of a plain decode step: on the 2-core CPU a step verifying
# 2 / 4 drafts took about 1.3x / 1.7x one without (SmolLM2-135M, int4 and float32, interleaved medians); in
# the fused int4 step the linears cost 1.2x / 1.4x / 1.7-2x at 2 / 3 / 5 rows what they cost at 1.
DRAFT_ROW_COST = 0.18
# Each sequence's chance that a draft token is accepted, after the one before it was, is estimated from its
# recent drafts (decayed per drafted step) on top of a prior of PRIOR_ACCEPTED in PRIOR_ACCEPTED +
# PRIOR_REJECTED; it drafts as many tokens as maximise the expected tokens per unit of step time ...
DECAY = 0.8
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
# ... and none when no draft length beats a plain step: then it pauses for PAUSE_STEPS steps, doubled
# after each pause that changed nothing (up to MAX_PAUSE_STEPS), and tries again from the prior.
PAUSE_STEPS = 16
MAX_PAUSE_STEPS = 256


def best_draft_length(acceptance: float, max_length: int, row_cost: float = DRAFT_ROW_COST) -> int:
    """The draft length with the most expected tokens per step time, 0 when a plain step does better.

    With each draft token accepted (after the previous one) with probability a, a step with k drafts
    yields 1 + a + ... + a^k tokens, at a cost of 1 + row_cost * k plain steps."""
    best, best_rate = 0, 1.0
    tokens, power = 1.0, 1.0
    for length in range(1, max_length + 1):
        power *= acceptance
        tokens += power
        rate = tokens / (1 + row_cost * length)
        if rate > best_rate:
            best, best_rate = length, rate
    return best


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
    accepted: float = 0.0  # decayed count of accepted draft tokens ...
    rejected: float = 0.0  # ... and of steps that ended on a rejected one
    paused_until_step: int = 0
    next_pause: int = PAUSE_STEPS

    @property
    def acceptance(self) -> float:
        accepted = self.accepted + PRIOR_ACCEPTED
        return accepted / (accepted + self.rejected + PRIOR_REJECTED)


class NgramSpeculator:
    def __init__(self, config: EngineConfig, max_model_len: int, fused_decode: bool = False) -> None:
        """`fused_decode`: a plain decode step runs as one native call (kernels/decode_stack.py, packed weights)."""
        enabled = config.speculation == "ngram"
        if config.speculation == "auto":
            # Not where decode steps replay CUDA graphs: a drafted step leaves them for the per-op path. Where
            # they run as one native call, the verification rows run in it too (engine/runner.py). Nor in
            # bfloat16: there the verification rows' attention on the per-op path (the prefill kernel) rounds
            # differently from the decode kernel's, enough to flip a near-tie, and a greedy reply would then
            # depend on whether the batch was small enough to draft.
            enabled = config.dtype == "float32" and not uses_decode_graphs(config, config.torch_device)
        self.enabled = enabled
        self.k = config.num_speculative_tokens
        # With packed weights a step's extra rows cost arithmetic more than weight reads, so a draft row costs
        # about as much of a step at any batch, while a sequence's share of the step shrinks with the batch:
        # drafts are weighed against that share (4 int4 streams drafting as one does went 381 -> 318 tok/s).
        self.row_cost_grows_with_batch = fused_decode
        self.max_batch = config.speculation_max_batch
        self.max_model_len = max_model_len
        self.step = 0
        self._sequences: weakref.WeakKeyDictionary[Request, _SequenceDrafts] = weakref.WeakKeyDictionary()

    def propose(self, running: list[Request]) -> None:
        """Sets `draft_token_ids` of each running sequence worth drafting for this step; clears the rest's."""
        self.step += 1
        drafting = self.enabled and len(running) <= self.max_batch
        row_cost = DRAFT_ROW_COST * (len(running) if self.row_cost_grows_with_batch else 1)
        for request in running:
            request.draft_token_ids = self._draft(request, row_cost) if drafting else []

    def _draft(self, request: Request, row_cost: float) -> list[int]:
        params = request.params
        if (
            request.num_tokens - request.num_computed_tokens != 1  # not about to decode
            or not request.output_token_ids
            or request.guide is not None  # a guide's state advances token by token
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
        length = best_draft_length(state.acceptance, room, row_cost)
        # not for want of room, nor because the batch is large: its drafts have not been paying
        if length == 0 and room == self.k and best_draft_length(state.acceptance, room) == 0:
            state.paused_until_step = self.step + state.next_pause
            state.next_pause = min(state.next_pause * 2, MAX_PAUSE_STEPS)
            state.accepted = state.rejected = 0.0
            return []
        return state.index.propose(request.all_token_ids, length) if length else []

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        """What the model made of a sequence's drafts: the tallies its next draft lengths come from."""
        state = self._sequences.get(request)
        if state is None or not drafted:
            return
        state.accepted = state.accepted * DECAY + accepted
        state.rejected = state.rejected * DECAY + (accepted < drafted)
        if accepted:
            state.next_pause = PAUSE_STEPS
