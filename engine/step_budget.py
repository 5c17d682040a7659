"""The token budget of one step, kept to about `max_step_seconds` of measured time.

A request that arrives while a step runs waits for that step to end before its prompt can be scheduled, so
the longest step is the floor under every newcomer's time to first token. `max_num_batched_tokens` bounds a
step in tokens, but what a token costs depends on the model and the machine: on a 2-core CPU a 2048-token
prefill step of the embedded 135M model takes about 3 s, of a 1B model over 15 s. So the budget also follows
the measured cost of a token: after each step with at least MEASURE_MIN_TOKENS tokens, seconds per token go
into a moving average, and the budget is `max_step_seconds` over that, between FLOOR_TOKENS and
`max_num_batched_tokens`. Large steps cost little throughput on a CPU (prefill is compute-bound: a 512-token
chunk reads the weights once more than a 2048-token one, which at 135M is a few milliseconds), and on a GPU a
step of 2048 tokens takes milliseconds, so the budget stays at `max_num_batched_tokens` there.
Until a step has been measured the budget is the floor: a fresh server's first burst of prompts took a whole
2048-token step (a 1B Q4_K_M on a 2-core EPYC Zen 4, 8 x 300-token prompts: 15 s, every newcomer waiting it
out), where a first step of the floor (1.9 s there) measures the cost and costs a GPU one short step.
"""

from __future__ import annotations

# Steps smaller than this are dominated by fixed costs (weights read once, sampling, Python): their seconds
# per token would overstate a prefill token's cost.
MEASURE_MIN_TOKENS = 128
# Never below this: a decode step of many sequences plus a newcomer's first chunk must fit.
FLOOR_TOKENS = 256
SMOOTHING = 0.3  # weight of the newest step in the moving average


class StepBudget:
    def __init__(self, max_num_batched_tokens: int, max_step_seconds: float) -> None:
        self.max_tokens = max_num_batched_tokens
        self.max_step_seconds = max_step_seconds
        self.seconds_per_token: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` tokens took `seconds` (schedule to sampled tokens)."""
        if num_tokens < MEASURE_MIN_TOKENS or seconds <= 0:
            return
        latest = seconds / num_tokens
        if self.seconds_per_token is None:
            self.seconds_per_token = latest
        else:
            self.seconds_per_token += SMOOTHING * (latest - self.seconds_per_token)

    @property
    def tokens(self) -> int:
        """The budget of the next step."""
        if self.max_step_seconds <= 0:
            return self.max_tokens
        floor = min(FLOOR_TOKENS, self.max_tokens)
        if self.seconds_per_token is None:  # nothing measured yet: a short first step, which measures
            return floor
        fitting = int(self.max_step_seconds / self.seconds_per_token)
        return max(min(fitting, self.max_tokens), floor)
