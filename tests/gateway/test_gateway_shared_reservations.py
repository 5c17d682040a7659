"""Reservations shared by replicas: two gateways on one store (Redis, or the database when Redis is not
configured) admit concurrent requests of one key together, and together never pass its budget or its
in-flight cap; a replica that dies holding reservations lets go of them once it has missed its
heartbeats."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import pytest

from app.gateway.config import parse_prices
from app.gateway.holds import REFUSED_NONE, HoldItem
from app.gateway.holds_store import DatabaseHolds, RedisHolds
from engine.outputs import RequestOutput, SequenceDelta
from tests.gateway.test_gateway_honest_admission import send_together, team_and_key
from tests.support.gateway import FakeEngine, build_app, chat_body, redis_prefix, serve_in_thread, usage_rows

PER_TOKEN = parse_prices({"*": [0.0, 0.0, 1000.0]})  # $0.001 per generated token, prompts free


@pytest.fixture(params=["database", "redis"])
def two_replicas(request, make_gateway):
    """Two gateways sharing one store. Their cached spends live 30 s: within a test each replica reads
    the roll-up once, so what it must know of the other's spend comes through the shared holds alone
    (and no fresh read lands inside a settled cost's hold, where it would count twice and refuse early)."""
    store = {"reservations": request.param, "budget_cache_ttl_s": 30.0}
    if request.param == "redis":
        store |= {"redis_url": request.getfixturevalue("redis_url"), "redis_prefix": redis_prefix()}
    return [make_gateway(prices=PER_TOKEN, **store) for _ in range(2)]


class StopsEarly(FakeEngine):
    """Stops after 3 tokens whatever max_tokens allowed, as a model that says it all early does."""

    async def generate(self, request_id, prompt_token_ids, params, tenancy=None, capacity=True):
        for i in range(3):
            last = i == 2
            deltas = [SequenceDelta(index, " tok", [3], None, "stop" if last else None) for index in range(params.n)]
            yield RequestOutput(request_id, len(prompt_token_ids), 0, deltas, finished=last)


def serve_all(stack: ExitStack, gateways, token_delay_s: float = 0.0, engine=FakeEngine) -> list[str]:
    return [stack.enter_context(serve_in_thread(build_app(g, engine(token_delay_s=token_delay_s)))) for g in gateways]


def test_two_replicas_together_never_pass_the_budget(two_replicas):
    with ExitStack() as stack:
        urls = serve_all(stack, two_replicas, token_delay_s=0.02)
        key = team_and_key(urls[0], max_budget_usd=0.02)  # room for ten requests of 2 tokens at $0.001
        first = asyncio.run(send_together(urls, key, [chat_body(max_tokens=2)] * 16))
        # At once, while the first wave's costs are still on their way to the database: both replicas
        # must see them (held until every replica's cached spend has them).
        second = asyncio.run(send_together(urls, key, [chat_body(max_tokens=2)] * 4))
    codes = [r.status_code for r in first]
    assert codes.count(200) == 10  # not ten per replica
    assert {r.status_code for r in second} == {429}
    assert second[0].json()["error"]["code"] == "insufficient_quota"
    assert two_replicas[1].writer.flush(10)
    spent = sum(row.cost_nano_usd for row in usage_rows(two_replicas[0])) / 1e9  # both replicas' rows
    assert spent == pytest.approx(0.02)


def test_the_budget_freed_by_a_settled_request_is_usable_on_the_other_replica(two_replicas):
    with ExitStack() as stack:
        urls = serve_all(stack, two_replicas, engine=StopsEarly)
        key = team_and_key(urls[0], max_budget_usd=0.01)
        # Reserves 8 tokens' worth ($0.008) but stops at 3: the $0.005 it did not spend comes back, to
        # every replica.
        [spender] = asyncio.run(send_together(urls[:1], key, [chat_body(max_tokens=8)]))
        time.sleep(0.2)  # the settlement is sent as the response goes out: give it a moment to land
        [other] = asyncio.run(send_together(urls[1:], key, [chat_body(max_tokens=3)]))
    assert spender.status_code == 200
    assert other.status_code == 200, other.text  # $0.003 fits only once the first one settled


def test_two_replicas_together_hold_the_keys_in_flight_cap(two_replicas):
    with ExitStack() as stack:
        urls = serve_all(stack, two_replicas, token_delay_s=0.05)
        key = team_and_key(urls[0], max_in_flight=2)
        responses = asyncio.run(send_together(urls, key, [chat_body(max_tokens=10)] * 6))
        after = asyncio.run(send_together(urls[1:], key, [chat_body(max_tokens=1)]))
    assert sorted(r.status_code for r in responses) == [200, 200, 429, 429, 429, 429]
    assert after[0].status_code == 200  # the seats came back, on the other replica too


@pytest.mark.parametrize("store", ["database", "redis"])
def test_a_dead_replicas_holds_stop_counting_after_its_heartbeats(store, make_gateway, request):
    def holds():
        if store == "redis":
            return RedisHolds(request.getfixturevalue("redis_url"), prefix=prefix, alive_ttl_s=0.5)
        return DatabaseHolds(make_gateway().engine, alive_ttl_s=0.5)

    prefix = redis_prefix()
    seat = [HoldItem("in_flight:key:1", 1, 1)]

    async def scenario():
        dying, survivor = holds(), holds()
        assert await dying.acquire(seat) == REFUSED_NONE
        assert await survivor.acquire(seat) == 0  # the one seat is the other replica's
        dying._keeper.cancel()  # killed: no more heartbeats, nothing given back
        await asyncio.sleep(0.2)
        assert await survivor.acquire(seat) == 0  # not dead for long enough yet
        await asyncio.sleep(0.5)
        taken = await survivor.acquire(seat)
        await survivor.close()
        return taken

    started = time.monotonic()
    assert asyncio.run(scenario()) == REFUSED_NONE
    assert time.monotonic() - started < 5


def test_unreachable_redis_admits_budgeted_requests_rather_than_failing(make_gateway):
    """Availability over strictness, as for rpm / tpm: with Redis away a request is served unheld."""
    gateway = make_gateway(prices=PER_TOKEN, redis_url="redis://127.0.0.1:1/0")
    with serve_in_thread(build_app(gateway, FakeEngine())) as url:
        key = team_and_key(url, max_budget_usd=1.0, max_in_flight=1)
        responses = asyncio.run(send_together([url], key, [chat_body(max_tokens=2)] * 2))
    assert [r.status_code for r in responses] == [200, 200]


@pytest.mark.parametrize("store", ["database", "redis"])
def test_a_replica_counts_its_own_settled_costs_once_while_they_are_held(store, make_gateway, request):
    """A settled cost stays held until every replica's cached spend has it; the replica that committed
    it knows when its own cache has it too, and does not count it twice: its budget is usable to the
    last cent, even with the cache read again between every request."""
    extra = (
        {"redis_url": request.getfixturevalue("redis_url"), "redis_prefix": redis_prefix()} if store == "redis" else {}
    )
    # The cache is read again every 0.1-0.2 s; a settled cost is held for 5 s, past the whole test.
    gateway = make_gateway(
        prices=PER_TOKEN, reservations=store, budget_cache_ttl_s=0.2, settled_hold_margin_s=5.0, **extra
    )
    codes = []
    with serve_in_thread(build_app(gateway, FakeEngine())) as url:
        key = team_and_key(url, max_budget_usd=0.01)  # five requests of 2 tokens at $0.001
        for _ in range(6):
            [response] = asyncio.run(send_together([url], key, [chat_body(max_tokens=2)]))
            codes.append(response.status_code)
            time.sleep(0.15)  # its row is committed, and the cached spend read again, within its hold
    assert codes == [200] * 5 + [429]
