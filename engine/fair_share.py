"""Per-team virtual token counters: who has been served least, in the spirit of VTC (Sheng et al., OSDI 2024).

A team's counter grows by the weighted tokens it is served, divided by its weight: `input_weight` per prompt
token (charged once, when the request is first admitted, however often it is recomputed) and
`output_weight` per generated token. The scheduler admits the waiting request of the team with the lowest
counter, and may preempt the team with the highest. A team that turns up (or comes back from idle) starts
level with the least-served active team, never below it: idle time earns no credit, so a team can't save
up service and then starve the others.

A team with nothing queued or running for `forget_after_s` (past the metrics window) is forgotten once its
counter is no higher than where it would start again (the least-served active team, or the level of the
last team to go idle): that level never falls, so on its return it starts exactly where it would have,
and active teams see no difference. Memory then holds the teams of the recent past, not every team ever.

It only counts; the scheduler decides.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_S = 60  # "tokens served over the last minute", in one-second buckets
FORGET_AFTER_S = 120.0  # how long a team must have been idle before it may be forgotten


@dataclass
class TeamCounts:
    """What one team has now and has had: for the scheduler's decisions and for /metrics."""

    active: int = 0  # unfinished sequences in the engine
    service: float = 0.0  # the virtual counter: weighted tokens / weight, plus the lifts on joining
    prompt_tokens: int = 0  # prompt tokens admitted, cumulative (a recompute is not counted again)
    output_tokens: int = 0  # tokens generated, cumulative
    recent: deque[tuple[int, int]] = field(default_factory=deque)  # (second, tokens served in it), oldest first
    idle_since: float = 0.0  # the clock when `active` last fell to zero

    def tokens_in_window(self, now_s: int) -> int:
        while self.recent and self.recent[0][0] <= now_s - WINDOW_S:
            self.recent.popleft()
        return sum(tokens for _, tokens in self.recent)


class TeamLedger:
    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        forget_after_s: float = FORGET_AFTER_S,
    ) -> None:
        if forget_after_s < WINDOW_S:
            raise ValueError("a team must stay known for the metrics window at least")
        self.clock = clock
        self.forget_after_s = forget_after_s
        self._last_sweep = float("-inf")
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
        self._forget_departed()
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
            counts.idle_since = self.clock()

    def _forget_departed(self) -> None:
        """At most once a second: drop the teams long idle whose counter a return would lift anyway."""
        now = self.clock()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        floor = min((c.service for c in self.teams.values() if c.active > 0), default=self._level_when_idle)
        departed = [
            name
            for name, c in self.teams.items()
            if c.active == 0 and now - c.idle_since >= self.forget_after_s and c.service <= floor
        ]
        for name in departed:
            del self.teams[name]
            self.weights.pop(name, None)

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
