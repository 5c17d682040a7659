"""Each model's own sampling defaults: a request that sets no sampling field gets the model's (the embedded
SmolLM2: greedy, top_p 0.9, frequency_penalty 0.5, max_tokens 256: bench/defaults_bench.py), not OpenAI's
temperature 1.0; a value the request
sets always wins. Seen where it counts: the SamplingParams the real engine receives. Defaults come from a
checkpoint's generation_config.json, the admin API and the CLI; bad ones are a 400 naming the field; the
migration gives existing rows none, except the embedded model's row."""

from __future__ import annotations

import json
from datetime import datetime

import httpx
import openai
import pytest
from alembic import command
from sqlalchemy import text

from app.cli.main import main as tokenmill
from app.db import alembic_config, make_engine, migrate, session_factory
from app.registry.sampling_defaults import EMBEDDED_CHAT_DEFAULTS
from app.registry.store import RegistryStore
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.gateway.test_gateway_migrations import drop_everything
from tests.registry.test_registry import checkpoint, register, store  # noqa: F401
from tests.support import MODEL_CACHE
from tests.support.gateway import ADMIN_KEY, admin_headers, sqlite_gateway
from tests.support.server import MODEL, running_server

EMBEDDED_DEFAULTS = dict(EMBEDDED_CHAT_DEFAULTS)
MODEL_CARD = {"temperature": 0.2, "top_p": 0.9}  # what migration 0008 gave an existing embedded row
# The README's first request: no sampling field at all.
README_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 256,
}


def with_generation_config(folder, config=GENERATION_CONFIG):
    checkpoint(folder)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


# ---- registration (no engine) -------------------------------------------------------------------


def test_a_checkpoint_folder_registers_with_its_generation_config(store, tmp_path):  # noqa: F811
    spec = register(store, name="qwen-like", path=str(with_generation_config(tmp_path / "qwen-like")))
    assert spec.sampling_defaults == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 256,
    }
    assert {s.name: s.sampling_defaults for s in store.all()}["qwen-like"] == spec.sampling_defaults  # stored


def test_the_admins_defaults_go_over_the_checkpoints(store, tmp_path):  # noqa: F811
    spec = register(
        store,
        name="tuned",
        path=str(with_generation_config(tmp_path / "tuned")),
        sampling_defaults={"temperature": 0.3, "max_tokens": None, "presence_penalty": 0.5},
    )
    assert spec.sampling_defaults == {
        "temperature": 0.3,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "presence_penalty": 0.5,
    }


def test_the_embedded_model_registers_with_its_model_card_values(store):  # noqa: F811
    assert register(store, name="smol", path="default").sampling_defaults == EMBEDDED_DEFAULTS


def test_a_value_the_engine_cannot_use_is_skipped_not_the_model(store, tmp_path):  # noqa: F811
    folder = with_generation_config(tmp_path / "odd", {"temperature": 7.0, "top_p": 0.8, "top_k": "many"})
    assert register(store, name="odd", path=str(folder)).sampling_defaults == {"top_p": 0.8}


def test_a_gguf_registers_with_its_sampling_metadata(store, tmp_path):  # noqa: F811
    import gguf

    path = tmp_path / "tuned.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in (
        (writer.add_context_length, 2048),
        (writer.add_embedding_length, 64),
        (writer.add_block_count, 2),
        (writer.add_feed_forward_length, 128),
        (writer.add_head_count, 4),
        (writer.add_head_count_kv, 2),
    ):
        add(value)
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_float32("general.sampling.top_p", 0.8)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert register(store, name="tuned-gguf", path=str(path)).sampling_defaults == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 40,
        "repetition_penalty": 1.1,
    }


def test_a_folder_without_generation_config_has_none(store, tmp_path):  # noqa: F811
    assert register(store, name="plain", path=str(checkpoint(tmp_path / "plain"))).sampling_defaults == {}


# ---- the migration ------------------------------------------------------------------------------


