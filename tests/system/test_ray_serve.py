"""Two tokenmill replicas on a local Ray cluster behind one Ray Serve ingress, sharing one PostgreSQL
database and one Redis: keys, limits and usage hold across replicas; a replica that stops loses no
request that had not started streaming. One cluster for the module (Ray starts slowly on 2 cores)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from sqlalchemy import create_engine, text

from tests.support.gateway import ADMIN_KEY, admin_headers, free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from app.scaleout.ray_serve import REPLICA_HEADER, build_application

pytestmark = pytest.mark.ray

REDIS_DB = 13  # Redis database of these tests: their key ids restart at 1, other tests' counters live in 0
SYSTEM_PROMPT = "You are the assistant of ACME's support desk; answer briefly and politely. " * 12


@dataclass
class Cluster:
    base_url: str
    database_url: str
    settings: object
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.base_url, timeout=60)

    def new_key(self, name: str, **limits) -> tuple[int, str]:
        team = self.client.post("/admin/api/teams", json={"name": name, **limits}, headers=admin_headers())
        assert team.status_code == 201, team.text
        key = self.client.post("/admin/api/keys", json={"team_id": team.json()["id"]}, headers=admin_headers())
        assert key.status_code == 201, key.text
        return key.json()["id"], key.json()["key"]

    def chat(self, key: str, content: str, *, system: str | None = None, max_tokens: int = 4) -> httpx.Response:
        return self.client.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json=chat_body(content, system=system, max_tokens=max_tokens),
        )


def chat_body(content: str, *, system: str | None = None, max_tokens: int = 4, **extra) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": "tiny-llama", "messages": messages, "max_tokens": max_tokens, **extra}


def clear_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    for name in client.scan_iter("tokenmill:*"):
        client.delete(name)
    client.close()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, pg_databases, redis_url, tmp_path_factory):
    from app.gateway.wiring import prepare_store
    from app.settings import Settings
    from engine.config import EngineConfig

    shared_redis = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    clear_redis(shared_redis)
    data_dir = tmp_path_factory.mktemp("ray-replicas")
    port = free_port()
    settings = Settings(
        port=port,
        data_dir=str(data_dir),
        database_url=pg_databases.create("_ray"),
        redis_url=shared_redis,
        admin_key=ADMIN_KEY,
        min_replicas=2,
        max_replicas=2,
        engine=EngineConfig(
            model=str(tiny_llama_dir),
            served_model_name="tiny-llama",
            num_kv_blocks=64,
            max_num_seqs=8,
            num_threads=1,
            data_dir=str(data_dir),
        ),
    )
    prepare_store(settings)  # migrate once, before the replicas start
    saved = {name: os.environ.get(name) for name in ("TOKENMILL_USAGE_FLUSH_INTERVAL_S",)}
    os.environ["TOKENMILL_USAGE_FLUSH_INTERVAL_S"] = "0.05"  # forwarded to the replicas
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(settings), name="tokenmill", route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{port}", settings.database_url, settings)
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def test_a_key_created_through_the_ingress_works_on_both_replicas(cluster):
    _, key = cluster.new_key("both-replicas")
    replicas = set()
    for i in range(40):
        response = cluster.chat(key, f"question number {i}")
        assert response.status_code == 200, response.text
        replicas.add(response.headers[REPLICA_HEADER])
        if len(replicas) == 2:
            break
    assert len(replicas) == 2


def test_prompts_sharing_a_system_prompt_go_to_one_replica(cluster):
    _, key = cluster.new_key("shared-prefix")
    replicas = {cluster.chat(key, f"user question {i}", system=SYSTEM_PROMPT).headers[REPLICA_HEADER] for i in range(6)}
    assert len(replicas) == 1


def routed_counts(text: str) -> dict[tuple[str, str], float]:
    """(replica, by) -> requests the prefix-aware router placed there, from the ingress's /metrics."""
    return {
        (sample.labels["replica"], sample.labels["by"]): sample.value
        for family in parse_text(text)
        for sample in family.samples
        if sample.name == "tokenmill:routed_requests_total"
    }


