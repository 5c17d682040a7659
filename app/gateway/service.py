"""TeamGateway: teams, keys, limits, budgets and usage in a database; one object per process holding
the store, the key cache, the limiter, the budget tracker and the usage writer. It implements
app.gateway.contract.Gateway (authenticate, admit, request_finished, astart / astop); app.main adds
its admin API and dashboard when create_app is given one."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TextIO

from fastapi import Request
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from app.db import is_sqlite, make_engine, migrate, session_factory
from app.errors import OpenAIError, invalid_api_key, model_not_found
from app.gateway.admin_identity import AdminIdentity, deliver_admin_key, ensure_admin_identity
from app.gateway.auth import FailedAuthLimiter, KeyCache, KeyPrincipal
from app.gateway.budget import BudgetScope, BudgetTracker
from app.gateway.config import GatewayConfig, ModelPrice
from app.gateway.contract import Principal, UsageRecord
from app.gateway.headers import offer_headers
from app.gateway.holds import REFUSED_NONE, HoldItem, Holds, LocalHolds
from app.gateway.holds_store import DatabaseHolds, RedisHolds
from app.gateway.keys import bearer_token, visible_prefix
from app.gateway.ratelimit import InProcessCounters, RateLimiter, RedisCounters, Scope
from app.gateway.usage import UsageEvent, UsageWriter
from app.tables import NANO

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sqlalchemy import Engine

log = logging.getLogger("tokenmill.gateway")

RATE_LIMITED, OVER_BUDGET, FORBIDDEN = "rate_limited", "over_budget", "forbidden"


@dataclass(frozen=True)
class Reservation:
    """What one admitted request may still cost: tokens counted in its admission window's tpm, and
    what it holds (nano USD against its budgets, a seat of its key's in-flight cap). Settled by
    request_finished()."""

    rate_scopes: tuple[Scope, ...]
    window: int
    tokens: int
    held: tuple[HoldItem, ...]


def naive_utc(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, UTC).replace(tzinfo=None)


class TeamGateway:
    def __init__(
        self, config: GatewayConfig, *, clock: Callable[[], float] = time.time, announce: TextIO | None = None
    ) -> None:
        self.config = config
        self.clock = clock
        self.announce = announce
        self.engine = make_engine(config.database_url)
        self.sessions = session_factory(self.engine)
        self.keys = KeyCache(self.sessions, ttl_s=config.key_cache_ttl_s)
        self.auth_failures = FailedAuthLimiter(config.auth_failures_per_minute)
        counters = (
            RedisCounters(config.redis_url, prefix=config.redis_prefix) if config.redis_url else InProcessCounters()
        )
        self.limiter = RateLimiter(counters, window_s=config.rate_window_s, clock=clock)
        self.holds = make_holds(config, self.engine)
        self.budgets = BudgetTracker(
            self.sessions, cache_ttl_s=config.budget_cache_ttl_s, clock=clock, shared=self.holds.shared
        )
        # Shared holds keep a finished request's cost until every replica's cached spend has it: the
        # cache's TTL after its usage row is committed, and a little for the replicas' reads to land.
        self.settled_hold_s = config.budget_cache_ttl_s + config.settled_hold_margin_s
        self._settled: dict[int, dict[str, int]] = {}  # id(usage event) -> the cost it holds, per scope
        # (monotonic commit time, cost per scope) of our settled costs committed and still held: a cached
        # spend read after the commit has them already, so they count once, not twice.
        self._committed_held: deque[tuple[float, dict[str, int]]] = deque()
        self._holds_outage_logged = 0.0
        self.writer = UsageWriter(
            self.engine,
            spill_dir=config.spill_dir,
            flush_interval_s=config.usage_flush_interval_s,
            batch_max=config.usage_batch_max,
            buffer_max=config.usage_buffer_max,
            last_used_flush_s=config.last_used_flush_s,
            on_committed=self._committed,
        )
        self.admin: AdminIdentity | None = None
        self.started = False
        self._reservations: dict[str, Reservation] = {}  # request id -> what admit() set aside for it
        self.admitted = 0  # requests let through to the engine ...
        self.finished = 0  # ... and those that reported back

    # lifecycle: blocking, so the async forms run them in a thread

    def start(self) -> None:
        if self.started:
            return
        if self.config.run_migrations:
            migrate(self.engine)
        self.admin, created = ensure_admin_identity(self.sessions, configured_key=self.config.admin_key)
        if created is not None:
            deliver_admin_key(created, self.config.spill_dir, self.announce)
        self.writer.start()
        self.started = True

    def stop(self) -> None:
        """Flush every queued usage row (spilled to disk if the database won't take them)."""
        if self.started:
            self.writer.close()
            self.started = False

    async def astart(self) -> None:
        await run_in_threadpool(self.start)

    async def astop(self, drain_s: float = 5.0) -> None:
        # Requests cancelled by the server's shutdown report their usage on their way out: let them.
        deadline = time.monotonic() + drain_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await run_in_threadpool(self.stop)
        await self.holds.close()
        await self.limiter.close()
        self.engine.dispose()

    # the hooks the /v1 routes call (app.gateway.contract.Gateway)

    async def authenticate(self, request: Request) -> KeyPrincipal:
        token = bearer_token(request.headers.get("authorization"))
        if not token:
            raise self.auth_failure(
                request,
                None,
                OpenAIError(
                    401,
                    "You didn't provide an API key. Pass it as 'Authorization: Bearer sk-...'.",
                    code="invalid_api_key",
                ),
            )
        hit, principal = self.keys.cached(token)
        if not hit:
            try:
                principal = await run_in_threadpool(self.keys.load, token)
            except SQLAlchemyError as error:  # the store is away: serve keys we know, refuse the rest for now
                known, principal = self.keys.last_known(token)
                if not known:
                    raise store_unavailable(error) from None
        if principal is None or not principal.valid_at(self.clock()):
            raise self.auth_failure(request, token, invalid_api_key())
        return principal

    def auth_failure(self, request: Request, presented: str | None, unauthorized: OpenAIError) -> OpenAIError:
        """A key was missing or wrong: the error to answer with. `unauthorized` (counted against the
        client's address and the presented key's prefix), or 429 once either has failed too often, so
        keys can't be guessed at speed from one address or against one key. Only failures come here:
        a valid key is never refused by this limit."""
        subjects = [f"address:{client_address(request)}"]
        if presented:
            subjects.append(f"prefix:{visible_prefix(presented)}")
        wait = self.auth_failures.retry_after(*subjects)
        if wait is None:
            self.auth_failures.failed(*subjects)
            return unauthorized
        return OpenAIError(
            429,
            "Too many failed authentication attempts from your address or with this key. "
            f"Try again in {math.ceil(wait)}s.",
            type="requests",
            code="too_many_auth_failures",
            headers={"Retry-After": str(max(math.ceil(wait), 1))},
        )

    async def admit(
        self,
        principal: Principal,  # the Gateway protocol's: ours authenticates KeyPrincipals, others pass
        *,
        model: str,
        prompt_tokens: int,
        max_tokens: int | None,
        sequences: int = 1,
        request_id: str | None = None,
        price: ModelPrice | None = None,
    ) -> dict[str, str]:
        """Model access, then budget, then rate limits. A refusal raises in OpenAI's shape and is
        metered as a row of its own (status forbidden / over_budget / rate_limited).

        With a `request_id` the admission is honest: what the request can cost (prompt_tokens +
        max_tokens x sequences tokens, priced by `price`) must fit what is left of each budget and
        tpm after the reservations of requests in flight, and is itself reserved until
        request_finished() settles it at the actual cost. Without one, only spend already made counts."""
        if not isinstance(principal, KeyPrincipal):
            return {}
        if not principal.allows(model):
            self._refused(principal, model, FORBIDDEN)
            raise model_not_found(model)
        honest = request_id is not None
        worst_tokens = prompt_tokens + (max_tokens or 0) * sequences if honest else 0
        price = price or self.config.price(model)
        if principal.batch:
            price = price.for_batch()
        estimate = price.cost_nano_usd(prompt_tokens, 0, (max_tokens or 0) * sequences) if honest else 0
        if honest:
            self._refuse_if_never_fits(principal, model, worst_tokens)
        held = await self._hold(principal, model, estimate if honest else None)
        decision = await self.limiter.acquire(principal.rate_scopes, worst_tokens)
        headers = decision.headers()
        offer_headers(headers)
        if not decision.allowed:
            self.holds.adjust({item.scope: -item.amount for item in held})
            self._refused(principal, model, RATE_LIMITED)
            budget = decision.requests if decision.exceeded == "requests" else decision.tokens
            # A refusal names the limit it hit, and that limit is set (an unlimited scope refuses nothing).
            assert decision.exceeded is not None and budget is not None
            detail = f" (this request may need {worst_tokens})" if decision.exceeded == "tokens" and honest else ""
            raise OpenAIError(
                429,
                f"Rate limit reached for {decision.exceeded} per {self.limiter.window_s:g}s: limit "
                f"{budget.limit}{detail}. Try again in {headers['x-ratelimit-reset-' + decision.exceeded]}.",
                type=decision.exceeded,
                code="rate_limit_exceeded",
                headers=headers,
            )
        if request_id is not None:  # honest
            self._reservations[request_id] = Reservation(principal.rate_scopes, decision.window, worst_tokens, held)
        self.admitted += 1
        return headers

    def _refuse_if_never_fits(self, principal: KeyPrincipal, model: str, worst_tokens: int) -> None:
        """A request that may need more tokens than a whole tpm window allows can never be admitted:
        400 saying so (a 429 with retry-after would send clients into retrying it forever)."""
        for scope in principal.rate_scopes:
            if scope.tpm is not None and worst_tokens > scope.tpm:
                self._refused(principal, model, RATE_LIMITED)
                owner = "key" if scope.name.startswith("key:") else "team"
                raise OpenAIError(
                    400,
                    f"This request may need {worst_tokens} tokens (its prompt plus max_tokens for each choice), "
                    f"more than the {owner}'s whole tpm limit of {scope.tpm} per {self.limiter.window_s:g}s: it "
                    "can never be admitted. Lower max_tokens or shorten the prompt.",
                    param="max_tokens",
                    code="request_too_large",
                )

    async def _hold(self, principal: KeyPrincipal, model: str, estimate: int | None) -> tuple[HoldItem, ...]:
        """Take a seat of the key's in-flight cap and `estimate` nano USD of each budget, all or none,
        where every replica counts them; refuse with 429 when one can't be had. Without an estimate
        (no reservation wanted) only a spent budget refuses, and nothing is held."""
        items = []
        # Batch lines are bounded by the batch runner; the key's in-flight cap is for its interactive calls.
        cap = 0 if principal.batch else principal.max_in_flight or self.config.max_in_flight_per_key
        if estimate is not None and cap:
            items.append(HoldItem(f"in_flight:key:{principal.key_id}", cap, 1))
        scopes = principal.budget_scopes
        if scopes:
            try:
                if any(self.budgets.needs_refresh(s) for s in scopes):
                    await run_in_threadpool(lambda: [self.budgets.spent_nano_usd(s) for s in scopes])
                items.extend(
                    HoldItem(f"budget:{s.name}", self.budgets.left_nano_usd(s) + self._counted_twice(s), estimate or 0)
                    for s in scopes
                )
            except SQLAlchemyError as error:
                raise store_unavailable(error) from None
        if not items:
            return ()
        try:
            refused = await self.holds.acquire(items)
        except Exception as error:  # Redis or the database is away: availability over strictness, as for
            # rpm / tpm and for budgets read from the last spend seen; this request goes unheld.
            if time.monotonic() - self._holds_outage_logged > 10:
                self._holds_outage_logged = time.monotonic()
                log.warning("reservation holds unavailable, admitting without: %s", error)
            return ()
        if refused == REFUSED_NONE:
            return tuple(items) if estimate is not None else self._given_back(items)
        if items[refused].scope.startswith("in_flight:"):
            self._refused(principal, model, RATE_LIMITED)
            raise OpenAIError(
                429,
                f"Too many requests in flight for this key: at most {cap} at once. Retry when one has finished.",
                type="requests",
                code="rate_limit_exceeded",
                headers={"retry-after": "1"},
            )
        exhausted = scopes[refused - (len(items) - len(scopes))]
        self._refused(principal, model, OVER_BUDGET)
        raise OpenAIError(
            429,
            f"You exceeded your current quota: the {exhausted.kind}'s budget of "
            f"${exhausted.max_budget_usd:g} per {exhausted.period} can't cover this request "
            f"(up to ${(estimate or 0) / NANO:.6f}) on top of what is spent and reserved.",
            type="insufficient_quota",
            code="insufficient_quota",
        )

    def _given_back(self, items: list[HoldItem]) -> tuple[HoldItem, ...]:
        self.holds.adjust({item.scope: -item.amount for item in items if item.amount})
        return ()

    @property
    def in_flight(self) -> int:
        return self.admitted - self.finished

    def request_finished(self, record: UsageRecord) -> None:
        """On the event loop, once per request that reached the engine: queue its row, never block."""
        reservation = self._reservations.pop(record.request_id, None)
        metered = isinstance(record.key_id, int) and isinstance(record.team_id, int)
        price = record.price or self.config.price(record.model)  # the registry's sheet, else the env's
        if record.batch:
            price = price.for_batch()
        cost = price.cost_nano_usd(record.prompt_tokens, record.cached_tokens, record.completion_tokens)
        kept: dict[str, int] = {}
        if reservation is not None:
            deltas = {item.scope: -item.amount for item in reservation.held}
            # Shared: the actual cost stays held until its row is committed and every replica has read it.
            kept = (
                {s: cost for s in deltas if s.startswith("budget:")} if self.holds.shared and metered and cost else {}
            )
            for scope, amount in kept.items():
                deltas[scope] += amount
            self.holds.adjust(deltas)
        if not metered:
            return
        assert record.team_id is not None and record.key_id is not None  # metered
        self.finished += 1
        event = UsageEvent(
            created_at=naive_utc(record.finished_at - record.latency_seconds),
            team_id=record.team_id,
            key_id=record.key_id,
            model=record.model,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
            latency_ms=round(record.latency_seconds * 1000),
            ttft_ms=None
            if record.time_to_first_token_seconds is None
            else round(record.time_to_first_token_seconds * 1000),
            status=record.status[:16],
            batch=record.batch,
            cost_nano_usd=cost,
        )
        if kept:
            self._settled[id(event)] = kept
        self._queue(event)
        tokens = record.prompt_tokens + record.completion_tokens
        if record.batch:  # batch lines count against the budget (their rows), never the interactive tpm
            return
        if reservation is not None:  # settle: the unused part of the reservation returns to the window
            scopes = [s for s in reservation.rate_scopes if s.tpm is not None]
            tokens, window = tokens - reservation.tokens, reservation.window
        else:
            scopes, window = [s for s in self._scopes_of(record) if s.tpm is not None], None
        if tokens and scopes:
            try:
                self.limiter.count_tokens(scopes, tokens, window)
            except RuntimeError:  # no loop: called from a thread; tokens for Redis can't be sent from there
                return

    # the rest

    def _committed(self, events: Sequence[UsageEvent]) -> None:
        """The usage writer's thread, after a batch is in the database: the costs it held are given
        back once every replica's cached spend has them."""
        self.budgets.committed(events)
        now = time.monotonic()
        for event in events:
            kept = self._settled.pop(id(event), None)
            if kept:
                self.holds.adjust({scope: -amount for scope, amount in kept.items()}, delay_s=self.settled_hold_s)
                self._committed_held.append((now, kept))

    def _counted_twice(self, scope: BudgetScope) -> int:
        """Our committed costs still held in `scope` that its cached spend, read after their commit,
        holds too. Forgotten just before their hold comes due (an admission sends what is due ahead of
        its check), so never subtracted once given back."""
        horizon = time.monotonic() - self.settled_hold_s + 0.05
        while self._committed_held and self._committed_held[0][0] < horizon:
            self._committed_held.popleft()
        read_at = self.budgets.read_at(scope)
        name = f"budget:{scope.name}"
        return sum(kept.get(name, 0) for at, kept in list(self._committed_held) if at < read_at)

    def _scopes_of(self, record: UsageRecord) -> tuple[Any, ...]:
        principal = self.keys.by_key_id.get(record.key_id) if record.key_id is not None else None
        return principal.rate_scopes if principal is not None else ()

    def _refused(self, principal: KeyPrincipal, model: str, status: str) -> None:
        self._queue(
            UsageEvent(
                created_at=naive_utc(self.clock()),
                team_id=principal.team_id,
                key_id=principal.key_id,
                model=model,
                prompt_tokens=0,
                cached_tokens=0,
                completion_tokens=0,
                latency_ms=0,
                ttft_ms=None,
                status=status,
                cost_nano_usd=0,
            )
        )

    def _queue(self, event: UsageEvent) -> None:
        event.replica = self.config.instance_id
        self.budgets.queued(event)
        self.writer.submit(event)
        self.writer.touch(key_id=event.key_id, team_id=event.team_id, when=event.created_at)

    def forget_keys(self, key_hashes: list[str] | None = None) -> None:
        """Drop cached principals after an admin change (None: all of them, e.g. a team changed)."""
        self.keys.invalidate(key_hashes)


def make_holds(config: GatewayConfig, engine: Engine) -> Holds:
    """Where holds live: Redis when configured; else the database when replicas can share it
    (PostgreSQL, or `reservations="database"`); else this process."""
    where = config.reservations
    if where == "auto":
        where = "redis" if config.redis_url else "process" if is_sqlite(engine) else "database"
    options = {"holder": config.instance_id, "alive_ttl_s": config.holder_alive_ttl_s}
    if where == "redis":
        assert config.redis_url, "reservations in Redis need a redis_url"
        return RedisHolds(config.redis_url, prefix=config.redis_prefix, **options)
    if where == "database":
        return DatabaseHolds(engine, **options)
    return LocalHolds()


def client_address(request: Request) -> str:
    """The peer's address, or the one a trusted proxy vouches for (--forwarded-allow-ips rewrites the
    peer before any route runs; X-Forwarded-For from anyone else is never read)."""
    return request.client.host if request.client else "unknown"


def store_unavailable(error: Exception) -> OpenAIError:
    log.warning("database unavailable: %s", str(error).splitlines()[0] if str(error) else type(error).__name__)
    return OpenAIError(
        503,
        "The key store is unavailable; please retry shortly.",
        type="server_error",
        code="service_unavailable",
        headers={"Retry-After": "2"},
    )
