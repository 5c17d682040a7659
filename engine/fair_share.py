"""Per-team virtual token counters: who has been served least, in the spirit of VTC (Sheng et al., OSDI 2024).

A team's counter grows by the weighted tokens it is served, divided by its weight: `input_weight` per prompt
token (charged once, when the request is first admitted, however often it is recomputed) and
`output_weight` per generated token. The scheduler admits the waiting request of the team with the lowest
counter, and may preempt the team with the highest. A team that turns up (or comes back from idle) starts
level with the least-served active team, never below it: idle time earns no credit, so a team can't save
up service and then starve the others.

It only counts; the scheduler decides.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_S = 60  # "tokens served over the last minute", in one-second buckets


@dataclass
class TeamCounts:
    """What one team has now and has had: for the scheduler's decisions and for /metrics."""

    active: int = 0  # unfinished sequences in the engine
    service: float = 0.0  # the virtual counter: weighted tokens / weight, plus the lifts on joining
    prompt_tokens: int = 0  # prompt tokens admitted, cumulative (a recompute is not counted again)
    output_tokens: int = 0  # tokens generated, cumulative
    recent: deque[tuple[int, int]] = field(default_factory=deque)  # (second, tokens served in it), oldest first

    def tokens_in_window(self, now_s: int) -> int:
        while self.recent and self.recent[0][0] <= now_s - WINDOW_S:
            self.recent.popleft()
        return sum(tokens for _, tokens in self.recent)


class TeamLedger:
    def __init__(
        self, input_weight: float = 1.0, output_weight: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.teams: dict[str, TeamCounts] = {}
        self.weights: dict[str, float] = {}
        self._level_when_idle = 0.0  # the counter of the last team to go idle

    def service(self, team: str) -> float:
        counts = self.teams.get(team)
        return counts.service if counts is not None else 0.0

    def set_weight(self, team: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError("a team's weight must be positive")
        self.weights[team] = weight

    def join(self, team: str) -> None:
        """One more sequence of `team` is in the engine."""
        counts = self.teams.setdefault(team, TeamCounts())
        if counts.active == 0:
            others = [c.service for name, c in self.teams.items() if c.active > 0 and name != team]
            counts.service = max(counts.service, min(others) if others else self._level_when_idle)
        counts.active += 1

    def leave(self, team: str) -> None:
        counts = self.teams[team]
        counts.active -= 1
        assert counts.active >= 0, f"team {team!r} left more often than it joined"
        if counts.active == 0:
            self._level_when_idle = counts.service

    def charge(self, team: str, *, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        counts = self.teams.setdefault(team, TeamCounts())
        counts.prompt_tokens += prompt_tokens
        counts.output_tokens += output_tokens
        second = int(self.clock())
        if counts.recent and counts.recent[-1][0] == second:
            counts.recent[-1] = (second, counts.recent[-1][1] + prompt_tokens + output_tokens)
        else:
            counts.recent.append((second, prompt_tokens + output_tokens))
            counts.tokens_in_window(second)  # drops what has left the window
        weighted = self.input_weight * prompt_tokens + self.output_weight * output_tokens
        counts.service += weighted / self.weights.get(team, 1.0)
