"""A real tokenmill server for tests: the real engine over the session's loaded model, uvicorn in a
thread on a free port, reached with the official openai client."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from app.cli.serve import IDLE_CONNECTION_TIMEOUT_S
from app.main import create_app
from app.settings import Settings
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class RunningServer:
    settings: Settings
    engine: AsyncEngine
    url: str  # http://127.0.0.1:PORT
    app: FastAPI

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=options.pop("api_key", "unused"), max_retries=0, **options)

    def async_client(self, **options) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=options.pop("api_key", "unused"), max_retries=0, **options
        )

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: sample name (with its labels other than the model's) -> value."""
        return sample_values(httpx.get(f"{self.url}/metrics").text)

    def wait_for_metrics(self, predicate, timeout: float = 15.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if predicate(values):
                return values
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never got there: {values}")
            time.sleep(0.05)

    def wait_for_record(self, gateway, endpoint: str, timeout: float = 10.0):
        """The usage row a test gateway received for `endpoint` (rows arrive as requests wind down)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = [record for record in gateway.records if record.endpoint == endpoint]
            if rows:
                return rows[-1]
            time.sleep(0.05)
        raise AssertionError(f"no usage row for {endpoint}")


def sample_values(exposition: str) -> dict[str, float]:
    """Every sample of a text-format exposition, parsed by prometheus_client, keyed as it is written
    without its model_name label: `vllm:request_success_total{finished_reason="length"}`."""
    values = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = ",".join(f'{name}="{value}"' for name, value in sample.labels.items() if name != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


@contextmanager
def running_server(loaded, *, engine_config: EngineConfig | None = None, gateway=None, **settings_fields):
    engine_config = engine_config or EngineConfig(dtype="float32", num_kv_blocks=512)
    settings = Settings(port=0, engine=engine_config, **settings_fields)
    engine = AsyncEngine.start(engine_config, loaded)
    app = create_app(settings, engine, gateway=gateway)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=IDLE_CONNECTION_TIMEOUT_S,  # as `tokenmill serve`
        )
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield RunningServer(settings, engine, f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
