"""The app's registry: engine numbers read at scrape time from the stats snapshot, one family per name
whatever the number of models, a replica label on Ray Serve, and a scrape that never holds the engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.registry import Collector

from app.observability.metrics import (
    OPENMETRICS_ACCEPT,
    Expositions,
    ModelMetrics,
    ModelReading,
    app_registry,
    exposition,
)
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats, TeamStats


def stats(**fields: object) -> EngineStats:
    return EngineStats(max_num_seqs=8, max_num_batched_tokens=256, kv_blocks_total=100, **fields)  # type: ignore[arg-type]


def samples_of(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value) for family in parse_text(text) for sample in family.samples if sample.name == name
    ]


def test_the_engine_is_read_at_scrape_time_not_copied():
    metrics = ModelMetrics("m")
    live = {"stats": stats(kv_blocks_used=25)}
    registry = app_registry(lambda: [ModelReading(metrics, live["stats"])])
    assert samples_of(exposition(registry, None)[0].decode(), "vllm:kv_cache_usage_perc") == [
        ({"model_name": "m"}, 0.25)
    ]
    live["stats"] = stats(kv_blocks_used=0)  # the engine published a new snapshot
    assert samples_of(exposition(registry, None)[0].decode(), "vllm:kv_cache_usage_perc") == [
        ({"model_name": "m"}, 0.0)
    ]


def test_two_models_share_each_family_and_keep_their_own_series():
    first, second = ModelMetrics("first"), ModelMetrics("second")
    first.time_to_first_token.observe(0.03)
    second.request_finished("stop")
    registry = app_registry(lambda: [ModelReading(first, stats(num_running=1)), ModelReading(second, stats())])
    text = exposition(registry, None)[0].decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert text.count("# TYPE vllm:time_to_first_token_seconds histogram") == 1
    assert sorted(samples_of(text, "vllm:num_requests_running"), key=str) == [
        ({"model_name": "first"}, 1.0),
        ({"model_name": "second"}, 0.0),
    ]
    assert ({"model_name": "first", "le": "0.04"}, 1.0) in samples_of(text, "vllm:time_to_first_token_seconds_bucket")
    assert ({"model_name": "first", "le": "0.02"}, 0.0) in samples_of(text, "vllm:time_to_first_token_seconds_bucket")
    assert samples_of(text, "vllm:request_success_total") == [
        ({"finished_reason": "stop", "model_name": "second"}, 1.0)
    ]


def test_an_unloaded_model_leaves_no_series_behind():
    served = [ModelReading(ModelMetrics("gone"), stats())]
    registry = app_registry(lambda: served)
    served.clear()
    text = exposition(registry, None)[0].decode()
    assert 'model_name="gone"' not in text and "# TYPE vllm:num_requests_running gauge" in text


def test_team_series_are_labelled_by_team_only():
    teams = {
        "team:1": TeamStats(running=2, waiting=1, prompt_tokens_total=30, generation_tokens_total=7),
        "default": TeamStats(),
    }
    registry = app_registry(lambda: [ModelReading(ModelMetrics("m"), stats(teams=teams))])
    text = exposition(registry, None)[0].decode()
    assert samples_of(text, "tokenmill:team_requests_running") == [
        ({"model_name": "m", "team": "default"}, 0.0),
        ({"model_name": "m", "team": "team:1"}, 2.0),
    ]
    assert ({"model_name": "m", "team": "team:1"}, 7.0) in samples_of(text, "tokenmill:team_generation_tokens_total")


def test_a_replica_labels_every_series_of_its_app_process_ones_too():
    metrics = ModelMetrics("m")
    metrics.e2e_request_latency.observe(1.2)
    registry = app_registry(
        lambda: [ModelReading(metrics, stats(teams={"default": TeamStats()}))], constant_labels={"replica": "r7"}
    )
    samples = [sample for family in parse_text(exposition(registry, None)[0].decode()) for sample in family.samples]
    assert {"vllm:e2e_request_latency_seconds_count", "process_resident_memory_bytes"} <= {s.name for s in samples}
    assert all(sample.labels.get("replica") == "r7" for sample in samples)


def test_replicas_expositions_merge_into_one_with_each_family_once():
    def replica_text(replica: str, running: int) -> str:
        metrics = ModelMetrics("m")
        metrics.time_to_first_token.observe(0.05)
        registry = app_registry(
            lambda: [ModelReading(metrics, stats(num_running=running))], constant_labels={"replica": replica}
        )
        return exposition(registry, OPENMETRICS_ACCEPT)[0].decode()

    merged = Expositions([replica_text("a", 1), replica_text("b", 2)])
    text = exposition(merged, None)[0].decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert text.count("# TYPE process_resident_memory_bytes gauge") == 1
    assert sorted(samples_of(text, "vllm:num_requests_running"), key=str) == [
        ({"model_name": "m", "replica": "a"}, 1.0),
        ({"model_name": "m", "replica": "b"}, 2.0),
    ]
    assert len(samples_of(text, "vllm:time_to_first_token_seconds_count")) == 2
    families = {family.name for family in parse_openmetrics(exposition(merged, OPENMETRICS_ACCEPT)[0].decode())}
    assert {"vllm:num_requests_running", "vllm:time_to_first_token_seconds", "vllm:request_success"} <= families


def test_openmetrics_keeps_the_colons_of_vllm_names():
    metrics = ModelMetrics("m")
    metrics.request_finished("length")
    registry = app_registry(lambda: [ModelReading(metrics, stats(generation_tokens_total=12))])
    body, content_type = exposition(registry, "application/openmetrics-text; version=1.0.0, text/plain;q=0.5")
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    families = {family.name: family for family in parse_openmetrics(body.decode())}
    assert [sample.value for sample in families["vllm:generation_tokens"].samples] == [12.0]
    assert {sample.name for sample in families["vllm:request_success"].samples} == {
        "vllm:request_success_total",
        "vllm:request_success_created",
    }
    assert exposition(registry, "text/plain")[1] == "text/plain; version=0.0.4; charset=utf-8"


# ---- a scrape during load ---------------------------------------------------------------------------


class WaitsForEngineSteps(Collector):
    """A family that takes as long to encode as the engine takes to run `steps` more steps: were the
    scrape holding anything the engine needs, the engine would stall and this would time out."""

    def __init__(self, engine: AsyncEngine, steps: int, timeout_s: float) -> None:
        self.engine, self.steps, self.timeout_s = engine, steps, timeout_s
        self.steps_seen = 0

    def collect(self) -> Iterator[Metric]:
        start = self.engine.stats().steps_total
        deadline = time.monotonic() + self.timeout_s
        while self.engine.stats().steps_total < start + self.steps and time.monotonic() < deadline:
            time.sleep(0.005)
        self.steps_seen = self.engine.stats().steps_total - start
        yield GaugeMetricFamily("test_slow_family", "Encoded while the engine runs.", value=1)


@pytest.mark.real_model
def test_a_scrape_in_progress_does_not_stop_the_engine(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    engine = AsyncEngine.start(config, load_model(config))
    try:
        metrics = ModelMetrics(engine.model_name)
        registry = app_registry(lambda: [ModelReading(metrics, engine.stats())])
        slow = WaitsForEngineSteps(engine, steps=20, timeout_s=30)
        registry.register(slow)

        async def generate() -> None:
            params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            async for _ in engine.generate("long", engine.tokenizer.encode("Once upon a time"), params):
                pass

        generation = threading.Thread(target=asyncio.run, args=(generate(),))
        generation.start()
        deadline = time.monotonic() + 30
        while engine.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        body, _ = exposition(registry, None)
        assert slow.steps_seen >= 20  # the engine kept decoding for the whole scrape
        assert samples_of(body.decode(), "vllm:num_requests_running")[0][1] == 1
        generation.join(60)
    finally:
        engine.shutdown()
