"""The registry end to end, on a real server with the real gateway: models registered at run time are
served beside the embedded one through the openai client, aliases resolve, an unload drains a running
stream and then frees the engine, /v1/models follows the key's permissions, and the price sheet prices
the usage row. One server per module; each test registers the models it needs under its own names."""

from __future__ import annotations

import asyncio
import gc
import os
import time
import weakref

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text
from sqlalchemy import select

from app.cli.main import main as tokenmill
from app.gateway.service import TeamGateway
from app.main import create_app
from app.settings import Settings
from app.tables import AuditEntry
from engine.config import EngineConfig
from engine.loader import default_model_path
from tests.support import MODEL_CACHE
from tests.support.gateway import (
    ADMIN_KEY,
    admin_headers,
    serve_in_thread,
    sqlite_gateway,
    usage_rows,
)
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SMALL_KV = {"num_kv_blocks": 64}  # 64 blocks x 16 tokens: plenty here, and little memory per model


def resident_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Server:
    def __init__(self, url: str, app, gateway: TeamGateway) -> None:
        self.url, self.app, self.gateway = url, app, gateway

    @property
    def pool(self):
        return self.app.state.context.models

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin/api{path}", headers=admin_headers(), timeout=120, **kwargs)

    def register(self, name: str, path, **fields) -> dict:
        response = self.admin("POST", "/models", json={"name": name, "path": str(path), **fields})
        assert response.status_code == 201, response.text
        return response.json()

    def key(self, **limits) -> str:
        team = httpx.post(
            f"{self.url}/admin/api/teams", json={"name": f"team-{time.monotonic_ns()}"}, headers=admin_headers()
        ).json()
        return httpx.post(
            f"{self.url}/admin/api/keys", json={"team_id": team["id"], **limits}, headers=admin_headers()
        ).json()["key"]

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def state(self, name: str) -> str:
        return self.admin("GET", f"/models/{name}").json()["state"]


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    gateway = sqlite_gateway(tmp_path_factory.mktemp("registry-server"))
    config = EngineConfig(dtype="float32", num_kv_blocks=128, data_dir=str(MODEL_CACHE))
    with running_server(smollm2, engine_config=config, gateway=gateway) as running:
        yield Server(running.url, running.app, gateway)


@pytest.fixture(scope="module")
def smollm2_copy(tmp_path_factory):
    """The embedded GGUF under another file name. A link, so the weights converted once are read again
    rather than converted again (the cache is keyed by the file's real path)."""
    link = tmp_path_factory.mktemp("copy") / "smollm2-copy.gguf"
    link.symlink_to(default_model_path())
    return link


def test_the_embedded_model_is_registered_on_first_start(server):
    [model] = [m for m in server.admin("GET", "/models").json()["data"] if m["name"] == MODEL]
    assert (model["kind"], model["path"], model["architecture"], model["state"]) == (
        "chat",
        "default",
        "llama",
        "loaded",
    )


def test_registered_models_serve_at_once_beside_the_default(server, tiny_llama_dir, smollm2_copy):
    server.register("tiny-llama", tiny_llama_dir, aliases=["gpt-4o-mini"], engine_settings=SMALL_KV, load=True)
    copy = server.register("smollm2-copy", smollm2_copy, engine_settings=SMALL_KV, load=True)
    assert (copy["state"], copy["architecture"], copy["max_model_len"]) == ("loaded", "llama", 8192)
    key = server.key()

    async def ask_all() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        asks = [
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
            for model in (MODEL, "smollm2-copy", "gpt-4o-mini")
        ]
        return await asyncio.gather(*asks)

    try:
        default, copied, aliased = asyncio.run(ask_all())
        assert default.choices[0].message.content == "The capital of France is Paris."
        assert copied.choices[0].message.content == default.choices[0].message.content  # the same weights
        assert (default.model, copied.model, aliased.model) == (MODEL, "smollm2-copy", "tiny-llama")
        assert aliased.usage.completion_tokens > 0
    finally:
        for name in ("tiny-llama", "smollm2-copy"):
            assert server.admin("DELETE", f"/models/{name}").status_code == 200
    assert {m["name"] for m in server.admin("GET", "/models").json()["data"]} == {MODEL}


def test_an_unload_lets_a_running_stream_finish_then_frees_the_engine(server, smollm2_copy):
    server.register("draining-copy", smollm2_copy, engine_settings=SMALL_KV, load=True)
    engine = weakref.ref(server.pool.served["draining-copy"].engine)
    client = server.client(server.key())
    stream = client.chat.completions.create(
        model="draining-copy",
        messages=QUESTION,
        max_tokens=40,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    chunks = [next(stream)]
    resident_before = resident_mb()
    unloading = server.admin("POST", "/models/draining-copy/unload").json()
    assert (unloading["state"], unloading["in_flight"]) == ("draining", 1)
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model="draining-copy", messages=QUESTION, max_tokens=2)
    assert (refused.value.status_code, refused.value.code) == (503, "model_not_loaded")
    chunks += list(stream)  # the stream that was running goes on to its end
    assert chunks[-1].usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    deadline = time.monotonic() + 20
    while server.state("draining-copy") != "unloaded" or engine() is not None:
        assert time.monotonic() < deadline, "the engine was not freed"
        gc.collect()
        time.sleep(0.1)
    assert resident_before - resident_mb() > 300  # SmolLM2's fp32 weights are 540 MB: handed back to the OS
    assert server.admin("POST", "/models/draining-copy/load").json()["state"] == "loaded"  # and it comes back
    server.admin("DELETE", "/models/draining-copy")


