"""The overview's live numbers. Every `interval_s` the sampler takes one snapshot per model (engine
stats and latency histograms); rates, means over engine steps, hit rates, percentiles and the real cost
per token over any window come from the two snapshots at its ends. 15 minutes are kept in memory.

Real cost: the machine costs `hardware_cost_per_hour` whether it is busy or not, so what a token costs
is that cost over the window divided by the tokens generated in it. Batch occupancy moves it; the share of
seats Batch API lines hold, and what the cost would be without their tokens, show how much of that is the
batch filling idle seats."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from app.dashboard.histograms import HistogramCounts, quantile
from app.observability.costs import usd_per_million
from engine.stats import EngineStats

log = logging.getLogger("tokenmill.dashboard")

HISTORY_S = 15 * 60
RECENT_S = 10.0  # the headline rates and occupancy
MINUTE_S = 60.0  # latency percentiles, hit rate and cost "now"


@dataclass(frozen=True)
class ModelSource:
    """One served model as the dashboard sees it. A model registry adds more of these."""

    name: str
    stats: Callable[[], EngineStats]
    ttft: Callable[[], HistogramCounts] = HistogramCounts.empty
    inter_token: Callable[[], HistogramCounts] = HistogramCounts.empty
    # Read at every sample, so a change made on the Models page shows at the next one.
    hardware_cost_per_hour: Callable[[], float] | None = None  # its own, or the server's; None: the sampler's
    price: Callable[[], dict[str, Any] | None] = lambda: None  # its price sheet (USD per 1M tokens), if any


@dataclass(frozen=True)
class Snapshot:
    at: float  # unix seconds
    stats: EngineStats
    ttft: HistogramCounts
    inter_token: HistogramCounts


def take_snapshot(source: ModelSource, at: float) -> Snapshot:
    return Snapshot(at, source.stats(), source.ttft(), source.inter_token())


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def cost_per_million(cost_per_hour: float, seconds: float, tokens: int) -> float | None:
    """USD per 1M tokens: the machine's cost over `seconds` spread over the tokens made in them."""
    if tokens <= 0:
        return None
    return cost_per_hour * seconds / 3600 / tokens * 1e6


def rates(older: Snapshot, newer: Snapshot) -> dict[str, Any]:
    """What happened between two snapshots: throughput, and batch and KV occupancy averaged over steps."""
    a, b = older.stats, newer.stats
    seconds = max(newer.at - older.at, 1e-9)
    steps = b.steps_total - a.steps_total
    if steps > 0:
        seq_occupancy = (b.scheduled_seqs_total - a.scheduled_seqs_total) / steps / b.max_num_seqs
        background = b.scheduled_background_seqs_total - a.scheduled_background_seqs_total
        batch_seq_occupancy = background / steps / b.max_num_seqs
        token_occupancy = (b.scheduled_tokens_total - a.scheduled_tokens_total) / steps / b.max_num_batched_tokens
        kv_usage = (b.kv_blocks_used_step_sum - a.kv_blocks_used_step_sum) / steps / b.kv_blocks_total
    else:  # idle: nothing scheduled; KV holds what it holds (prefix cache blocks are free, not used)
        seq_occupancy, token_occupancy, kv_usage = 0.0, 0.0, b.kv_usage
        batch_seq_occupancy = 0.0
    return {
        "tokens_in_per_s": (b.prompt_tokens_total - a.prompt_tokens_total) / seconds,
        "tokens_out_per_s": (b.generation_tokens_total - a.generation_tokens_total) / seconds,
        "steps_per_s": steps / seconds,
        "seq_occupancy": seq_occupancy,
        "batch_seq_occupancy": batch_seq_occupancy,  # of the seats, those Batch API lines held
        "token_occupancy": token_occupancy,
        "kv_usage": kv_usage,
    }


