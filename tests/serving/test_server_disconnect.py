"""A client that goes away aborts its request: the engine frees its blocks at once, and the usage hook
hears about it."""

from __future__ import annotations

import httpx
import pytest

from app.gateway.contract import Principal, SingleKeyGateway, UsageRecord
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

# ~2000 tokens would take minutes here: if blocks come back within seconds, the abort did it.
ENDLESS = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Count to a million."}],
    "max_tokens": 2000,
    "ignore_eos": True,
}


class RecordingGateway(SingleKeyGateway):
    """Stands in for the real gateway: lets everyone in as team-a and keeps the usage rows."""

    def __init__(self) -> None:
        super().__init__(api_key=None)
        self.records: list[UsageRecord] = []

    async def authenticate(self, request) -> Principal:
        return Principal(team_id="team-a", key_id="key-1")

    async def admit(self, principal, *, model, prompt_tokens, max_tokens, **reservation) -> dict[str, str]:
        return {"x-ratelimit-remaining-requests": "99"}

    def request_finished(self, record: UsageRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def gateway():
    return RecordingGateway()


@pytest.fixture(scope="module")
def server(smollm2, gateway):
    with running_server(smollm2, gateway=gateway) as running:
        yield running


def idle(metrics: dict[str, float]) -> bool:
    return metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0


def test_closed_stream_frees_its_blocks(server, gateway):
    with httpx.stream(
        "POST", f"{server.base_url}/chat/completions", json={**ENDLESS, "stream": True}, timeout=30
    ) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(8)) if line.startswith("data: ")) >= 3
        busy = server.wait_for_metrics(lambda m: m["vllm:num_requests_running"] == 1)
        assert busy["vllm:kv_cache_usage_perc"] > 0
    server.wait_for_metrics(idle, timeout=10)
    record = server.wait_for_record(gateway, "chat.completions")
    assert record.status == "aborted"
    assert (record.team_id, record.key_id, record.model) == ("team-a", "key-1", MODEL)
    assert 0 < record.completion_tokens < 2000 and record.prompt_tokens > 0
    assert record.time_to_first_token_seconds is not None


def test_whole_response_abandoned_by_its_client_frees_its_blocks(server, gateway):
    gateway.records.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", json=ENDLESS, timeout=httpx.Timeout(30, read=2))
    server.wait_for_metrics(idle, timeout=10)
    assert server.wait_for_record(gateway, "chat.completions").status == "aborted"


def test_finished_request_is_metered_once_with_gateway_headers(server, gateway):
    gateway.records.clear()
    response = httpx.post(
        f"{server.base_url}/completions",
        json={"model": MODEL, "prompt": "The sky is", "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200
    assert response.headers["x-ratelimit-remaining-requests"] == "99"
    usage = response.json()["usage"]
    [record] = gateway.records
    assert (record.endpoint, record.status) == ("completions", "ok")
    assert (record.prompt_tokens, record.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert record.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]
    assert record.latency_seconds >= record.time_to_first_token_seconds > 0