def test_a_replicas_reported_cache_draws_its_teams_prompts_by_affinity(cluster):
    """Affinity is measured: once the replica's report holds the prompt's blocks, the router says so."""
    _, key = cluster.new_key("affinity")
    system = "You are the help desk of Initech; answer questions about invoices and refunds only. " * 10
    first = cluster.chat(key, "first question", system=system)
    assert first.status_code == 200, first.text
    home = first.headers[REPLICA_HEADER]
    before = routed_counts(cluster.client.get("/metrics").text)
    replicas = set()
    deadline = time.monotonic() + 30  # the replica reports every ROUTING_STATS_PERIOD_S, through Serve's controller
    while time.monotonic() < deadline:
        response = cluster.chat(key, "another question", system=system)
        replicas.add(response.headers[REPLICA_HEADER])
        after = routed_counts(cluster.client.get("/metrics").text)
        if after.get((home, "affinity"), 0) > before.get((home, "affinity"), 0):
            break
        time.sleep(1.0)
    assert after.get((home, "affinity"), 0) > before.get((home, "affinity"), 0)
    assert replicas == {home}
    text = cluster.client.get("/metrics").text
    assert {replica for replica, _ in routed_counts(text)} == set(replica_values(text, "vllm:num_requests_running"))
    imbalance = [s.value for f in parse_text(text) for s in f.samples if s.name == "tokenmill:routing_imbalance_ratio"]
    assert len(imbalance) == 1 and imbalance[0] >= 1.0


def replica_values(text: str, name: str) -> dict[str, float]:
    """replica id -> value of the (one model's) sample `name` in a text exposition."""
    return {
        sample.labels["replica"]: sample.value
        for family in parse_text(text)
        for sample in family.samples
        if sample.name == name
    }


def test_the_ingress_metrics_cover_every_replica_each_with_its_label(cluster):
    before = replica_values(cluster.client.get("/metrics").text, "vllm:generation_tokens_total")
    assert len(before) == 2  # both replicas, whichever one the scrape reached first
    _, key = cluster.new_key("metrics")
    answered: dict[str, int] = {}
    for i in range(40):
        response = cluster.chat(key, f"count me {i}", max_tokens=3)
        assert response.status_code == 200, response.text
        replica = response.headers[REPLICA_HEADER]
        answered[replica] = answered.get(replica, 0) + 1
        if len(answered) == 2 and min(answered.values()) >= 2:
            break
    text = cluster.client.get("/metrics").text
    after = replica_values(text, "vllm:generation_tokens_total")
    assert after.keys() == before.keys() == answered.keys()
    for replica, chats in answered.items():  # each replica's counter moved by what it served, no more
        assert after[replica] - before[replica] == 3 * chats
    assert replica_values(text, "process_resident_memory_bytes").keys() == answered.keys()
    response = cluster.client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    families = {family.name: family for family in parse_openmetrics(response.text)}
    assert {sample.labels["replica"] for sample in families["vllm:num_requests_running"].samples} == answered.keys()


def start_of_a_fresh_limit_window(needed_s: float = 40.0, window_s: float = 60.0) -> None:
    """Limits count in fixed one-minute windows: requests that straddle a boundary get two allowances."""
    left = window_s - time.time() % window_s
    if left < needed_s:
        time.sleep(left + 0.2)


def test_an_rpm_limit_holds_in_total_not_per_replica(cluster):
    _, key = cluster.new_key("limited", rpm_limit=5)
    start_of_a_fresh_limit_window()
    # All at once, so that both replicas admit concurrently and all requests land in one window.
    with ThreadPoolExecutor(max_workers=20) as pool:
        responses = list(pool.map(lambda i: cluster.chat(key, f"limited question {i}"), range(20)))
    statuses = [response.status_code for response in responses]
    assert statuses.count(200) == 5 and statuses.count(429) == 15, statuses
    assert len({response.headers[REPLICA_HEADER] for response in responses}) == 2  # both replicas counted


def test_usage_rows_from_both_replicas_add_up_in_postgresql(cluster):
    key_id, key = cluster.new_key("metered")
    responses = [cluster.chat(key, f"metered question {i}") for i in range(20)]
    assert all(response.status_code == 200 for response in responses)
    served_by = {response.headers[REPLICA_HEADER] for response in responses}
    assert len(served_by) == 2
    completion_tokens = sum(response.json()["usage"]["completion_tokens"] for response in responses)
    prompt_tokens = sum(response.json()["usage"]["prompt_tokens"] for response in responses)

    engine = create_engine(cluster.database_url)
    query = text(
        "SELECT replica, count(*), sum(prompt_tokens), sum(completion_tokens) FROM usage "
        "WHERE key_id = :key GROUP BY replica"
    )
    deadline = time.monotonic() + 20
    while True:
        with engine.connect() as connection:
            rows = {row[0]: row[1:] for row in connection.execute(query, {"key": key_id})}
        if sum(row[0] for row in rows.values()) >= 20 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    engine.dispose()
    assert set(rows) == served_by
    assert sum(row[0] for row in rows.values()) == 20
    assert sum(row[1] for row in rows.values()) == prompt_tokens
    assert sum(row[2] for row in rows.values()) == completion_tokens

    report = cluster.client.get(
        "/admin/api/usage", headers=admin_headers(), params={"key_id": key_id, "group_by": "replica"}
    ).json()["data"]
    assert {row["replica"]: row["requests"] for row in report} == {name: row[0] for name, row in rows.items()}


