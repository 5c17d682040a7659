"""Test support for the gateway: databases (SQLite and PostgreSQL), Redis, a fake engine behind the
real /v1 routes, a fake clock, and uvicorn in a thread. Imported by the gateway tests; its fixtures are a plugin of tests/conftest.py."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text

from bench.servers import free_port
from engine.llm_engine import EngineRejected
from engine.outputs import RequestOutput, SequenceDelta

PG_SERVER = os.environ.get("TOKENMILL_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TOKENMILL_TEST_REDIS", "redis://127.0.0.1:6379/0")
FAKE_MODEL = "fake-model"
TABLES = (
    "batch_lines",
    "batches",
    "files",
    "reservation_holds",
    "server_settings",
    "response_input_items",
    "responses",
    "usage_daily",
    "usage",
    "admin_credentials",
    "api_keys",
    "teams",
    "models",
    "audit_log",
    "alembic_version",
)


def unavailable(what: str, error: Exception) -> None:
    """Skip when a service is missing on a developer's machine; fail in CI, where it must be there."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is required in CI: {error}")
    pytest.skip(f"{what} not reachable: {error}")


# ---- PostgreSQL: one fresh database per test session, dropped at the end ----


class PgDatabases:
    def __init__(self) -> None:
        self.admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT")
        self.created: list[str] = []

    def create(self, suffix: str = "") -> str:
        name = f"tokenmill_test_{os.getpid()}{suffix}"
        with self.admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            c.execute(text(f'CREATE DATABASE "{name}"'))
        self.created.append(name)
        return PG_SERVER.rsplit("/", 1)[0] + "/" + name

    def drop_all(self) -> None:
        with self.admin.connect() as c:
            for name in self.created:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        self.admin.dispose()


@pytest.fixture(scope="session")
def pg_databases():
    try:
        databases = PgDatabases()
        with databases.admin.connect() as c:
            c.execute(text("SELECT 1"))
    except Exception as error:
        unavailable("PostgreSQL", error)
    yield databases
    databases.drop_all()


@pytest.fixture(scope="session")
def pg_session_url(pg_databases):
    return pg_databases.create()


