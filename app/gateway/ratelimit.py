"""rpm / tpm limits in fixed windows, per key and per team.

A request is admitted when every scope is under its request count and token count for the current
window; admitting counts it. Tokens are added when the request finishes (they are not known before),
so the request that crosses a tpm limit completes and the next one is refused. Counters live in
Redis when configured (one Lua script: check all scopes, then count, atomically; replicas share it),
in process otherwise. Finished requests' tokens go to Redis summed per scope, one round trip per
`token_flush_s` rather than one per request. If Redis is unreachable we admit and log: availability
over strictness.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("tokenmill.gateway.ratelimit")

REQUESTS, TOKENS = "requests", "tokens"


@dataclass(frozen=True)
class Scope:
    name: str  # "key:12", "team:3"
    rpm: int | None
    tpm: int | None


@dataclass(frozen=True)
class Budget:  # one dimension (requests or tokens) of the binding scope
    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True)
class Decision:
    allowed: bool
    exceeded: str | None  # REQUESTS | TOKENS | None
    requests: Budget | None
    tokens: Budget | None
    retry_after_s: float = 0.0
    window: int = -1  # the window its token reservation was counted in (settled there when it ends)

    def headers(self) -> dict[str, str]:
        out = {}
        for kind, budget in ((REQUESTS, self.requests), (TOKENS, self.tokens)):
            if budget is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(budget.limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(budget.remaining)
                out[f"x-ratelimit-reset-{kind}"] = format_duration(budget.reset_s)
        if not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


UNLIMITED = Decision(True, None, None, None)


def format_duration(seconds: float) -> str:
    """OpenAI's style: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 1)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(math.ceil(seconds)), 60)
    return f"{minutes}m{rest}s"


class Counters(Protocol):
    async def acquire(
        self, window: int, ttl_s: float, scopes: Sequence[Scope], reserve: int = 0
    ) -> tuple[int, list[tuple[int, int]]]:
        """(0 admitted | 1 over requests | 2 over tokens, [(requests, tokens) per scope, this one included]).

        An admitted request's `reserve` tokens count at once, so requests in flight count against tpm."""

    async def add_tokens(self, window: int, ttl_s: float, amounts: Sequence[tuple[Scope, int]]) -> None:
        """Add each scope's tokens to its counter of `window`."""

    async def close(self) -> None: ...


def _over(scope: Scope, requests: int, tokens: int, reserve: int = 0) -> int:
    if scope.rpm is not None and requests >= scope.rpm:
        return 1
    if scope.tpm is not None and (tokens >= scope.tpm or tokens + reserve > scope.tpm):
        return 2
    return 0