def latencies(older: Snapshot, newer: Snapshot, cost_per_hour: float) -> dict[str, Any]:
    """Percentiles, prefix hit rate and cost per token over a window (about a minute)."""
    a, b = older.stats, newer.stats
    ttft = newer.ttft.since(older.ttft)
    itl = newer.inter_token.since(older.inter_token)
    seconds = newer.at - older.at
    return {
        "ttft_p50": quantile(0.5, ttft),
        "ttft_p99": quantile(0.99, ttft),
        "itl_p50": quantile(0.5, itl),
        "itl_p99": quantile(0.99, itl),
        "prefix_hit_rate": _ratio(
            b.prefix_cache_hits - a.prefix_cache_hits, b.prefix_cache_queries - a.prefix_cache_queries
        ),
        "spec_acceptance_rate": _ratio(
            b.spec_accepted_tokens_total - a.spec_accepted_tokens_total,
            b.spec_draft_tokens_total - a.spec_draft_tokens_total,
        ),
        "cost_per_1m_out": cost_per_million(
            cost_per_hour, seconds, b.generation_tokens_total - a.generation_tokens_total
        ),
        # the same hours over the interactive tokens alone: what a token would have cost without the batch
        "cost_per_1m_out_without_batch": cost_per_million(
            cost_per_hour,
            seconds,
            b.generation_tokens_total
            - a.generation_tokens_total
            - (b.generation_tokens_background_total - a.generation_tokens_background_total),
        ),
    }


def gauges(stats: EngineStats) -> dict[str, Any]:
    return {
        "running": stats.num_running,
        "running_batch": stats.num_running_background,
        "waiting": stats.num_waiting,
        "swapped": stats.num_swapped,
        "max_num_seqs": stats.max_num_seqs,
        "max_num_batched_tokens": stats.max_num_batched_tokens,
        "seqs_last_step": stats.scheduled_seqs_last_step,
        "tokens_last_step": stats.scheduled_tokens_last_step,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        "kv_usage_now": stats.kv_usage,
        "preemptions": stats.num_preemptions,
        "preemptions_recompute": stats.num_preemptions_recompute,
        "preemptions_swap": stats.num_preemptions_swap,
        "prompt_tokens_total": stats.prompt_tokens_total,
        "generation_tokens_total": stats.generation_tokens_total,
    }


def team_shares(stats: EngineStats, names: Mapping[str, str]) -> list[dict[str, Any]]:
    """Each team's share of one model: the tokens it was served over the last minute (the number /metrics
    has as tokenmill:team_tokens_last_minute) and its requests running and waiting now; most served
    first, teams with none of these left out. `names` maps the engine's "team:<id>" to a team's name."""
    shares = [
        {
            "team": team,
            "name": names.get(team, team),
            "tokens_last_minute": counts.tokens_last_minute(),
            "running": counts.running,
            "waiting": counts.waiting,
        }
        for team, counts in stats.teams.items()
    ]
    shown = [s for s in shares if s["tokens_last_minute"] or s["running"] or s["waiting"]]
    return sorted(shown, key=lambda s: (-s["tokens_last_minute"], s["name"]))


SERIES_FIELDS = (
    "running",
    "waiting",
    "swapped",
    "seq_occupancy",
    "batch_seq_occupancy",
    "token_occupancy",
    "kv_usage",
    "tokens_in_per_s",
    "tokens_out_per_s",
    "ttft_p50",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "prefix_hit_rate",
    "spec_acceptance_rate",
    "cost_per_1m_out",
    "cost_per_1m_out_without_batch",
)


def _utc_day(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).date().isoformat()


class ModelHistory:
    def __init__(self, source: ModelSource, max_snapshots: int) -> None:
        self.source = source
        self.snapshots: deque[Snapshot] = deque(maxlen=max_snapshots)
        self.points: deque[dict[str, Any]] = deque(maxlen=max_snapshots)
        self.day_start: Snapshot | None = None  # the first snapshot of the current UTC day
        # The hardware cost since day_start, summed per interval at the rate in force then: a cost set on
        # the Models page at noon does not reprice the morning.
        self.day_cost_usd = 0.0

    def back(self, seconds: float) -> Snapshot:
        """The newest snapshot at least `seconds` older than the latest (or the oldest there is)."""
        latest = self.snapshots[-1]
        for snapshot in reversed(self.snapshots):
            if latest.at - snapshot.at >= seconds - 1e-6:
                return snapshot
        return self.snapshots[0]