def reset_pg(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as c:
        existing = set(c.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars())
        present = [t for t in TABLES if t in existing and t != "alembic_version"]
        if present:
            c.execute(text(f"TRUNCATE {', '.join(present)} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """A clean database per test, on both back ends."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tokenmill.db'}"
    url = request.getfixturevalue("pg_session_url")
    reset_pg(url)
    return url


# ---- Redis ----


@pytest.fixture(scope="session")
def redis_url():
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
        client.ping()
        client.close()
    except Exception as error:
        unavailable("Redis", error)
    return REDIS_URL


def redis_prefix() -> str:
    return f"tokenmill-test:{os.getpid()}:{uuid.uuid4().hex[:8]}:"


# ---- time ----


class FakeClock:
    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def window_start_clock(window_s: float = 60.0) -> FakeClock:
    """A clock stopped one second into the current rate-limit window: a test whose requests must all
    count in one window (an rpm of 1, a tpm burst) would otherwise fail when one lands past a boundary."""
    return FakeClock(start=time.time() // window_s * window_s + 1)


# ---- a fake engine behind the real routes ----


@functools.lru_cache(maxsize=1)
def fake_tokenizer():
    """A word-level tokenizer with a chat template: one token per word, so counts are easy to predict."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in "tok hello world user assistant system : say hi one two three".split():
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    return tokenizer


class FakeEngine:
    """Answers instantly (or `token_delay_s` per token) with max_tokens copies of " tok"."""

    def __init__(self, token_delay_s: float = 0.0, model_name: str = FAKE_MODEL) -> None:
        from engine.config import EngineConfig

        self.config = EngineConfig()
        self.tokenizer = fake_tokenizer()
        self.model_name = model_name
        self.max_model_len = 4096
        self.token_delay_s = token_delay_s
        self.aborted: list[str] = []
        self.queue_full = False  # set to make it refuse after admission, as a full engine does
        self.tenancies: list = []  # what each generate() was told about its caller, in order

    def check_request(self, prompt_token_ids, params) -> None:
        if not prompt_token_ids:
            raise EngineRejected("invalid_prompt", "the prompt is empty", "prompt")
        if self.queue_full:
            raise EngineRejected("queue_full", "too many requests are waiting")

    async def generate(self, request_id: str, prompt_token_ids: list[int], params, tenancy=None, capacity=True):
        self.tenancies.append(tenancy)
        total = params.max_tokens or 16
        for i in range(total):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == total - 1
            yield RequestOutput(
                request_id,
                len(prompt_token_ids),
                0,
                [SequenceDelta(index, " tok", [3], None, "length" if last else None) for index in range(params.n)],
                finished=last,
            )

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self):
        from engine.stats import EngineStats

        return EngineStats(max_num_seqs=64, max_num_batched_tokens=2048, kv_blocks_total=100_000)


def prompt_tokens_of(content: str) -> int:
    """What the fake tokenizer makes of one user message under the fake chat template."""
    return len(f"user : {content} assistant :".split())


def build_app(gateway, engine=None, **settings_values):
    from app.main import create_app
    from app.settings import Settings

    return create_app(Settings(**settings_values), engine or FakeEngine(), gateway=gateway)


# ---- uvicorn in a thread ----


@contextmanager
def serve_in_thread(app, port: int | None = None, **config) -> Iterator[str]:
    """`port`: one picked beforehand, when the app must know its own URL (an SSO callback)."""
    import uvicorn

    port = port or free_port()
    config = {"log_level": "warning", "lifespan": "on", **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


# ---- gateways ----

ADMIN_KEY = "sk-admin-test-" + "x" * 24


def new_gateway(database_url: str, spill_dir, *, clock=None, **overrides):
    """A gateway (not started) on `database_url` with the tests' admin key, flushing usage every 50 ms;
    `overrides` are more GatewayConfig fields."""
    from app.gateway.config import GatewayConfig
    from app.gateway.service import TeamGateway

    values = {
        "database_url": database_url,
        "admin_key": ADMIN_KEY,
        "spill_dir": str(spill_dir),
        "usage_flush_interval_s": 0.05,
        **overrides,
    }
    return TeamGateway(GatewayConfig(**values), clock=clock or time.time)


def sqlite_gateway(folder, **overrides):
    """new_gateway on a SQLite file in `folder`, spilling there too."""
    return new_gateway(f"sqlite:///{folder / 'tokenmill.db'}", folder, **overrides)


@pytest.fixture
def make_gateway(database_url, tmp_path):
    """Gateway factory on the test's database; every gateway is stopped (flushed) at the end."""
    made = []

    def make(*, clock=None, start: bool = True, **overrides):
        gateway = new_gateway(database_url, tmp_path / "spill", clock=clock, **overrides)
        made.append(gateway)
        if start:
            gateway.start()
        return gateway

    yield make
    for gateway in made:
        gateway.stop()
        gateway.engine.dispose()


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(content: str = "say hello", max_tokens: int = 5, model: str = FAKE_MODEL, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def create_team(client, name: str = "alpha", **limits) -> dict:
    response = client.post("/admin/api/teams", json={"name": name, **limits}, headers=admin_headers())
    assert response.status_code == 201, response.text
    return response.json()


def create_key(client, team_id: int, **limits) -> dict:
    response = client.post("/admin/api/keys", json={"team_id": team_id, **limits}, headers=admin_headers())
    assert response.status_code == 201, response.text
    return response.json()


def usage_rows(gateway) -> list:
    """Every usage row, oldest first, after the writer has flushed."""
    from sqlalchemy import select

    from app.tables import UsageRow

    assert gateway.writer.flush(10)
    with gateway.sessions() as session:
        return list(session.scalars(select(UsageRow).order_by(UsageRow.id)))


# ---- `tokenmill serve` in this process ----


def uvicorn_in_thread(monkeypatch, probe) -> list:
    """Makes uvicorn.run, as `tokenmill serve` calls it, serve the app in a thread on a free port (under
    serve's other uvicorn options) and call `probe(url)` while it serves. Returns the list each start's
    probe result goes in."""
    import uvicorn

    results = []

    def run(app, **options) -> None:
        options = {name: value for name, value in options.items() if name not in ("host", "port")}
        with serve_in_thread(app, **options) as url:
            results.append(probe(url))

    monkeypatch.setattr(uvicorn, "run", run)
    return results


class StoppableFakeEngine(FakeEngine):
    """A fake engine `tokenmill serve` can shut down."""

    def shutdown(self) -> None:
        pass


def serve_fake_engine(monkeypatch) -> None:
    """Makes `tokenmill serve` build its app on a StoppableFakeEngine, with the gateway its settings name."""
    from app.gateway.wiring import gateway_from_settings
    from app.main import create_app

    def build_server(settings, migrated=False):
        engine = StoppableFakeEngine()
        return create_app(settings, engine, gateway=gateway_from_settings(settings, migrated=migrated)), engine

    monkeypatch.setattr("app.scaleout.replica_app.build_server", build_server)


def serve_and_probe(tmp_path, monkeypatch, probe, *flags: str, admin_key: str | None = ADMIN_KEY):
    """Runs `tokenmill serve` as a user would, in this process, with the fake engine and a SQLite database
    in `tmp_path`, under the uvicorn options serve chooses (on a free port); `probe(url)` runs while it
    serves. `admin_key`: TOKENMILL_ADMIN_KEY, None for none. Returns what the probe returned."""
    from app.cli.main import main

    if admin_key:
        monkeypatch.setenv("TOKENMILL_ADMIN_KEY", admin_key)
    else:
        monkeypatch.delenv("TOKENMILL_ADMIN_KEY", raising=False)
    serve_fake_engine(monkeypatch)
    results = uvicorn_in_thread(monkeypatch, probe)
    database = ["--database-url", f"sqlite:///{tmp_path / 'tokenmill.db'}"]
    assert main(["serve", "--data-dir", str(tmp_path), *database, "--log-level", "warning", *flags]) == 0
    return results[0]
