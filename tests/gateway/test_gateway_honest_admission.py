"""Honest admission: a request is admitted only if what it can cost (prompt + max_tokens x n x prompts
tokens, and that priced) fits what its key and team have left after the reservations of requests in
flight; the actual cost settles when it ends. Each way of overspending that used to work is tried
here, on SQLite and on PostgreSQL, and for tpm across two replicas sharing Redis."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
import pytest

from app.gateway.config import parse_prices
from tests.support.gateway import (
    FakeEngine,
    admin_headers,
    bearer,
    build_app,
    chat_body,
    prompt_tokens_of,
    redis_prefix,
    serve_in_thread,
    usage_rows,
    window_start_clock,
)

CONCURRENT = 16
PROMPT = prompt_tokens_of("say hello")  # 6 tokens under the fake chat template


def team_and_key(url: str, **limits) -> str:
    team = httpx.post(f"{url}/admin/api/teams", json={"name": "spender"}, headers=admin_headers()).json()
    return httpx.post(f"{url}/admin/api/keys", json={"team_id": team["id"], **limits}, headers=admin_headers()).json()[
        "key"
    ]


async def send_together(
    urls: list[str], key: str, bodies: list[dict], path: str = "/v1/chat/completions"
) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(
            *(
                client.post(f"{urls[i % len(urls)]}{path}", json=body, headers=bearer(key))
                for i, body in enumerate(bodies)
            )
        )


@pytest.mark.parametrize("replicas", ["one", "two_with_redis"])
def test_concurrent_requests_never_pass_the_tpm_limit(make_gateway, replicas, request):
    extra = {}
    if replicas == "two_with_redis":
        extra = {"redis_url": request.getfixturevalue("redis_url"), "redis_prefix": redis_prefix()}
    clock = window_start_clock()  # the burst must fall in one window, on both replicas
    gateways = [make_gateway(clock=clock, **extra) for _ in range(1 if replicas == "one" else 2)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(build_app(g, FakeEngine(token_delay_s=0.02)))) for g in gateways]
        key = team_and_key(urls[0], tpm_limit=100)
        responses = asyncio.run(send_together(urls, key, [chat_body(max_tokens=10)] * CONCURRENT))
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}
    assert codes.count(200) == 100 // (PROMPT + 10)  # each holds 16 tokens while in flight
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["x-ratelimit-limit-tokens"] == "100" and "retry-after" in refused.headers
    served = sum(r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200)
    assert served <= 100


def test_concurrent_requests_never_pass_the_budget(make_gateway):
    gateway = make_gateway(prices=parse_prices({"*": [0.0, 0.0, 1000.0]}))  # $0.001 per generated token
    with serve_in_thread(build_app(gateway, FakeEngine(token_delay_s=0.02))) as url:
        key = team_and_key(url, max_budget_usd=0.0002 * 100)  # room for 20 tokens
        responses = asyncio.run(send_together([url], key, [chat_body(max_tokens=3)] * CONCURRENT))
    codes = [r.status_code for r in responses]
    assert codes.count(200) == 6  # 6 x 3 tokens x $0.001 = $0.018 of $0.02; a 7th could pass it
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "insufficient_quota"
    spent = sum(row.cost_nano_usd for row in usage_rows(gateway)) / 1e9
    assert spent <= 0.02


def test_one_huge_request_is_refused_before_any_token(make_gateway):
    engine = FakeEngine()
    with serve_in_thread(build_app(make_gateway(), engine)) as url:
        key = team_and_key(url, tpm_limit=100)
        response = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=500), headers=bearer(key))
        small = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=10), headers=bearer(key))
    # More than the whole tpm limit: it can never fit, so it is a 400 that no client retries (#44).
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_large"
    assert "506" in response.json()["error"]["message"]  # what it could have cost
    assert "retry-after" not in response.headers
    assert small.status_code == 200 and len(engine.tenancies) == 1  # the huge one never reached the engine


def test_a_prompt_list_reserves_every_prompt_times_n(make_gateway):
    engine = FakeEngine()
    with serve_in_thread(build_app(make_gateway(), engine)) as url:
        key = team_and_key(url, tpm_limit=250)
        body = {"model": "fake-model", "prompt": ["say hello"] * 10, "max_tokens": 10, "n": 3}
        too_many = httpx.post(f"{url}/v1/completions", json=body, headers=bearer(key))  # 10x2 + 10x3x10 = 320
        fits = httpx.post(f"{url}/v1/completions", json={**body, "n": 2}, headers=bearer(key))  # 20 + 200
        huge_list = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["hi"] * 2049}, headers=bearer(key))
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "request_too_large"
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 20
    assert huge_list.status_code == 400 and huge_list.json()["error"]["param"] == "prompt"
    assert len(engine.tenancies) == 10  # only the prompts of the request that fit ran


@pytest.mark.parametrize("where", ["key_field", "server_setting"])
def test_a_key_has_at_most_its_cap_of_requests_in_flight(make_gateway, where):
    gateway = make_gateway(**({"max_in_flight_per_key": 2} if where == "server_setting" else {}))
    with serve_in_thread(build_app(gateway, FakeEngine(token_delay_s=0.05))) as url:
        key = team_and_key(url, **({"max_in_flight": 2} if where == "key_field" else {}))
        responses = asyncio.run(send_together([url], key, [chat_body(max_tokens=10)] * 5))
        after = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), headers=bearer(key))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 429, 429, 429]
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.headers["retry-after"] == "1"
    assert after.status_code == 200  # the finished ones gave their places back