def stored_defaults(engine) -> dict[str, dict]:
    """Each row's sampling defaults, read with SQL: the ORM's table has the columns of the newest revision."""
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT name, sampling_defaults FROM models")).all()
    return {name: json.loads(value) if isinstance(value, str) else value for name, value in rows}


def test_the_migration_gives_existing_rows_none_and_the_embedded_model_its_own(database_url):
    engine = make_engine(database_url)
    drop_everything(engine)
    config = alembic_config(engine)
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0007_fair_share")  # a database from before sampling defaults
        connection.commit()
    now = datetime(2026, 11, 30)
    with engine.begin() as connection:
        for name, kind, source in (
            ("SmolLM2-135M-Instruct", "chat", "default"),
            ("my-llama", "chat", "/m/llama"),
            ("all-MiniLM-L6-v2", "embedding", "default"),
        ):
            connection.execute(
                text(
                    "INSERT INTO models (name, kind, source, architecture, dtype, engine_settings, aliases, enabled, "
                    "created_at, updated_at) VALUES (:name, :kind, :source, 'llama', 'float32', '{}', '[]', true, "
                    ":now, :now)"
                ),
                {"name": name, "kind": kind, "source": source, "now": now},
            )
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0008_model_sampling_defaults")
        connection.commit()
    assert stored_defaults(engine) == {"SmolLM2-135M-Instruct": MODEL_CARD, "my-llama": {}, "all-MiniLM-L6-v2": {}}
    engine.dispose()


def test_an_upgrade_gives_the_embedded_model_the_measured_defaults_unless_an_admin_set_its_own(database_url):
    """An install from before the measured defaults answered the README's question with its model card's
    temperature 0.2 and ran off to the context's end in 3 of 10 tries: upgrading must fix that too, but
    never overwrite what an admin chose."""
    engine = make_engine(database_url)
    drop_everything(engine)
    config = alembic_config(engine)
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0019_model_adapters")
        connection.commit()
    now = datetime(2026, 12, 1)
    rows = {
        "SmolLM2-135M-Instruct": ("default", MODEL_CARD),
        "smol-admin-tuned": ("default", {"temperature": 0.7}),
        "my-llama": ("/m/llama", MODEL_CARD),
    }
    with engine.begin() as connection:
        for name, (source, defaults) in rows.items():
            connection.execute(
                text(
                    "INSERT INTO models (name, kind, source, architecture, dtype, engine_settings, aliases, enabled, "
                    "created_at, updated_at, sampling_defaults) VALUES (:name, 'chat', :source, 'llama', 'float32', "
                    "'{}', '[]', true, :now, :now, :defaults)"
                ),
                {"name": name, "source": source, "now": now, "defaults": json.dumps(defaults)},
            )
    migrate(engine)
    stored = {spec.name: spec.sampling_defaults for spec in RegistryStore(session_factory(engine)).all()}
    assert stored == {
        "SmolLM2-135M-Instruct": EMBEDDED_CHAT_DEFAULTS,
        "smol-admin-tuned": {"temperature": 0.7},
        "my-llama": MODEL_CARD,
    }
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0019_model_adapters")
        connection.commit()
    assert stored_defaults(engine)["SmolLM2-135M-Instruct"] == MODEL_CARD
    engine.dispose()


# ---- on a real server: what the engine receives ---------------------------------------------------