@dataclass
class StreamResult:
    replica: str | None = None
    started_at: float | None = None  # when the response headers arrived
    done: bool = False
    error: str | None = None


async def stream_chat(client: httpx.AsyncClient, key: str, content: str, result: StreamResult) -> None:
    body = chat_body(content, max_tokens=160, stream=True, ignore_eos=True)
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            result.started_at = time.monotonic()
            result.replica = response.headers.get(REPLICA_HEADER)
            if response.status_code != 200:
                result.error = f"status {response.status_code}: {await response.aread()}"
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    result.done = True
                elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                    result.error = line
    except httpx.HTTPError as error:
        result.error = repr(error)


def replica_actor(unique_id: str):
    [name] = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].endswith(f"#TokenmillReplica#{unique_id}")
    ]
    return ray.get_actor(name, namespace="serve")


def run_streams(
    cluster: Cluster, key: str, count: int, stop_replica: Callable[[str], object]
) -> tuple[list[StreamResult], float]:
    """`count` streamed chats at once; when one replica has started three of them, `stop_replica(id)`.
    Returns the results and when the replica was stopped."""
    results = [StreamResult() for _ in range(count)]
    stopped_at: list[float] = []

    async def main() -> None:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
            tasks = [
                asyncio.create_task(stream_chat(client, key, f"streamed question {i}", result))
                for i, result in enumerate(results)
            ]
            while not stopped_at:
                started = [result.replica for result in results if result.started_at is not None]
                victim = next((name for name in set(started) if started.count(name) >= 3), None)
                if victim is not None:
                    stopped_at.append(time.monotonic())
                    await asyncio.to_thread(stop_replica, victim)
                await asyncio.sleep(0.01)
            await asyncio.gather(*tasks)

    asyncio.run(main())
    return results, stopped_at[0]


def test_a_killed_replica_loses_no_request_that_had_not_started_streaming(cluster):
    _, key = cluster.new_key("killed")
    victims = []

    def kill(replica_id: str) -> None:
        victims.append(replica_id)
        ray.kill(replica_actor(replica_id), no_restart=True)

    # 2 replicas x 8 sequences run at once; the rest wait in the ingress's router for a replica.
    results, killed_at = run_streams(cluster, key, 24, kill)
    # Headers come from the victim only while it lives: a request without them had not started streaming
    # there, and must be answered, whole, by the other replica.
    elsewhere = [r for r in results if r.replica != victims[0]]
    assert all(r.done and r.error is None for r in elsewhere), [r.error for r in elsewhere]
    assert len([r for r in elsewhere if r.started_at > killed_at]) >= 4  # requests were waiting at the kill
    assert any(not r.done for r in results if r.replica == victims[0])  # and the kill came mid-run


def wait_for_replicas(count: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications["tokenmill"].deployments["TokenmillReplica"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == count:
            return
        time.sleep(0.5)
    raise AssertionError(f"not {count} running replicas after {timeout} s: {status}")


def test_scaling_down_drains_the_stopping_replica(cluster):
    from dataclasses import replace

    wait_for_replicas(2)  # the killed replica's successor
    _, key = cluster.new_key("drained")
    one_replica = replace(cluster.settings, min_replicas=1, max_replicas=1)
    redeploy = threading.Thread(
        target=serve.run, args=(build_application(one_replica),), kwargs={"name": "tokenmill", "route_prefix": "/"}
    )

    results, _ = run_streams(cluster, key, 20, lambda replica_id: redeploy.start())
    redeploy.join(timeout=120)
    assert all(r.done and r.error is None for r in results), [r.error for r in results if not r.done]
    wait_for_replicas(1)


def test_shutting_down_finishes_the_requests_in_flight_and_refuses_new_ones(cluster):
    from app.scaleout.ray_serve import drain_and_shutdown

    _, key = cluster.new_key("shut-down")
    late, cut_short = [], []

    def shut_down(replica_id: str) -> None:
        serve.get_app_handle("tokenmill").drain.remote().result()
        late.append(cluster.chat(key, "a request after the drain began"))
        cut_short.append(drain_and_shutdown("tokenmill"))

    results, _ = run_streams(cluster, key, 12, shut_down)
    assert all(r.done and r.error is None for r in results), [r.error for r in results if not r.done]
    assert late[0].status_code == 503 and late[0].json()["error"]["code"] == "shutting_down"
    assert cut_short == [0]
