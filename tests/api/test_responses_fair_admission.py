"""The Responses API takes its turn in the fair admission queue as chat completions do: the conversation's
rendering and tokenization run in the worker-thread pool, and before, a flood of one team's responses held
that pool's queue first come, first served, so a quiet team's response waited behind all of them before the
engine's fair share ever saw it."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

import app.api.responses as responses_route
from app.serving.admission import ADMISSION_SLOTS, FairAdmission
from engine.config import EngineConfig
from tests.gateway.test_gateway_fair_flood import (  # noqa: F401  (fixtures: SQLite only, the tiny Llama)
    database_url,
    team_key,
    tiny,
)
from tests.support.gateway import bearer
from tests.support.server import running_server

FLOOD = 120
PREPARE_SECONDS = 0.2  # rendering a long conversation: 120 of them keep the slots busy for 0.8 s


def test_a_quiet_teams_response_is_prepared_next_not_behind_the_flood(tiny, make_gateway, monkeypatch):  # noqa: F811
    started: list[tuple[float, str]] = []  # (when, whose) each prepare began
    lock = threading.Lock()
    prepare = responses_route.prepare

    def slow_prepare(tokenizer, body, *rest):  # type: ignore[no-untyped-def]
        with lock:
            started.append((time.monotonic(), "B" if body.input == "quiet" else "A"))
        time.sleep(PREPARE_SECONDS)
        return prepare(tokenizer, body, *rest)

    monkeypatch.setattr(responses_route, "prepare", slow_prepare)
    joined: list[tuple[float, str]] = []  # (when, team) each request took its place in the admission line
    granted: list[tuple[float, str]] = []  # (when, team) each request got its slot
    acquire = FairAdmission._acquire

    async def joining(self: FairAdmission, team: str) -> None:
        joined.append((time.monotonic(), team))
        await acquire(self, team)
        granted.append((time.monotonic(), team))

    monkeypatch.setattr(FairAdmission, "_acquire", joining)
    config = EngineConfig(model="tiny", num_kv_blocks=2048, max_num_seqs=256)
    with running_server(tiny, engine_config=config, gateway=make_gateway()) as server:
        (_, flood_key), (quiet_team, quiet_key) = team_key(server.url, "flood"), team_key(server.url, "quiet")
        model = server.engine.model_name

        async def run() -> tuple[float, int]:
            limits = httpx.Limits(max_connections=FLOOD + 10, max_keepalive_connections=FLOOD + 10)
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:

                async def respond(text: str, key: str) -> int:
                    body = {"model": model, "input": text, "max_output_tokens": 1, "store": False}
                    return (await client.post("/v1/responses", json=body, headers=bearer(key))).status_code

                # the quiet key once before, so its lookup is cached: its way to the line needs no thread then
                assert await respond("hello", quiet_key) == 200
                started.clear()
                flood = [asyncio.create_task(respond(f"flood {n}", flood_key)) for n in range(FLOOD)]
                # the flood holds every admission slot, and all of it is in line
                while len(started) < ADMISSION_SLOTS or sum(team != quiet_team for _, team in joined) < FLOOD:
                    await asyncio.sleep(0.01)
                sent = time.monotonic()
                status = await respond("quiet", quiet_key)
                assert status == 200
                assert set(await asyncio.gather(*flood)) == {200}
                return sent, status

        sent, _ = asyncio.run(run())
    in_line_at = next(when for when, team in joined if team == quiet_team and when >= sent)
    quiet_granted_at = next(when for when, team in granted if team == quiet_team and when >= in_line_at)
    passed_it = sum(1 for when, team in granted if team != quiet_team and in_line_at <= when < quiet_granted_at)
    # Once in line, the quiet team's request takes the next free slot (at most a few more go while the event
    # loop hands it over); one line for all teams let 55 go first. Counted from its place in line, not from when the
    # client sent it: slots that free while it is on its way there (HTTP parsing, the middleware, a loaded
    # machine's thread switches: 30 of them once in CI) may go to the flood, and admission cannot change that.
    # Counted by the slots handed out, not by the prepares begun: a flood request given its slot just before the
    # quiet one joined may start preparing just after, once its worker thread runs (9 such in one CI run).
    assert passed_it <= ADMISSION_SLOTS // 4, f"{passed_it} of the flood's responses were admitted ahead of it"
    quiet_at = next(when for when, whose in started if whose == "B")
    assert quiet_at >= quiet_granted_at  # what the slot is for: it was prepared once admitted