class EngineSpy:
    """Wraps the engine's public generate(): every SamplingParams it was given, in order."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.params = []
        generate = engine.generate

        def spy(request_id, prompt_token_ids, params, *rest, **options):
            self.params.append(params)
            return generate(request_id, prompt_token_ids, params, *rest, **options)

        engine.generate = spy

    def take(self) -> list:
        taken, self.params = self.params, []
        return taken


class Server:
    def __init__(self, url: str, spy: EngineSpy) -> None:
        self.url, self.spy = url, spy
        team = httpx.post(f"{url}/admin/api/teams", json={"name": "defaults"}, headers=admin_headers()).json()
        self.key = httpx.post(f"{url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()[
            "key"
        ]
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=self.key, max_retries=0)

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin/api{path}", headers=admin_headers(), timeout=60, **kwargs)

    def set_defaults(self, changes: dict) -> httpx.Response:
        return self.admin("PATCH", f"/models/{MODEL}", json={"sampling_defaults": changes})


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    gateway = sqlite_gateway(tmp_path_factory.mktemp("sampling-defaults"))
    config = EngineConfig(dtype="float32", num_kv_blocks=128, data_dir=str(MODEL_CACHE))
    # A small model sometimes rambles on to the end of its context: the cap keeps such an answer short.
    with running_server(smollm2, engine_config=config, gateway=gateway, max_tokens_cap=48) as running:
        yield Server(running.url, EngineSpy(running.engine))


@pytest.fixture
def embedded_defaults_after(server):
    """Tests that change the embedded model's defaults put its own back."""
    yield
    assert server.set_defaults({"max_tokens": None, "top_k": None, **EMBEDDED_DEFAULTS}).status_code == 200
    server.spy.take()


def sampling(params) -> tuple:
    return params.temperature, params.top_p


def test_the_readme_request_gets_the_models_defaults_not_openais(server):
    server.spy.take()
    answers = [
        server.client.chat.completions.create(model=MODEL, messages=README_QUESTION).choices[0].message.content
        for _ in range(10)
    ]
    received = server.spy.take()
    assert [sampling(params) for params in received] == [(0.0, 0.9)] * 10  # before: (1.0, 1.0), then (0.2, 0.9)
    assert all(answers)


def test_a_value_the_request_sets_wins_even_openais_default(server):
    server.spy.take()
    server.client.chat.completions.create(model=MODEL, messages=README_QUESTION, temperature=1.0, max_tokens=4)
    server.client.chat.completions.create(model=MODEL, messages=README_QUESTION, top_p=1.0, max_tokens=4)
    greedy = server.client.chat.completions.create(model=MODEL, messages=README_QUESTION, temperature=0, max_tokens=12)
    assert [sampling(params) for params in server.spy.take()] == [(1.0, 0.9), (0.0, 1.0), (0.0, 0.9)]
    assert greedy.choices[0].message.content == "The capital of France is Paris."


def test_completions_get_the_defaults_too(server):
    server.spy.take()
    server.client.completions.create(model=MODEL, prompt="The capital of France is")
    server.client.completions.create(model=MODEL, prompt="The capital of France is", temperature=1.5)
    first, second = server.spy.take()
    assert sampling(first) == (0.0, 0.9) and first.max_tokens == 16  # the legacy API's max_tokens still
    assert sampling(second) == (1.5, 0.9)


def test_the_responses_api_gets_the_defaults_too(server):
    server.spy.take()
    server.client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=16)
    server.client.responses.create(
        model=MODEL, input="What is the capital of France?", max_output_tokens=16, temperature=1.0, store=False
    )
    assert [sampling(params) for params in server.spy.take()] == [(0.0, 0.9), (1.0, 0.9)]


def test_the_servers_default_temperature_goes_over_the_models(smollm2):
    with running_server(smollm2, default_temperature=0.0) as other:
        spy = EngineSpy(other.engine)
        client = other.client()
        answer = client.chat.completions.create(model=MODEL, messages=README_QUESTION, max_tokens=12)
        client.chat.completions.create(model=MODEL, messages=README_QUESTION, max_tokens=2, temperature=0.5)
        assert [sampling(params) for params in spy.take()] == [(0.0, 0.9), (0.5, 0.9)]
        assert answer.choices[0].message.content == "The capital of France is Paris."
        assert client.models.retrieve(MODEL).model_extra["sampling_defaults"] == {
            **EMBEDDED_DEFAULTS,
            "temperature": 0.0,
        }