def test_v1_models_lists_the_enabled_models_and_aliases_a_key_may_use(server, tiny_llama_dir):
    server.register("listed", tiny_llama_dir, aliases=["listed-alias"])
    server.register("switched-off", tiny_llama_dir, enabled=False)
    try:

        def ids(key: str) -> list[str]:
            return sorted(model.id for model in server.client(key).models.list())

        assert ids(server.key()) == sorted([MODEL, "listed", "listed-alias"])
        assert ids(server.key(allowed_models=["listed"])) == ["listed", "listed-alias"]
        alias_only = server.key(allowed_models=["listed-alias"])
        assert ids(alias_only) == ["listed-alias"]
        assert server.client(alias_only).models.retrieve("listed-alias").id == "listed-alias"
        with pytest.raises(openai.NotFoundError):
            server.client(alias_only).models.retrieve("listed")
        with pytest.raises(openai.NotFoundError):
            server.client(server.key()).models.retrieve("switched-off")
    finally:
        server.admin("DELETE", "/models/listed")
        server.admin("DELETE", "/models/switched-off")


def test_the_price_sheet_prices_each_usage_row(server, tiny_llama_dir):
    server.register(
        "priced",
        tiny_llama_dir,
        aliases=["priced-alias"],
        engine_settings=SMALL_KV,
        load=True,
        price_input_per_1m=3.0,
        price_cached_input_per_1m=1.0,
        price_output_per_1m=15.0,
    )
    try:
        response = server.client(server.key()).chat.completions.create(
            model="priced-alias", messages=QUESTION, max_tokens=7, extra_body={"ignore_eos": True}
        )
        usage = response.usage
        cached = usage.prompt_tokens_details.cached_tokens
        deadline = time.monotonic() + 10
        while not (rows := [r for r in usage_rows(server.gateway) if r.model == "priced"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        [row] = rows
        expected_usd = ((usage.prompt_tokens - cached) * 3.0 + cached * 1.0 + usage.completion_tokens * 15.0) / 1e6
        assert (row.prompt_tokens, row.completion_tokens) == (usage.prompt_tokens, 7)
        assert row.cost_nano_usd == round(expected_usd * 1e9) > 0
    finally:
        server.admin("DELETE", "/models/priced")


def test_a_bad_registration_is_a_clear_400_and_changes_nothing(server, tmp_path):
    before = server.admin("GET", "/models").json()
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    for path, code in (("/no/such/model", "model_source_not_found"), (str(tmp_path), "unsupported_model")):
        response = server.admin("POST", "/models", json={"name": "broken", "path": path})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (code, "path", "invalid_request_error")
    taken = server.admin("POST", "/models", json={"name": MODEL, "path": "default"})
    assert (taken.status_code, taken.json()["error"]["code"]) == (409, "conflict")
    assert server.admin("GET", "/models").json() == before
    assert httpx.get(f"{server.url}/admin/api/models").status_code == 401  # the admin key is needed


def test_the_cli_registers_lists_loads_and_unloads_on_the_server(server, tiny_llama_dir, capsys):
    common = ["--url", server.url, "--admin-key", ADMIN_KEY]
    assert (
        tokenmill(
            [
                "models",
                "add",
                "cli-tiny",
                "--path",
                str(tiny_llama_dir),
                "--alias",
                "cli-alias",
                "--price-in",
                "0.5",
                "--price-out",
                "1.5",
                "--engine-setting",
                "num_kv_blocks=32",
                *common,
            ]
        )
        == 0
    )
    assert tokenmill(["models", "load", "cli-tiny", *common]) == 0
    assert (
        server.client(server.key()).chat.completions.create(model="cli-alias", messages=QUESTION, max_tokens=2).model
        == "cli-tiny"
    )
    assert tokenmill(["models", "unload", "cli-tiny", "--wait", *common]) == 0
    capsys.readouterr()
    assert tokenmill(["models", "list", *common]) == 0
    listing = capsys.readouterr().out
    [line] = [line for line in listing.splitlines() if line.startswith("cli-tiny ")]
    assert "unloaded" in line and "cli-alias" in line and "$0.5 / $1.5" in line
    assert tokenmill(["models", "remove", "cli-tiny", *common]) == 0
    assert tokenmill(["models", "load", "cli-tiny", *common]) == 1
    assert "No model named 'cli-tiny'" in capsys.readouterr().err
    with server.gateway.sessions() as session:
        audited = session.scalars(select(AuditEntry).where(AuditEntry.target_id == "cli-tiny").order_by(AuditEntry.id))
        assert [(row.action, row.after and row.after.get("state")) for row in audited] == [
            ("model.register", None),
            ("model.load", "loaded"),
            ("model.unload", "draining"),
            ("model.remove", None),
        ]  # the failed load of a removed model changed nothing, so it has no row


def test_health_and_metrics_cover_every_loaded_model(server, tiny_llama_dir):
    server.register("metered", tiny_llama_dir, engine_settings=SMALL_KV, load=True)
    try:
        assert server.admin("GET", "/models/metered").json()["state"] == "loaded"
        text = httpx.get(f"{server.url}/metrics").text
        assert text.count("# TYPE vllm:num_requests_running gauge") == 1
        [running] = [family for family in parse_text(text) if family.name == "vllm:num_requests_running"]
        assert {MODEL, "metered"} <= {sample.labels["model_name"] for sample in running.samples}
    finally:
        server.admin("DELETE", "/models/metered")


def test_the_costs_view_has_the_price_sheet_and_the_real_cost_of_a_model_with_its_own_hardware(server, tiny_llama_dir):
    server.register(
        "own-gpu",
        tiny_llama_dir,
        engine_settings=SMALL_KV,
        load=True,
        hardware_cost_per_hour=3.6,
        price_input_per_1m=0.2,
        price_output_per_1m=0.8,
    )
    try:
        server.client(server.key()).chat.completions.create(
            model="own-gpu", messages=QUESTION, max_tokens=5, extra_body={"ignore_eos": True}
        )
        costs = server.admin("GET", "/costs").json()
        # batch lines are charged half unless the model sets its own batch prices
        assert costs["chargeback"]["own-gpu"] == {
            "input_per_1m": 0.2,
            "cached_input_per_1m": 0.2,
            "output_per_1m": 0.8,
            "batch_input_per_1m": 0.1,
            "batch_output_per_1m": 0.4,
        }
        minute = costs["real"]["windows"]["minute"]["models"]["own-gpu"]
        assert minute["tokens"] == 5 and 0 < minute["cost_usd"] <= 3.6 / 60
    finally:
        server.admin("DELETE", "/models/own-gpu")


def test_an_embedding_model_is_registered_loaded_and_served(server, capsys):
    # the embedded encoder ("default") loads on its first request, not when registered or at start
    model = server.register("minilm", "default", kind="embedding", aliases=["text-embedding-3-small"])
    assert (model["state"], model["architecture"], model["loads_on_first_use"]) == ("unloaded", "bert", True)
    assert tokenmill(["models", "list", "--url", server.url, "--admin-key", ADMIN_KEY]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("minilm ")]
    assert "unloaded (loads on first use)" in line
    try:
        response = server.client(server.key()).embeddings.create(model="text-embedding-3-small", input=["Hi", "Yo"])
        assert response.model == "minilm" and [len(item.embedding) for item in response.data] == [384, 384]
        assert server.state("minilm") == "loaded"
        with pytest.raises(openai.BadRequestError):  # a chat model is not an embedding model, and back
            server.client(server.key()).chat.completions.create(model="minilm", messages=QUESTION, max_tokens=2)
    finally:
        server.admin("DELETE", "/models/minilm")


def test_with_load_on_demand_a_request_loads_the_model_it_names(tiny_llama_dir, tmp_path):
    gateway = sqlite_gateway(tmp_path)
    config = EngineConfig(dtype="float32", num_kv_blocks=32, data_dir=str(MODEL_CACHE))
    app = create_app(Settings(port=0, engine=config, load_on_demand=True), gateway=gateway)  # no model loaded
    with serve_in_thread(app) as url:
        server = Server(url, app, gateway)
        assert server.register("on-demand", tiny_llama_dir, aliases=["lazy"])["state"] == "unloaded"
        reply = server.client(server.key()).chat.completions.create(model="lazy", messages=QUESTION, max_tokens=3)
        assert reply.model == "on-demand" and server.state("on-demand") == "loaded"
        server.admin("DELETE", "/models/on-demand")


def test_a_model_that_would_not_fit_in_memory_is_refused_before_it_loads(server, tiny_llama_dir):
    before = resident_mb()
    huge = {"num_kv_blocks": 10**10}  # 10 billion blocks of 8 KiB: a KV pool no machine here has
    response = server.admin(
        "POST", "/models", json={"name": "too-big", "path": str(tiny_llama_dir), "engine_settings": huge, "load": True}
    )
    assert response.status_code == 409
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("insufficient_memory", "engine_settings")
    assert "not enough memory to load 'too-big'" in error["message"] and "GiB is available" in error["message"]
    assert server.state("too-big") == "unloaded"  # registered, not loaded; nothing was allocated
    assert server.admin("POST", "/models/too-big/load").status_code == 409
    assert resident_mb() - before < 100

    # With a pool that fits, the same model loads and serves; the server served others all along.
    assert server.admin("PATCH", "/models/too-big", json={"engine_settings": SMALL_KV}).status_code == 200
    assert server.admin("POST", "/models/too-big/load").status_code == 200
    reply = server.client(server.key()).chat.completions.create(model="too-big", messages=QUESTION, max_tokens=2)
    assert reply.model == "too-big"
    server.admin("DELETE", "/models/too-big")
