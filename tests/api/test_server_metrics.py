"""/metrics speaks Prometheus with vLLM's names; /health answers without a key."""
from __future__ import annotations

import httpx
import pytest

from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

VLLM_NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds"]


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2, api_key="sk-metrics") as running:
        yield running


def test_health_needs_no_key(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_metrics_carry_vllm_names_with_the_model_label(server):
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    for name in VLLM_NAMES:
        assert f'{name}{{model_name="{MODEL}"}} ' in text, name
    for name in HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text
        assert f'{name}_bucket{{model_name="{MODEL}",le="+Inf"}} ' in text


def test_a_request_moves_the_counters_and_histograms(server):
    before = server.metrics()
    client = server.client(api_key="sk-metrics")
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = server.metrics()
    usage = response.usage
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == usage.prompt_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 4
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after['vllm:request_success_total{finished_reason="length"}'] >= 1
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