class InProcessCounters:
    """One process's counters; the event loop is the lock."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], list[int]] = {}
        self._window = -1

    def _slot(self, name: str, window: int) -> list[int]:
        if window > self._window:
            self._counts = {k: v for k, v in self._counts.items() if k[1] >= window - 1}
            self._window = window
        return self._counts.setdefault((name, window), [0, 0])

    async def acquire(
        self, window: int, ttl_s: float, scopes: Sequence[Scope], reserve: int = 0
    ) -> tuple[int, list[tuple[int, int]]]:
        slots = [self._slot(scope.name, window) for scope in scopes]
        rejected = next((code for scope, (r, t) in zip(scopes, slots) if (code := _over(scope, r, t, reserve))), 0)
        if not rejected:
            for slot in slots:
                slot[0] += 1
                slot[1] += reserve
        return rejected, [(r, t) for r, t in slots]

    async def add_tokens(self, window: int, ttl_s: float, amounts: Sequence[tuple[Scope, int]]) -> None:
        self.add_tokens_now(window, amounts)

    def add_tokens_now(self, window: int, amounts: Sequence[tuple[Scope, int]]) -> None:
        if window < self._window:  # a past window is never read again
            return
        for scope, tokens in amounts:
            self._slot(scope.name, window)[1] += tokens

    async def close(self) -> None:
        pass


# Requests in turn, as if each had its own call: check all its scopes, then count them all or none.
# ARGV: ttl ms, then per request: its number of scopes n, the tokens it reserves, then (rpm, tpm) per scope
# (-1: no limit). KEYS: per request, per scope: the requests counter, the tokens counter.
# Returns per request: code (0 admitted, 1 over requests, 2 over tokens), then (requests, tokens) per scope.
_ACQUIRE_LUA = """
local ttl = tonumber(ARGV[1])
local out = {}
local k, a = 1, 2
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  local reserve = tonumber(ARGV[a + 1])
  a = a + 2
  local code = 0
  local counts = {}
  for i = 0, n - 1 do
    local r = tonumber(redis.call('GET', KEYS[k + 2*i]) or '0')
    local t = tonumber(redis.call('GET', KEYS[k + 2*i + 1]) or '0')
    local rpm = tonumber(ARGV[a + 2*i])
    local tpm = tonumber(ARGV[a + 2*i + 1])
    if code == 0 then
      if rpm >= 0 and r >= rpm then code = 1 elseif tpm >= 0 and (t >= tpm or t + reserve > tpm) then code = 2 end
    end
    counts[2*i + 1] = r
    counts[2*i + 2] = t
  end
  if code == 0 then
    for i = 0, n - 1 do
      counts[2*i + 1] = redis.call('INCR', KEYS[k + 2*i])
      if counts[2*i + 1] == 1 then redis.call('PEXPIRE', KEYS[k + 2*i], ttl) end
      if reserve > 0 then
        counts[2*i + 2] = redis.call('INCRBY', KEYS[k + 2*i + 1], reserve)
        if counts[2*i + 2] == reserve then redis.call('PEXPIRE', KEYS[k + 2*i + 1], ttl) end
      end
    end
  end
  out[#out + 1] = code
  for i = 1, 2*n do out[#out + 1] = counts[i] end
  k = k + 2*n
  a = a + 2*n
end
return out
"""

_ADD_TOKENS_LUA = """
for i = 1, #KEYS do
  local tokens = tonumber(ARGV[i + 1])
  if redis.call('INCRBY', KEYS[i], tokens) == tokens then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return 0
"""


class RedisCounters:
    """Counters shared through Redis. Acquires that arrive together (in one turn of the event loop, or
    while the previous call is out) go in one script call: the same decisions as one call each, one
    round trip for all of them."""

    def __init__(self, url: str, *, prefix: str = "tokenmill:rl:") -> None:
        import redis.asyncio as redis

        self._redis = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._prefix = prefix
        self._acquire = self._redis.register_script(_ACQUIRE_LUA)
        self._add = self._redis.register_script(_ADD_TOKENS_LUA)
        self._waiting: list[tuple[int, float, Sequence[Scope], int, asyncio.Future[Any]]] = []
        self._sender: asyncio.Task[Any] | None = None
        self.calls = 0

    def _keys(self, scope: Scope, window: int) -> tuple[str, str]:
        base = f"{self._prefix}{scope.name}:{window}"
        return base + ":r", base + ":t"

    async def acquire(
        self, window: int, ttl_s: float, scopes: Sequence[Scope], reserve: int = 0
    ) -> tuple[int, list[tuple[int, int]]]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[int, list[tuple[int, int]]]] = loop.create_future()
        self._waiting.append((window, ttl_s, scopes, reserve, future))
        if self._sender is None or self._sender.done() or self._sender.get_loop() is not loop:
            self._sender = loop.create_task(self._send_acquires())
        return await future

    async def _send_acquires(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            keys: list[str] = []
            args = [int(batch[0][1] * 1000)]
            for window, _, scopes, reserve, _ in batch:
                args.extend((len(scopes), reserve))
                for scope in scopes:
                    keys.extend(self._keys(scope, window))
                    args.extend((-1 if scope.rpm is None else scope.rpm, -1 if scope.tpm is None else scope.tpm))
            try:
                self.calls += 1
                out = await self._acquire(keys=keys, args=args)
            except Exception as error:  # each caller decides what an outage means
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            at = 0
            for _, _, scopes, _, future in batch:
                code = int(out[at])
                counts = [(int(out[at + 1 + 2 * i]), int(out[at + 2 + 2 * i])) for i in range(len(scopes))]
                at += 1 + 2 * len(scopes)
                if not future.done():
                    future.set_result((code, counts))

    async def add_tokens(self, window: int, ttl_s: float, amounts: Sequence[tuple[Scope, int]]) -> None:
        keys = [self._keys(scope, window)[1] for scope, _ in amounts]
        await self._add(keys=keys, args=[int(ttl_s * 1000), *(tokens for _, tokens in amounts)])

    async def close(self) -> None:
        await self._redis.aclose()


class RateLimiter:
    def __init__(
        self,
        counters: Counters,
        *,
        window_s: float = 60.0,
        token_flush_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.counters = counters
        self.window_s = window_s
        self.token_flush_s = token_flush_s
        self.clock = clock
        self._last_error_log = 0.0
        self._unsent: dict[tuple[int, Scope], int] = {}  # (window, scope) -> tokens not yet sent to Redis
        self._sender: asyncio.Task[Any] | None = None

    def _window(self) -> tuple[int, float]:
        now = self.clock()
        window = int(now // self.window_s)
        return window, (window + 1) * self.window_s - now

    async def acquire(self, scopes: Sequence[Scope], reserve_tokens: int = 0) -> Decision:
        """Admit a request or not; an admitted one's `reserve_tokens` count against tpm until it is
        settled (count_tokens with the decision's window and the difference to what it really used)."""
        scopes = [s for s in scopes if s.rpm is not None or s.tpm is not None]
        if not scopes:
            return UNLIMITED
        window, reset_s = self._window()
        reserve = reserve_tokens if any(s.tpm is not None for s in scopes) else 0
        try:
            rejected, counts = await self.counters.acquire(window, 2 * self.window_s, scopes, reserve)
        except Exception as exc:  # a counter outage must not take the API down
            self._log_outage(exc)
            return UNLIMITED
        requests = _binding([(s.rpm, r) for s, (r, _t) in zip(scopes, counts)], reset_s)
        tokens = _binding([(s.tpm, t) for s, (_r, t) in zip(scopes, counts)], reset_s)
        exceeded = {0: None, 1: REQUESTS, 2: TOKENS}[rejected]
        return Decision(not rejected, exceeded, requests, tokens, retry_after_s=reset_s, window=window)

    async def add_tokens(self, scopes: Sequence[Scope], tokens: int) -> None:
        """Count a finished request's tokens now, wherever the counters are."""
        scopes = [s for s in scopes if s.tpm is not None]
        if not scopes or tokens <= 0:
            return
        window, _ = self._window()
        try:
            await self.counters.add_tokens(window, 2 * self.window_s, [(s, tokens) for s in scopes])
        except Exception as exc:
            self._log_outage(exc)

    def count_tokens(self, scopes: Sequence[Scope], tokens: int, window: int | None = None) -> None:
        """On the event loop, once per finished request: in-process counters take the tokens at once;
        for Redis they are summed per scope and sent within `token_flush_s`, one round trip for all.
        A settlement passes its admission `window` and may be negative (the unused reservation returns);
        once that window is over, only tokens beyond the reservation still count, in the current one."""
        scopes = [s for s in scopes if s.tpm is not None]
        current, _ = self._window()
        if window is None:
            window = current
        elif window != current:  # its window is over: only tokens past the reservation still count, now
            window, tokens = current, max(tokens, 0)
        if not scopes or tokens == 0:
            return
        if isinstance(self.counters, InProcessCounters):
            self.counters.add_tokens_now(window, [(s, tokens) for s in scopes])
            return
        for scope in scopes:
            self._unsent[(window, scope)] = self._unsent.get((window, scope), 0) + tokens
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_later())

    async def _send_later(self) -> None:
        await asyncio.sleep(self.token_flush_s)
        self._sender = None
        await self.send_tokens()

    async def send_tokens(self) -> None:
        """Send the tokens counted so far (the sender does it every `token_flush_s`; close() at the end)."""
        unsent, self._unsent = self._unsent, {}
        by_window: dict[int, list[tuple[Scope, int]]] = {}
        for (window, scope), tokens in unsent.items():
            by_window.setdefault(window, []).append((scope, tokens))
        for window, amounts in by_window.items():
            try:
                await self.counters.add_tokens(window, 2 * self.window_s, amounts)
            except Exception as exc:
                self._log_outage(exc)

    def _log_outage(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 10:
            self._last_error_log = now
            log.warning("rate-limit counters unavailable, admitting requests: %s", exc)

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            self._sender = None
        await self.send_tokens()
        await self.counters.close()


def _binding(pairs: list[tuple[int | None, int]], reset_s: float) -> Budget | None:
    budgets = [Budget(limit, max(limit - used, 0), reset_s) for limit, used in pairs if limit is not None]
    return min(budgets, key=lambda b: b.remaining) if budgets else None