class LiveSampler:
    def __init__(
        self,
        sources: Callable[[], list[ModelSource]],
        *,
        hardware_cost_per_hour: float | Callable[[], float] = 0.0,
        interval_s: float = 1.0,
        history_s: float = HISTORY_S,
        clock: Callable[[], float] = time.time,
        team_names: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.sources = sources
        # The server's; a callable where an administrator can change it while we run.
        self._server_cost = (
            hardware_cost_per_hour if callable(hardware_cost_per_hour) else lambda: hardware_cost_per_hour
        )
        self.team_names = team_names
        self.interval_s = interval_s
        self.history_s = history_s
        self.clock = clock
        self.max_snapshots = int((history_s + MINUTE_S) / interval_s) + 2
        self.models: dict[str, ModelHistory] = {}
        self._task: asyncio.Task[Any] | None = None

    @property
    def hardware_cost_per_hour(self) -> float:
        return self._server_cost()

    def cost_of(self, source: ModelSource) -> float:
        return self._server_cost() if source.hardware_cost_per_hour is None else source.hardware_cost_per_hour()

    def sample(self) -> None:
        now = self.clock()
        sources = self.sources()
        for gone in set(self.models) - {source.name for source in sources}:
            del self.models[gone]
        for source in sources:
            history = self.models.get(source.name)
            if history is None:
                history = self.models[source.name] = ModelHistory(source, self.max_snapshots)
            history.source = source
            snapshot = take_snapshot(source, now)
            previous = history.snapshots[-1] if history.snapshots else None
            history.snapshots.append(snapshot)
            if history.day_start is None or _utc_day(history.day_start.at) != _utc_day(now):
                history.day_start = (
                    previous if previous is not None and _utc_day(previous.at) == _utc_day(now) else snapshot
                )
                history.day_cost_usd = 0.0
            if previous is not None and previous.at >= history.day_start.at:
                history.day_cost_usd += self.cost_of(source) * (now - previous.at) / 3600
            if previous is not None:
                point = {
                    "t": now,
                    **rates(previous, snapshot),
                    **latencies(history.back(MINUTE_S), snapshot, self.cost_of(source)),
                    "running": snapshot.stats.num_running,
                    "waiting": snapshot.stats.num_waiting,
                    "swapped": snapshot.stats.num_swapped,
                }
                history.points.append(point)

    def current(self, name: str) -> dict[str, Any]:
        """The headline numbers for one model: now, the last seconds, the last minute, and today."""
        history = self.models[name]
        cost_per_hour = self.cost_of(history.source)
        latest = history.snapshots[-1]
        day_start = history.day_start or latest
        day_tokens = latest.stats.generation_tokens_total - day_start.stats.generation_tokens_total
        day_tokens_all = day_tokens + latest.stats.prompt_tokens_total - day_start.stats.prompt_tokens_total
        minute = history.back(MINUTE_S)
        minute_tokens_all = (
            latest.stats.generation_tokens_total
            - minute.stats.generation_tokens_total
            + latest.stats.prompt_tokens_total
            - minute.stats.prompt_tokens_total
        )
        return {
            "name": name,
            "at": latest.at,
            **gauges(latest.stats),
            **rates(history.back(RECENT_S), latest),
            **latencies(minute, latest, cost_per_hour),
            "cost_per_1m_all": cost_per_million(cost_per_hour, latest.at - minute.at, minute_tokens_all),
            "today_since": day_start.at,
            "today_tokens_out": day_tokens,
            "today_cost_usd": history.day_cost_usd,
            "today_cost_per_1m_out": usd_per_million(history.day_cost_usd, day_tokens),
            "today_cost_per_1m_all": usd_per_million(history.day_cost_usd, day_tokens_all),
            "hardware_cost_per_hour": cost_per_hour,
            "price": history.source.price(),
            "teams": team_shares(latest.stats, self.team_names()),
        }

    def series(self, name: str, *, after: float | None = None) -> dict[str, list[Any]]:
        """Points newer than `after` (all 15 minutes when None), one list per field."""
        cutoff = self.clock() - self.history_s
        if after is not None:
            cutoff = max(cutoff, after)
        points = [p for p in self.models[name].points if p["t"] > cutoff]
        return {"t": [p["t"] for p in points], **{f: [p[f] for p in points] for f in SERIES_FIELDS}}

    def live(self, *, after: float | None = None) -> dict[str, Any]:
        if not self.models:
            self.sample()
        return {
            "now": self.clock(),
            "interval_s": self.interval_s,
            "history_s": self.history_s,
            "hardware_cost_per_hour": self.hardware_cost_per_hour,
            "models": [
                {"current": self.current(name), "series": self.series(name, after=after)} for name in self.models
            ],
        }

    # the background task, started and stopped with the app

    async def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a failed sample must not end sampling
                log.exception("dashboard sampler failed")
            await asyncio.sleep(self.interval_s)

    async def astart(self) -> None:
        self.start()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="dashboard-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
