"""Fair share through the prefill phase, end to end: team A floods the server with chat requests while
team B sends streamed requests one after another; B's prompts get into the engine's next step, and the
step that computes B's first token carries little of A's prefill, while A's prompts are still being
prefilled (before the change, that step carried a full budget of them: on a CPU, seconds).

The order is asserted, never the wall clock: the engine's steps are recorded (which team's tokens, how
many, whose first token). The tiny random Llama stands in for the real model, with 256 seats and a
512-token step so that A's 160 prompts of ~150 tokens take ~50 steps to prefill. /metrics then tells
where the time went, per stage.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families as parse_text

from engine.config import EngineConfig
from engine.scheduler import FIRST_TOKEN_STEP_PREFILL, ScheduledBatch, Scheduler
from tests.gateway.test_gateway_fair_flood import (  # noqa: F401  (fixtures: SQLite only, the tiny Llama)
    database_url,
    team_key,
    tiny,
)
from tests.support.gateway import admin_headers, bearer
from tests.support.server import running_server

FLOOD = 160
PROBES = 4
# ~150 prompt tokens with the chat template around it
STORY = "Tell me a long story about the sea, the ships on it and the people who sail them. " * 7


@dataclass
class Step:
    prefill: dict[str, int]  # team -> prompt tokens computed in the step (chunks of more than one token)
    first_tokens: dict[str, int]  # team -> requests whose first token the step computes
    waiting: dict[str, int]  # team -> requests queued when it was planned


def record_steps(scheduler: Scheduler) -> list[Step]:
    """Every step the engine thread plans, from now on."""
    steps: list[Step] = []
    schedule = scheduler.schedule

    def recorded() -> ScheduledBatch:
        batch = schedule()
        step = Step(Counter(), Counter(), Counter(r.team for r in scheduler.waiting))
        for request, count in zip(batch.requests, batch.num_new_tokens):
            if count > 1:
                step.prefill[request.team] += count
            if not request.output_token_ids and request.num_computed_tokens + count >= request.num_tokens:
                step.first_tokens[request.team] += 1
        steps.append(step)
        return batch

    scheduler.schedule = recorded  # type: ignore[method-assign]
    return steps


async def first_token(client: httpx.AsyncClient, body: dict, key: str, on_first) -> None:
    """Streams one chat request; calls on_first() when its first content token arrives."""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=bearer(key)) as response:
        assert response.status_code == 200, await response.aread()
        seen = False
        async for line in response.aiter_lines():
            if seen or not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                seen = True
                on_first()


async def flood_and_probe(url: str, model: str, flood_key: str, quiet_key: str) -> tuple[list[str], str]:
    """The order of events as the clients saw them: 'A' for each of A's first tokens, 'B>' when a B
    request goes out, 'B<' for its first token; and /metrics at the end."""
    events: list[str] = []
    rng = random.Random(3)
    limits = httpx.Limits(max_connections=FLOOD + 20, max_keepalive_connections=FLOOD + 20)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        def flood_body(number: int) -> dict:
            return {
                "model": model,
                "messages": [{"role": "user", "content": f"{number}: {STORY}"}],
                "max_tokens": rng.randint(64, 224),
                "ignore_eos": True,
                "stream": True,
            }

        flood = [
            asyncio.create_task(first_token(client, flood_body(n), flood_key, lambda: events.append("A")))
            for n in range(FLOOD)
        ]
        while events.count("A") < 1:  # the flood is in: its first prompts are through, the rest queued
            await asyncio.sleep(0.02)
        for _ in range(PROBES):
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
            events.append("B>")
            await first_token(client, body, quiet_key, lambda: events.append("B<"))
        metrics = (await client.get("/metrics", headers=admin_headers())).text
        for task in flood:  # the flood's clients go away; the engine aborts what they asked for
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return events, metrics


def test_a_quiet_teams_first_tokens_come_before_the_floods_prefills(tiny, make_gateway):  # noqa: F811
    config = EngineConfig(model="tiny", num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=512)
    with running_server(tiny, engine_config=config, gateway=make_gateway()) as server:
        (flood, flood_key), (quiet, quiet_key) = team_key(server.url, "flood"), team_key(server.url, "quiet")
        steps = record_steps(server.engine.core.scheduler)
        events, metrics = asyncio.run(flood_and_probe(server.url, server.engine.model_name, flood_key, quiet_key))
    quiet_steps = [i for i, step in enumerate(steps) if step.first_tokens[quiet]]
    print(
        f"B's first tokens at steps {quiet_steps}; A's prefill tokens in them "
        f"{[steps[i].prefill[flood] for i in quiet_steps]}, A queued then {[steps[i].waiting[flood] for i in quiet_steps]}"
    )
    assert events.count("B<") == PROBES and len(quiet_steps) == PROBES
    during_prefill = [i for i in quiet_steps if steps[i].waiting[flood] > 0]
    assert during_prefill, "A's prompts were all prefilled before B asked: make the flood longer"
    for i in during_prefill:
        # the step that computes B's first token carries little of A's prefill ...
        assert steps[i].prefill[flood] <= FIRST_TOKEN_STEP_PREFILL, steps[i]
        # ... and B's prompt did not wait behind A's queue: it was in the engine's first step after it came
        assert steps[i - 1].waiting[quiet] == 0 or steps[i - 1].first_tokens[quiet] == 0
    # B is through before most of A's flood has finished prefilling
    a_prefilled = sum(step.first_tokens[flood] for step in steps[: quiet_steps[-1]])
    assert a_prefilled < FLOOD // 2, a_prefilled

    stages = {
        sample.labels["stage"]: sample.value
        for family in parse_text(metrics)
        if family.name == "tokenmill:request_stage_seconds"
        for sample in family.samples
        if sample.name.endswith("_count")
    }
    # every request with a first token was timed through each stage
    assert set(stages) == {"admission", "queue", "prefill"}
    assert min(stages.values()) >= events.count("A") + PROBES
