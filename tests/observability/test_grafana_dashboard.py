"""deploy/grafana/tokenmill-vllm.json: a dashboard Grafana imports, whose every query names a series
that tokenmill's /metrics really exposes (a renamed metric would leave a panel silently empty)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from app.observability.metrics import ModelMetrics, ModelReading, app_registry, exposition
from engine.stats import EngineStats, TeamStats

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "tokenmill-vllm.json"
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
}


def exposed_sample_names() -> set[str]:
    """Every sample name one model's app writes, with a team and a finished request in it."""
    metrics = ModelMetrics("m")
    metrics.request_finished("stop")
    stats = EngineStats(max_num_seqs=8, max_num_batched_tokens=256, kv_blocks_total=10, teams={"default": TeamStats()})
    text = exposition(app_registry(lambda: [ModelReading(metrics, stats)]), None)[0].decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression selects: identifiers that are not functions, label names or keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # label matchers, range durations
    expr = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping label lists
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        following = expr[match.end() :].lstrip()[:1]
        if following != "(" and match[0].lower() not in PROMQL_WORDS:
            names.add(match[0])
    return names


def queries(dashboard: dict) -> list[str]:
    panel_queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    variable_queries = [
        re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", variable["definition"])
        for variable in dashboard["templating"]["list"]
        if variable["type"] == "query"
    ]
    return panel_queries + variable_queries


def test_the_dashboard_is_grafana_json_with_a_query_on_every_panel():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(graphs) >= 10
    for panel in graphs:
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]  # whichever Prometheus one picks
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}


def test_every_query_names_a_series_tokenmill_exposes():
    exposed = exposed_sample_names()
    named = set()
    for expr in queries(json.loads(DASHBOARD.read_text())):
        names = metric_names(expr)
        assert names, expr
        assert names <= exposed, f"{expr}: {sorted(names - exposed)} is not in /metrics"
        named |= names
    # the vLLM series a vLLM dashboard is for are all on it
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_success_total",
    ):
        assert name in named, name


def test_the_name_finder_tells_series_from_functions_and_labels():
    expr = 'histogram_quantile(0.9, sum by (le, model_name) (rate(vllm:x_bucket{a="b:c"}[5m]))) / on(job) up'
    assert metric_names(expr) == {"vllm:x_bucket", "up"}
