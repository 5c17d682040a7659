"""What each LoRA adapter is doing on its base model's engine: its sequences now, the tokens it was served,
and each team's share of it. An adapter is a model of its own to the app (dashboard, /metrics); these are
its numbers, beside the engine-wide ones (KV, batch occupancy) it shares with its base."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.fair_share import TeamCounts
from engine.request import Request
from engine.stats import TeamStats


@dataclass(frozen=True)
class AdapterStats:
    running: int = 0  # running or swapped out
    waiting: int = 0  # for the scheduler, or for a resident slot
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    resident: bool = False
    teams: dict[str, TeamStats] = field(default_factory=dict)


class AdapterUsage:
    """Tokens per (adapter, team), cumulative and over the last minute."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.counts: dict[tuple[str, str], TeamCounts] = {}

    def charge(self, adapter: str, team: str, *, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        counts = self.counts.setdefault((adapter, team), TeamCounts())
        counts.prompt_tokens += prompt_tokens
        counts.output_tokens += output_tokens
        second = int(self.clock())
        if counts.recent and counts.recent[-1][0] == second:
            counts.recent[-1] = (second, counts.recent[-1][1] + prompt_tokens + output_tokens)
        else:
            counts.recent.append((second, prompt_tokens + output_tokens))
            counts.tokens_in_window(second)  # drops what has left the window

    def snapshot(
        self, running: Iterable[Request], waiting: Iterable[Request], resident: Iterable[str]
    ) -> dict[str, AdapterStats]:
        """Per adapter that has been used: `running` and `waiting` are the engine's sequences now."""
        now_running: dict[tuple[str, str], int] = {}
        now_waiting: dict[tuple[str, str], int] = {}
        for requests, counted in ((running, now_running), (waiting, now_waiting)):
            for request in requests:
                if request.adapter is not None:
                    key = (request.adapter.name, request.team)
                    counted[key] = counted.get(key, 0) + 1
        keys = set(self.counts) | set(now_running) | set(now_waiting)
        teams: dict[str, dict[str, TeamStats]] = {}
        for adapter, team in keys:
            counts = self.counts.get((adapter, team), TeamCounts())
            teams.setdefault(adapter, {})[team] = TeamStats(
                now_running.get((adapter, team), 0),
                now_waiting.get((adapter, team), 0),
                counts.prompt_tokens,
                counts.output_tokens,
                0.0,
                tuple(counts.recent),
            )
        loaded = set(resident)
        return {
            adapter: AdapterStats(
                running=sum(t.running for t in per_team.values()),
                waiting=sum(t.waiting for t in per_team.values()),
                prompt_tokens_total=sum(t.prompt_tokens_total for t in per_team.values()),
                generation_tokens_total=sum(t.generation_tokens_total for t in per_team.values()),
                resident=adapter in loaded,
                teams=per_team,
            )
            for adapter, per_team in teams.items()
        }
