"""rpm / tpm limits (429 + x-ratelimit-* headers, recovery after the window), budgets
(insufficient_quota), on both databases; counters in process and in the real local Redis."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from app.gateway.audit import SYSTEM
from app.gateway.ratelimit import InProcessCounters, RateLimiter, RedisCounters, Scope, format_duration
from tests.support.gateway import (
    FakeClock,
    FakeEngine,
    admin_headers,
    bearer,
    build_app,
    chat_body,
    create_key,
    create_team,
    prompt_tokens_of,
    redis_prefix,
    usage_rows,
)

WINDOW = 60.0


def post(client, key, **body):
    return client.post("/v1/chat/completions", json=chat_body(**body), headers=bearer(key["key"]))


def test_rpm_limit_returns_429_with_headers_and_recovers_after_the_window(make_gateway):
    clock = FakeClock(start=1_000_000 * WINDOW + 1)  # at the start of a window
    gateway = make_gateway(clock=clock, rate_window_s=WINDOW)
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"], rpm_limit=2)
        first, second, third = (post(client, key) for _ in range(3))
        assert (first.status_code, second.status_code) == (200, 200)
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        assert third.status_code == 429
        error = third.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        assert third.headers["x-ratelimit-limit-requests"] == "2"
        assert third.headers["x-ratelimit-remaining-requests"] == "0"
        assert third.headers["x-ratelimit-reset-requests"] == "59s"
        assert int(third.headers["retry-after"]) == 59
        clock.advance(WINDOW)
        again = post(client, key)
        assert again.status_code == 200 and again.headers["x-ratelimit-remaining-requests"] == "1"
    statuses = [row.status for row in usage_rows(gateway)]
    assert statuses == ["ok", "ok", "rate_limited", "ok"]


def test_tpm_limit_counts_prompt_and_completion_tokens_and_recovers(make_gateway):
    clock = FakeClock(start=2_000_000 * WINDOW)
    gateway = make_gateway(clock=clock, rate_window_s=WINDOW)
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"], tpm_limit=30)
        first = post(client, key, max_tokens=20)  # 6 prompt + 20 completion tokens: 26 of 30
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-tokens"] == "30"
        assert "x-ratelimit-limit-requests" not in first.headers  # no rpm limit set
        gateway_tasks_settle(client)
        second = post(client, key, max_tokens=5)  # 26 + 6 + 5 would pass 30: refused before it runs
        assert second.status_code == 429
        assert second.json()["error"]["code"] == "rate_limit_exceeded" and second.json()["error"]["type"] == "tokens"
        assert prompt_tokens_of("say hello") + 20 == 26
        assert second.headers["x-ratelimit-remaining-tokens"] == "4"
        assert second.headers["x-ratelimit-reset-tokens"] == "1m0s"
        clock.advance(WINDOW)
        assert post(client, key, max_tokens=1).status_code == 200


def gateway_tasks_settle(client) -> None:
    """Token counts are added by a task right after the response; a cheap request lets it run."""
    client.get("/admin/api/teams", headers=admin_headers())


def test_team_limit_binds_all_its_keys(make_gateway):
    clock = FakeClock(start=3_000_000 * WINDOW)
    gateway = make_gateway(clock=clock, rate_window_s=WINDOW)
    with TestClient(build_app(gateway)) as client:
        team = create_team(client, rpm_limit=3)
        keys = [create_key(client, team["id"], rpm_limit=10) for _ in range(2)]
        codes = [post(client, keys[i % 2]).status_code for i in range(4)]
        assert codes == [200, 200, 200, 429]
        # The binding limit is the team's: its headers are the ones shown.
        assert post(client, keys[0]).headers["x-ratelimit-limit-requests"] == "3"


def test_headers_are_on_streamed_responses_too(make_gateway):
    gateway = make_gateway()
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"], rpm_limit=100, tpm_limit=100_000)
        with client.stream(
            "POST", "/v1/chat/completions", json=chat_body(stream=True), headers=bearer(key["key"])
        ) as response:
            assert response.status_code == 200
            assert response.headers["x-ratelimit-remaining-requests"] == "99"
            assert response.headers["x-ratelimit-limit-tokens"] == "100000"
            list(response.iter_lines())


def test_headers_are_on_errors_after_admission(make_gateway):
    gateway = make_gateway()
    engine = FakeEngine()
    with TestClient(build_app(gateway, engine)) as client:
        key = create_key(client, create_team(client)["id"], rpm_limit=100)
        engine.queue_full = True
        busy = post(client, key)
        assert busy.status_code == 503
        assert busy.headers["x-ratelimit-limit-requests"] == "100"
        assert busy.headers["x-ratelimit-remaining-requests"] == "99"


def test_budget_exhaustion_returns_insufficient_quota(make_gateway):
    prices = {"fake-model": {"input": 0.0, "output": 100_000.0}}  # $0.1 per output token
    gateway = make_gateway(prices=__import__("app.gateway.config", fromlist=["x"]).parse_prices(prices))
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"], max_budget_usd=0.5, budget_period="day")
        assert post(client, key, max_tokens=3).status_code == 200  # $0.30
        assert post(client, key, max_tokens=3).status_code == 429  # could reach $0.60: refused up front
        assert post(client, key, max_tokens=2).status_code == 200  # $0.50: spent
        refused = post(client, key, max_tokens=1)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "insufficient_quota"
        assert refused.json()["error"]["type"] == "insufficient_quota"
    rows = usage_rows(gateway)
    assert [r.status for r in rows] == ["ok", "over_budget", "ok", "over_budget"]
    assert sum(r.cost_nano_usd for r in rows) == 500_000_000


def test_team_budget_is_shared_and_survives_a_restart(make_gateway):
    from app.gateway.config import parse_prices

    prices = parse_prices({"*": [0.0, 0.0, 100_000.0]})
    gateway = make_gateway(prices=prices)
    with TestClient(build_app(gateway)) as client:
        team = create_team(client, max_budget_usd=0.35)
        key_a, key_b = create_key(client, team["id"]), create_key(client, team["id"])
        assert post(client, key_a, max_tokens=3).status_code == 200
        assert post(client, key_b, max_tokens=1).json()["error"]["code"] == "insufficient_quota"
    gateway.stop()
    restarted = make_gateway(prices=prices)  # a fresh process: spend comes back from the roll-up
    with TestClient(build_app(restarted)) as client:
        assert post(client, key_b, max_tokens=1).json()["error"]["code"] == "insufficient_quota"
        client.patch(f"/admin/api/teams/{team['id']}", json={"max_budget_usd": 10}, headers=admin_headers())
        assert post(client, key_b, max_tokens=1).status_code == 200


def test_duration_format_follows_openai():
    assert [format_duration(s) for s in (0.02, 1.5, 59, 60, 360)] == ["20ms", "1.5s", "59s", "1m0s", "6m0s"]


# ---- counters: in process and in Redis ----


def limiter_pair(kind: str, redis_url_value: str | None, clock: FakeClock):
    """Two limiters as two replicas would have them: sharing Redis, or each on its own process memory."""
    if kind == "redis":
        prefix = redis_prefix()
        return [RateLimiter(RedisCounters(redis_url_value, prefix=prefix), window_s=10, clock=clock) for _ in range(2)]
    counters = InProcessCounters()
    return [RateLimiter(counters, window_s=10, clock=clock) for _ in range(2)]


@pytest.mark.parametrize("kind", ["in_process", "redis"])
def test_counters_admit_up_to_the_limit_then_refuse_then_recover(kind, request):
    url = request.getfixturevalue("redis_url") if kind == "redis" else None
    clock = FakeClock(start=10 * 123_456)

    async def scenario() -> None:
        replica_a, replica_b = limiter_pair(kind, url, clock)
        scope = [Scope("key:1", rpm=3, tpm=None)]
        decisions = [await (replica_a if i % 2 else replica_b).acquire(scope) for i in range(4)]
        assert [d.allowed for d in decisions] == [True, True, True, False]
        assert [d.requests.remaining for d in decisions] == [2, 1, 0, 0]
        clock.advance(10)
        assert (await replica_a.acquire(scope)).allowed
        await replica_a.close()
        await replica_b.close()

    asyncio.run(scenario())


def test_redis_counters_are_shared_and_atomic_under_concurrency(redis_url):
    clock = FakeClock(start=10 * 654_321)

    async def scenario() -> list[bool]:
        replicas = [RateLimiter(RedisCounters(redis_url, prefix=prefix), window_s=10, clock=clock) for _ in range(4)]
        scopes = [Scope("key:7", rpm=25, tpm=None), Scope("team:2", rpm=1000, tpm=None)]
        decisions = await asyncio.gather(*(replicas[i % 4].acquire(scopes) for i in range(100)))
        for replica in replicas:
            await replica.close()
        return [d.allowed for d in decisions]

    prefix = redis_prefix()
    assert sum(asyncio.run(scenario())) == 25


def test_redis_acquires_that_arrive_together_share_a_round_trip_and_keep_their_order(redis_url):
    clock = FakeClock(start=10 * 555_555)

    async def scenario() -> tuple[list, int]:
        limiter = RateLimiter(RedisCounters(redis_url, prefix=redis_prefix()), window_s=10, clock=clock)
        scopes = [Scope("key:3", rpm=25, tpm=None), Scope("team:3", rpm=1000, tpm=None)]
        decisions = await asyncio.gather(*(limiter.acquire(scopes) for _ in range(60)))
        calls = limiter.counters.calls
        await limiter.close()
        return decisions, calls

    decisions, calls = asyncio.run(scenario())
    assert [d.allowed for d in decisions] == [True] * 25 + [False] * 35  # first come, first served
    assert [d.requests.remaining for d in decisions[:25]] == list(range(24, -1, -1))
    assert calls < 10  # 60 acquires, a handful of script calls


def test_redis_token_counts_are_shared(redis_url):
    clock = FakeClock(start=10 * 777_777)

    async def scenario() -> tuple[bool, bool]:
        prefix = redis_prefix()
        a, b = (RateLimiter(RedisCounters(redis_url, prefix=prefix), window_s=10, clock=clock) for _ in range(2))
        scope = [Scope("key:9", rpm=None, tpm=100)]
        first = (await a.acquire(scope)).allowed
        await a.add_tokens(scope, 150)
        second = (await b.acquire(scope)).allowed
        await a.close()
        await b.close()
        return first, second

    assert asyncio.run(scenario()) == (True, False)


def test_finished_requests_tokens_reach_redis_together(redis_url):
    """Tokens are counted after a request, so they are sent in one round trip per flush, not one each."""
    clock = FakeClock(start=10 * 888_888)

    async def scenario() -> tuple[list, bool, bool]:
        prefix = redis_prefix()
        a, b = (
            RateLimiter(RedisCounters(redis_url, prefix=prefix), window_s=10, token_flush_s=0.02, clock=clock)
            for _ in range(2)
        )
        scopes = [Scope("key:5", rpm=None, tpm=100), Scope("team:5", rpm=None, tpm=1000)]
        sent = []
        send = a.counters.add_tokens

        async def recorded(window, ttl_s, amounts):
            sent.append(sorted(tokens for _, tokens in amounts))
            await send(window, ttl_s, amounts)

        a.counters.add_tokens = recorded
        for _ in range(6):
            a.count_tokens(scopes, 20)  # six finished requests of 20 tokens
        before = (await b.acquire(scopes)).allowed
        await asyncio.sleep(0.2)
        after = (await b.acquire(scopes)).allowed
        await a.close()
        await b.close()
        return sent, before, after

    sent, before, after = asyncio.run(scenario())
    assert sent == [[120, 120]]
    assert before and not after  # the key's 100 tokens a minute are spent once the batch landed


def test_gateway_with_redis_shares_rpm_between_two_replicas(make_gateway, redis_url):
    clock = FakeClock(start=4_000_000 * WINDOW)
    prefix = redis_prefix()
    replica_a = make_gateway(clock=clock, redis_url=redis_url, redis_prefix=prefix)
    replica_b = make_gateway(clock=clock, redis_url=redis_url, redis_prefix=prefix)
    with TestClient(build_app(replica_a)) as a, TestClient(build_app(replica_b)) as b:
        key = create_key(a, create_team(a)["id"], rpm_limit=2)
        assert post(a, key).status_code == 200
        assert post(b, key).status_code == 200
        refused = post(a, key)
        assert refused.status_code == 429 and refused.headers["x-ratelimit-remaining-requests"] == "0"
        clock.advance(WINDOW)
        assert post(b, key).status_code == 200


def test_unreachable_redis_admits_rather_than_failing(make_gateway):
    gateway = make_gateway(redis_url="redis://127.0.0.1:1/0")
    with TestClient(build_app(gateway)) as client:
        key = create_key(client, create_team(client)["id"], rpm_limit=1)
        assert [post(client, key).status_code for _ in range(2)] == [200, 200]


def test_budget_spends_in_use_are_read_again_in_one_round(make_gateway):
    """Spend another replica committed reaches this one's cached budgets by a background round (one
    grouped query per kind and period), without a request waiting on the database."""
    import time
    from datetime import UTC, datetime

    from app.gateway import crud
    from app.gateway.budget import BudgetScope, BudgetTracker
    from app.gateway.usage import UsageEvent, write_batch

    gateway = make_gateway()
    with gateway.sessions() as session, session.begin():
        team = crud.create_team(session, actor=SYSTEM, name="alpha")
        (key, _), (idle, _) = (
            crud.create_key(session, actor=SYSTEM, team=team),
            crud.create_key(session, actor=SYSTEM, team=team),
        )
        team_id, key_id, idle_id = team.id, key.id, idle.id
    tracker = BudgetTracker(gateway.sessions, cache_ttl_s=2.0)
    scopes = [
        BudgetScope("key", key_id, 1.0, "day"),
        BudgetScope("team", team_id, 1.0, "month"),
        BudgetScope("key", idle_id, 1.0, "day"),
    ]
    assert [tracker.spent_nano_usd(s) for s in scopes] == [0, 0, 0]
    now = datetime.now(UTC).replace(tzinfo=None)
    write_batch(gateway.engine, [UsageEvent(now, team_id, key_id, "fake-model", 1, 0, 1, 5, None, "ok", 700)])
    time.sleep(0.6)  # past a quarter of the TTL: worth reading again, far from due on the request path
    assert not any(tracker.needs_refresh(s) for s in scopes[:2])  # in use: answered from the cache ...
    assert [tracker.spent_nano_usd(s) for s in scopes[:2]] == [0, 0]
    assert tracker.refresh_due() == 2  # ... and read again in a round, the idle key left to expire
    assert [tracker.spent_nano_usd(s) for s in scopes[:2]] == [700, 700]
