"""A real Prometheus (Debian's `prometheus` package; skipped without it) scrapes a tokenmill server, and
every query of the Grafana dashboard returns series from what it stored."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from bench.servers import free_port
from engine.config import EngineConfig
from engine.loader import load_model
from tests.observability.test_grafana_dashboard import DASHBOARD, queries
from tests.support.server import running_server

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="apt-get install prometheus"),
]


def instant_query(prometheus: str, expr: str) -> list[dict]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert response["status"] == "success", (expr, response)
    return response["data"]["result"]


def wait_until(condition: Callable[[], list[dict] | None], timeout_s: float, what: str) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while (value := condition()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(0.25)
    return value


def test_prometheus_scrapes_us_and_every_dashboard_query_has_series(tiny_llama_dir, tmp_path: Path):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    with running_server(load_model(config), engine_config=config) as server:
        port = free_port()
        target = server.url.removeprefix("http://")
        (tmp_path / "prometheus.yml").write_text(
            f"global: {{scrape_interval: 1s}}\n"
            f"scrape_configs: [{{job_name: tokenmill, static_configs: [{{targets: ['{target}']}}]}}]\n"
        )
        prometheus = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            model = server.engine.model_name
            for index in range(3):  # traffic between scrapes, so that rates and quantiles have something
                response = httpx.post(
                    f"{server.url}/v1/completions",
                    timeout=60,
                    json={
                        "model": model,
                        "prompt": f"Tell me about number {index}",
                        "max_tokens": 16,
                        "ignore_eos": True,
                    },
                )
                assert response.status_code == 200
                time.sleep(1.2)

            def stored(expr: str) -> list[dict] | None:
                try:
                    return instant_query(url, expr) or None
                except httpx.HTTPError:
                    return None

            # OpenMetrics is what Prometheus asks for first: the vLLM names must arrive whole
            wait_until(lambda: stored('up{job="tokenmill"} == 1'), 60, "Prometheus never scraped us")
            [tokens] = wait_until(lambda: stored("vllm:generation_tokens_total"), 30, "no vLLM series")
            assert float(tokens["value"][1]) == 48 and tokens["metric"]["model_name"] == model
            wait_until(lambda: stored("count_over_time(vllm:generation_tokens_total[1m]) >= 4"), 30, "too few scrapes")
            dashboard = json.loads(DASHBOARD.read_text())
            empty = []
            for expr in queries(dashboard):
                expr = expr.replace("$__rate_interval", "1m").replace('"$model_name"', '".*"').replace('"$job"', '".*"')
                if not instant_query(url, expr):
                    empty.append(expr)
            assert not empty, f"dashboard queries without series: {empty}"
        finally:
            prometheus.terminate()
            try:
                prometheus.wait(10)
            except subprocess.TimeoutExpired:
                prometheus.kill()
