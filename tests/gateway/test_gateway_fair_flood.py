"""One team floods the server; another team's streamed requests still start promptly under fair share,
and starve under first come, first served (the same test, so it can fail).

The tiny random Llama stands in for the real model: the flood is 160 requests of 64-224 tokens, which
SmolLM2 would take minutes to serve on 2 cores. 8 seats, so most of the flood queues, and the flood lasts
thousands of steps: with 32 seats a quiet machine served it all in ~4 s, before the fcfs probe gave up.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from engine.config import EngineConfig
from engine.loader import load_model
from tests.support.gateway import admin_headers, bearer
from tests.support.server import running_server

FLOOD = 160


@pytest.fixture
def database_url(tmp_path):  # SQLite only: the flood tests are about the engine, not the store
    return f"sqlite:///{tmp_path / 'flood.db'}"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir)))


def team_key(url: str, name: str) -> tuple[str, str]:
    """(the team's label in /metrics, a key of it)."""
    team = httpx.post(f"{url}/admin/api/teams", json={"name": name}, headers=admin_headers()).json()
    key = httpx.post(f"{url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()["key"]
    return f"team:{team['id']}", key


async def team_metrics(client: httpx.AsyncClient) -> dict[tuple[str, str], float]:
    """(metric, team) -> value, for the per-team series of /metrics."""
    text = (await client.get("/metrics", headers=admin_headers())).text
    return {
        (sample.name, sample.labels["team"]): sample.value
        for family in parse_text(text)
        if family.name.startswith("tokenmill:team_")
        for sample in family.samples
    }


async def time_to_first_token(client: httpx.AsyncClient, model: str, key: str) -> float:
    started = time.monotonic()
    body = {"model": model, "prompt": "Tell me about the sea", "max_tokens": 4, "stream": True, "ignore_eos": True}
    first: float | None = None
    async with client.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                first = time.monotonic() - started
    assert first is not None, "the stream ended without a token"
    return first


async def flood_and_probe(
    url: str, model: str, flood_key: str, quiet_key: str
) -> tuple[float, list[float], float, dict[tuple[str, str], float], dict[tuple[str, str], float], int]:
    """(quiet team's solo TTFT, its TTFTs during the flood (inf: gave up), seconds flooded, team metrics
    before the probes and after them, flood requests finished by then)."""
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=FLOOD + 20, max_keepalive_connections=FLOOD + 20)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        solo = min([await time_to_first_token(client, model, quiet_key) for _ in range(3)])

        async def flood_request(number: int) -> None:
            body = {
                "model": model,
                "prompt": f"Request {number}: write a long story",
                "ignore_eos": True,
                "max_tokens": rng.randint(64, 224),
            }
            response = await client.post("/v1/completions", json=body, headers=bearer(flood_key))
            assert response.status_code == 200, response.text

        started = time.monotonic()
        flood = [asyncio.create_task(flood_request(number)) for number in range(FLOOD)]
        await asyncio.sleep(1.0)  # the flood is admitted and queued
        # Who holds the engine, read before the probes: a fast machine drains the flood's queue (not its
        # seats) by the time the last probe is through.
        queued = await team_metrics(client)
        probes = []
        give_up_s = solo + 5.0  # well past the allowed worst case: the quiet team is starving
        for _ in range(4):
            try:
                probes.append(await asyncio.wait_for(time_to_first_token(client, model, quiet_key), give_up_s))
            except TimeoutError:
                probes.append(float("inf"))
                break
            await asyncio.sleep(0.2)
        flooding_s = time.monotonic() - started
        metrics = await team_metrics(client)
        finished = sum(task.done() for task in flood)
        for task in flood:  # the flood's clients go away; the engine aborts what they asked for
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        return solo, probes, flooding_s, queued, metrics, finished


@pytest.mark.parametrize("scheduling", ["fair", "fcfs"])
def test_a_flood_from_one_team_delays_another_only_under_fcfs(tiny, make_gateway, scheduling):
    config = EngineConfig(model="tiny", num_kv_blocks=1024, max_num_seqs=8, scheduling=scheduling)
    with running_server(tiny, engine_config=config, gateway=make_gateway()) as server:
        (flood_team, flood_key), (quiet_team, quiet_key) = team_key(server.url, "flood"), team_key(server.url, "quiet")
        solo, probes, flood_s, queued, metrics, finished = asyncio.run(
            flood_and_probe(server.url, server.engine.model_name, flood_key, quiet_key)
        )
    allowed = max(3 * solo, solo + 2.0)
    print(
        f"{scheduling}: solo TTFT {solo:.3f}s, during the flood {[round(p, 3) for p in probes]}, "
        f"flooded {flood_s:.1f}s, allowed {allowed:.2f}s"
    )
    # /metrics shows who holds the engine: the flood fills the seats and the queue, and was served most
    assert queued[("tokenmill:team_requests_waiting", flood_team)] > 0
    assert queued[("tokenmill:team_requests_running", flood_team)] > 0
    assert metrics[("tokenmill:team_tokens_last_minute", flood_team)] > 1000
    assert 0 < metrics[("tokenmill:team_tokens_last_minute", quiet_team)] < 1000
    if scheduling == "fair":
        # the probes ran while the flood did, so their quick start is fair share's doing
        assert finished < FLOOD // 2, f"{finished} of the flood ended before the probes did: make it longer"
        assert max(probes) <= allowed
    else:
        assert max(probes) > allowed  # stuck behind the flood's queue
