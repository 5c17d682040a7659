"""Real cost per token: what the hardware costs per hour, spread over the tokens it actually produced.

The machine costs the same whether it serves one request or fifty, so a token's real cost falls as more
requests share the same hardware hour (batch occupancy). The meter counts tokens in time buckets and
answers, for the last minute / hour / day: tokens, the hardware cost of that window (capped by uptime:
a server up for ten minutes has not cost a day yet) and USD per 1M tokens, overall and per model.

Per model: a model with its own configured cost per hour (its own GPU, say) carries that cost; the
server's cost is split over the other models by their share of the tokens.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

WINDOWS_S = {"minute": 60.0, "hour": 3600.0, "day": 86400.0}


class TokenBuckets:
    """Tokens per model in fixed-width time buckets over a bounded span: memory stays bounded by
    span / width however many tokens arrive. A window counts only whole buckets inside it."""

    def __init__(self, width_s: float, span_s: float) -> None:
        self.width_s = width_s
        self.span_s = span_s
        self.buckets: deque[tuple[int, Counter[str | None]]] = deque()  # model None: tokens of no model

    def add(self, now: float, model: str | None, tokens: int) -> None:
        index = math.floor(now / self.width_s)
        if not self.buckets or index > self.buckets[-1][0]:
            self.buckets.append((index, Counter()))
            self._forget_before(now)
        self.buckets[-1][1][model] += tokens  # a clock that stepped back lands in the newest bucket

    def totals(self, now: float, window_s: float) -> Counter[str | None]:
        first = math.ceil((now - window_s) / self.width_s)
        totals: Counter[str | None] = Counter()
        for index, counts in reversed(self.buckets):
            if index < first:
                break
            totals.update(counts)
        return totals

    def _forget_before(self, now: float) -> None:
        first = math.ceil((now - self.span_s) / self.width_s)
        while self.buckets and self.buckets[0][0] < first:
            self.buckets.popleft()


def usd_per_million(cost_usd: float, tokens: int) -> float | None:
    return cost_usd / tokens * 1e6 if tokens > 0 else None


class HardwareCostMeter:
    """Thread-safe: `record` runs wherever tokens come out, `snapshot` wherever the dashboard asks.

    `cost_per_hour` is the server's (TOKENMILL_HARDWARE_COST_PER_HOUR, or what an administrator set
    since); `model_costs_per_hour` are per-model overrides. Both count from when they are set: a cost
    set now does not reprice the hours before it."""

    def __init__(
        self,
        cost_per_hour: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        model_costs_per_hour: Mapping[str, float] | None = None,
    ) -> None:
        if cost_per_hour < 0:
            raise ValueError("cost_per_hour must not be negative")
        self.cost_per_hour = cost_per_hour
        self.clock = clock
        self._lock = threading.Lock()
        self.started_at = clock()
        self._server_since = self.started_at
        # Seconds for the minute and hour windows; minutes for the day (at most 1 minute off at its edge).
        self._seconds = TokenBuckets(1.0, WINDOWS_S["hour"])
        self._minutes = TokenBuckets(60.0, WINDOWS_S["day"])
        self._model_costs: dict[str, tuple[float, float]] = {}  # model -> (cost per hour, since)
        for model, cost in (model_costs_per_hour or {}).items():
            self.set_model_cost(model, cost)

    def set_model_cost(self, model: str, cost_per_hour: float | None) -> None:
        """Give `model` its own hardware cost from now on (None: back to a share of the server's)."""
        with self._lock:
            if cost_per_hour is None:
                self._model_costs.pop(model, None)
                return
            if cost_per_hour < 0:
                raise ValueError(f"the cost per hour of {model!r} must not be negative")
            self._model_costs[model] = (cost_per_hour, self.clock())

    def set_server_cost(self, cost_per_hour: float) -> None:
        """The server's hardware cost per hour from now on."""
        if not 0 <= cost_per_hour < math.inf:
            raise ValueError("cost_per_hour must be a finite number, not negative")
        with self._lock:
            self.cost_per_hour = cost_per_hour
            self._server_since = self.clock()

    def record(self, tokens: int, model: str | None = None) -> None:
        if tokens <= 0:
            return
        with self._lock:
            now = self.clock()
            self._seconds.add(now, model, tokens)
            self._minutes.add(now, model, tokens)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            now = self.clock()
            uptime = max(now - self.started_at, 0.0)
            windows = {}
            for name, window_s in WINDOWS_S.items():
                buckets = self._minutes if window_s > self._seconds.span_s else self._seconds
                windows[name] = self._window(now, window_s, buckets.totals(now, window_s))
            return {"cost_per_hour": self.cost_per_hour, "uptime_s": uptime, "windows": windows}

    def _window(self, now: float, window_s: float, tokens_by_model: Counter[str | None]) -> dict[str, Any]:
        elapsed = min(window_s, max(now - self.started_at, 0.0))
        server_cost = self.cost_per_hour * min(elapsed, max(now - self._server_since, 0.0)) / 3600
        own_costs = {
            model: rate * min(window_s, max(now - since, 0.0)) / 3600
            for model, (rate, since) in self._model_costs.items()
        }
        shared_tokens = sum(n for model, n in tokens_by_model.items() if model not in own_costs)
        models = {}
        for model in sorted(set(tokens_by_model) | set(own_costs), key=str):
            if model is None:
                continue  # tokens nobody attributed: in the totals, not in the per-model view
            tokens = tokens_by_model.get(model, 0)
            cost = (
                own_costs[model]
                if model in own_costs
                else (server_cost * tokens / shared_tokens if shared_tokens else 0.0)
            )
            models[model] = {"tokens": tokens, "cost_usd": cost, "usd_per_1m_tokens": usd_per_million(cost, tokens)}
        tokens = sum(tokens_by_model.values())
        cost = server_cost + sum(own_costs.values())
        return {
            "seconds": elapsed,
            "tokens": tokens,
            "cost_usd": cost,
            "usd_per_1m_tokens": usd_per_million(cost, tokens),
            "models": models,
        }