def test_v1_models_lists_the_defaults(server):
    card = server.client.models.retrieve(MODEL)
    assert card.model_extra["sampling_defaults"] == EMBEDDED_DEFAULTS
    assert server.admin("GET", f"/models/{MODEL}").json()["sampling_defaults"] == EMBEDDED_DEFAULTS


def test_an_admins_change_applies_to_the_next_request(server, embedded_defaults_after):
    changed = server.set_defaults({"temperature": 0.7, "top_k": 40, "max_tokens": 5})
    assert changed.status_code == 200, changed.text
    assert changed.json()["sampling_defaults"] == {
        **EMBEDDED_DEFAULTS,
        "temperature": 0.7,
        "top_k": 40,
        "max_tokens": 5,
    }
    server.spy.take()
    chat = server.client.chat.completions.create(model=MODEL, messages=README_QUESTION)
    server.client.completions.create(model=MODEL, prompt="Once upon a time")
    server.client.chat.completions.create(model=MODEL, messages=README_QUESTION, max_tokens=7, extra_body={"top_k": 0})
    received = [(p.temperature, p.top_p, p.top_k, p.max_tokens) for p in server.spy.take()]
    assert received == [(0.7, 0.9, 40, 5), (0.7, 0.9, 40, 5), (0.7, 0.9, 0, 7)]
    assert chat.usage.completion_tokens <= 5
    assert server.set_defaults({"temperature": None}).json()["sampling_defaults"] == {
        "top_p": 0.9,
        "frequency_penalty": 0.5,
        "top_k": 40,
        "max_tokens": 5,
    }


def test_the_cli_sets_and_drops_a_default(server, embedded_defaults_after, tmp_path, capsys):
    common = ["--url", server.url, "--admin-key", ADMIN_KEY]
    assert (
        tokenmill(
            [
                "models",
                "add",
                "cli-tuned",
                "--path",
                str(with_generation_config(tmp_path / "tuned")),
                "--default",
                "temperature=0.5",
                "--default",
                "max_tokens=none",
                *common,
            ]
        )
        == 0
    )
    assert server.admin("GET", "/models/cli-tuned").json()["sampling_defaults"] == {
        "temperature": 0.5,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    assert server.admin("DELETE", "/models/cli-tuned").status_code == 200
    assert (
        tokenmill(["models", "update", MODEL, "--default", "temperature=0.4", "--default", "top_p=none", *common]) == 0
    )
    assert "temperature=0.4" in capsys.readouterr().out
    assert server.client.models.retrieve(MODEL).model_extra["sampling_defaults"] == {
        "temperature": 0.4,
        "frequency_penalty": 0.5,
        "max_tokens": 256,
    }
    assert tokenmill(["models", "update", MODEL, "--default", "temperature=-1", *common]) == 1
    assert "sampling_defaults.temperature" in capsys.readouterr().err


@pytest.mark.parametrize(
    "changes, param",
    [
        ({"temperature": -0.5}, "sampling_defaults.temperature"),
        ({"top_p": 1.5}, "sampling_defaults.top_p"),
        ({"temprature": 0.2}, "sampling_defaults.temprature"),
        ({"top_k": 2.5}, "sampling_defaults.top_k"),
        ({"max_tokens": 0}, "sampling_defaults.max_tokens"),
        ({"temperature": "hot"}, "sampling_defaults.temperature"),
        ({"repetition_penalty": True}, "sampling_defaults.repetition_penalty"),
    ],
)
def test_bad_defaults_are_a_400_naming_the_field_and_change_nothing(server, tmp_path, changes, param):
    before = server.admin("GET", f"/models/{MODEL}").json()["sampling_defaults"]
    for response in (
        server.set_defaults({"top_k": 3, **changes}),
        server.admin(
            "POST",
            "/models",
            json={"name": "refused", "path": str(checkpoint(tmp_path / "m")), "sampling_defaults": changes},
        ),
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
        assert param in error["message"]
    assert server.admin("GET", f"/models/{MODEL}").json()["sampling_defaults"] == before
    assert server.admin("GET", "/models/refused").status_code == 404
