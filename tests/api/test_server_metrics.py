"""/metrics speaks Prometheus (text 0.0.4, or OpenMetrics when asked) with vLLM's names, and its numbers
are what the engine did; /health answers without a key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from engine.config import EngineConfig
from engine.loader import load_model
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

VLLM_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
VLLM_COUNTERS = [
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
]  # exposed as <name>_total
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
]
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2, api_key="sk-metrics") as running:
        yield running


def families_by_name(families: Iterable[Metric]) -> dict[str, Metric]:
    return {family.name: family for family in families}


def model_value(family: Metric, sample_name: str, model: str, **labels: str) -> float:
    [value] = [
        sample.value
        for sample in family.samples
        if sample.name == sample_name and sample.labels == {"model_name": model, **labels}
    ]
    return value


def test_health_needs_no_key(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_metrics_carry_vllm_names_with_the_model_label(server):
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = families_by_name(parse_text(response.text))
    for name in VLLM_GAUGES:
        assert families[name].type == "gauge", name
        model_value(families[name], name, MODEL)
    for name in VLLM_COUNTERS:
        assert families[name].type == "counter", name  # the family's name is without `_total`
        model_value(families[name], name + "_total", MODEL)
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
        model_value(families[name], f"{name}_bucket", MODEL, le="+Inf")


def test_openmetrics_when_the_scraper_asks_for_it(server):
    response = httpx.get(f"{server.url}/metrics", headers={"Accept": OPENMETRICS})
    assert response.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert response.text.endswith("# EOF\n")
    families = families_by_name(parse_openmetrics(response.text))  # strict: refuses a family split in two
    for name in VLLM_GAUGES:
        model_value(families[name], name, MODEL)
    for name in VLLM_COUNTERS:
        assert families[name].type == "counter", name
        model_value(families[name], name + "_total", MODEL)
    for name in HISTOGRAMS:
        model_value(families[name], f"{name}_bucket", MODEL, le="+Inf")
        model_value(families[name], f"{name}_created", MODEL)  # when the series began: counter resets show


def test_process_and_platform_metrics_come_with_the_engines(server):
    families = families_by_name(parse_text(httpx.get(f"{server.url}/metrics").text))
    assert families["process_resident_memory_bytes"].samples[0].value > 100e6  # a model is loaded
    assert families["process_cpu_seconds"].samples[0].value > 0  # process_cpu_seconds_total
    assert families["process_open_fds"].samples[0].value > 0
    assert families["python_info"].samples[0].labels["implementation"] == "CPython"


def test_a_request_moves_the_counters_and_histograms(server):
    before = server.metrics()
    client = server.client(api_key="sk-metrics")
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics()
    usage = response.usage
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == usage.prompt_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 4
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after['vllm:request_success_total{finished_reason="length"}'] >= 1
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


def test_speculative_decoding_counters_move_for_an_answer_that_copies(server):
    before = server.metrics()
    client = server.client(api_key="sk-metrics")
    text = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Repeat this text exactly: {text}"}],
        max_tokens=24,
        temperature=0,
    )
    after = server.metrics()
    drafted = after["vllm:spec_decode_num_draft_tokens_total"] - before["vllm:spec_decode_num_draft_tokens_total"]
    accepted = (
        after["vllm:spec_decode_num_accepted_tokens_total"] - before["vllm:spec_decode_num_accepted_tokens_total"]
    )
    assert 0 < accepted <= drafted
    assert after["vllm:spec_decode_num_drafts_total"] > before["vllm:spec_decode_num_drafts_total"]
    assert after["tokenmill:spec_decode_acceptance_rate"] == pytest.approx(
        after["vllm:spec_decode_num_accepted_tokens_total"] / after["vllm:spec_decode_num_draft_tokens_total"]
    )


# ---- a small KV pool, so that concurrent requests preempt each other ----------------------------------

CROWD, MAX_TOKENS = 4, 40


@pytest.fixture(scope="module")
def crowded(tiny_llama_dir):
    # 6 blocks of 16 tokens: each request alone fits (prompt + 40 tokens < 4 blocks); four at once do not.
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=6, block_size=16)
    with running_server(load_model(config), engine_config=config) as running:
        yield running


async def crowd_of_requests(url: str, model: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(index: int) -> dict:
            body = {
                "model": model,
                "prompt": f"Request number {index} says",
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        return await asyncio.gather(*(one(index) for index in range(CROWD)))


def test_metrics_after_a_crowd_are_what_the_engine_did(crowded):
    model = crowded.engine.model_name
    before = crowded.metrics()
    answers = asyncio.run(crowd_of_requests(crowded.url, model))
    # The stats snapshot is published after each engine step: wait for the one after the last request left.
    after = crowded.wait_for_metrics(lambda values: values["vllm:num_requests_running"] == 0)
    engine = crowded.engine.stats()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("vllm:prompt_tokens_total") == sum(answer["usage"]["prompt_tokens"] for answer in answers)
    assert moved("vllm:generation_tokens_total") == CROWD * MAX_TOKENS
    assert moved('vllm:request_success_total{finished_reason="length"}') == CROWD
    assert moved("vllm:e2e_request_latency_seconds_count") == CROWD
    assert moved("vllm:num_preemptions_total") > 0  # the pool is too small for all four at once
    assert after["vllm:num_preemptions_total"] == engine.num_preemptions
    assert after['tokenmill:preemptions_total{mode="recompute"}'] == engine.num_preemptions_recompute
    assert after["vllm:kv_cache_usage_perc"] == 0.0  # every block came back
    assert after["tokenmill:kv_blocks_used"] == 0 and after["tokenmill:kv_blocks_total"] == 6
    assert after["vllm:num_requests_waiting"] == 0
    assert (
        after['tokenmill:team_generation_tokens_total{team="default"}']
        == engine.teams["default"].generation_tokens_total
    )
