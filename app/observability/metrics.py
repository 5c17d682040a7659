"""/metrics on prometheus_client: engine stats under vLLM's metric names (dashboards and autoscalers work
as is), plus the latencies only the app can see (time to first token, between tokens, end to end).

One CollectorRegistry per app. The engine's numbers are not copied into metric objects: `ServedModelsCollector`
reads each engine's latest stats snapshot when Prometheus scrapes, so there is one source of truth and no
engine lock is taken (the engine thread publishes a fresh snapshot after every step)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from engine.stats import EngineStats, TeamStats

# vLLM's bucket boundaries, so that its dashboards' histogram_quantile panels read ours alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ModelMetrics:
    """What the app observes of one served model's requests. Unregistered on purpose: the app's collector
    adds them to /metrics with the model's label while the model is served, and they go with it."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time from request arrival to its first token.",
            buckets=TTFT_BUCKETS, registry=None)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Time between successive output tokens of a request.",
            buckets=ITL_BUCKETS, registry=None)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Time from request arrival to its end.", buckets=E2E_BUCKETS,
            registry=None)
        # finish reasons are the engine's few ("stop", "length", "abort"...), so the label stays bounded
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=None)

    def request_finished(self, finish_reason: str) -> None:
        self.request_success.labels(finish_reason).inc()

    def families(self) -> list[Metric]:
        return [family for metric in (self.request_success, self.time_to_first_token, self.inter_token_latency,
                                      self.e2e_request_latency) for family in metric.collect()]


@dataclass(frozen=True)
class ModelReading:
    """One served model at scrape time: its engine's stats snapshot and its own latency metrics."""
    metrics: ModelMetrics
    stats: EngineStats


_Read = Callable[[EngineStats], float]
ENGINE_GAUGES: tuple[tuple[str, str, _Read], ...] = (
    ("vllm:num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    ("vllm:num_requests_swapped", "Requests swapped out to the CPU pool.", lambda s: s.num_swapped),
    ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", lambda s: s.kv_usage),
    ("tokenmill:kv_blocks_total", "KV cache blocks in the pool.", lambda s: s.kv_blocks_total),
    ("tokenmill:kv_blocks_used", "KV cache blocks in use.", lambda s: s.kv_blocks_used),
    ("tokenmill:batch_seq_occupancy", "Sequences in the last step over max_num_seqs.",
     lambda s: s.scheduled_seqs_last_step / max(s.max_num_seqs, 1)),
    ("tokenmill:batch_token_occupancy", "Tokens in the last step over max_num_batched_tokens.",
     lambda s: s.scheduled_tokens_last_step / max(s.max_num_batched_tokens, 1)),
)
# Names without `_total`: prometheus_client adds it to a counter's samples (and `_created` in OpenMetrics).
ENGINE_COUNTERS: tuple[tuple[str, str, _Read], ...] = (
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries),
    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
    ("vllm:num_preemptions", "Preemptions (recompute and swap).", lambda s: s.num_preemptions),
    ("vllm:prompt_tokens", "Prompt tokens processed.", lambda s: s.prompt_tokens_total),
    ("vllm:generation_tokens", "Tokens generated.", lambda s: s.generation_tokens_total),
    ("tokenmill:engine_steps", "Engine steps run.", lambda s: s.steps_total),
    ("tokenmill:engine_step_seconds", "Time spent in engine steps.", lambda s: s.step_time_seconds_total),
    ("tokenmill:fair_preemptions", "Preemptions that gave another team its turn.", lambda s: s.num_preemptions_fair),
)
_ReadTeam = Callable[[TeamStats], float]
# Labelled by the engine's team id ('team:<id>', or 'default' without the gateway), never by key or team
# name: one series per team, and nothing a name would leak.
TEAM_GAUGES: tuple[tuple[str, str, _ReadTeam], ...] = (
    ("tokenmill:team_requests_running", "A team's sequences running or swapped out.", lambda t: t.running),
    ("tokenmill:team_requests_waiting", "A team's sequences waiting for a seat.", lambda t: t.waiting),
    ("tokenmill:team_tokens_last_minute", "Prompt and generated tokens a team was served in the last 60 s.",
     lambda t: t.tokens_last_minute()),
)
TEAM_COUNTERS: tuple[tuple[str, str, _ReadTeam], ...] = (
    ("tokenmill:team_prompt_tokens", "Prompt tokens a team was served.", lambda t: t.prompt_tokens_total),
    ("tokenmill:team_generation_tokens", "Tokens generated for a team.", lambda t: t.generation_tokens_total),
)


class ServedModelsCollector(Collector):
    """Every served model's engine numbers and latencies, each family once with one series per model
    (Prometheus refuses a family declared twice). `read_models` is called at every scrape."""

    def __init__(self, read_models: Callable[[], Iterable[ModelReading]],
                 constant_labels: Mapping[str, str] | None = None) -> None:
        self.read_models = read_models
        self.constant_labels = dict(constant_labels or {})

    def collect(self) -> Iterator[Metric]:
        readings = list(self.read_models())
        own = list(self.constant_labels)
        own_values = list(self.constant_labels.values())
        model_labels = [*own, "model_name"]

        def by_model(family: GaugeMetricFamily | CounterMetricFamily, read: _Read) -> Metric:
            for reading in readings:
                family.add_metric([*own_values, reading.metrics.model_name], read(reading.stats))
            return family

        for name, help_text, read in ENGINE_GAUGES:
            yield by_model(GaugeMetricFamily(name, help_text, labels=model_labels), read)
        for name, help_text, read in ENGINE_COUNTERS:
            yield by_model(CounterMetricFamily(name, help_text, labels=model_labels), read)
        preemptions = CounterMetricFamily("tokenmill:preemptions", "Preemptions by mode.",
                                          labels=[*model_labels, "mode"])
        for reading in readings:
            labels = [*own_values, reading.metrics.model_name]
            preemptions.add_metric([*labels, "recompute"], reading.stats.num_preemptions_recompute)
            preemptions.add_metric([*labels, "swap"], reading.stats.num_preemptions_swap)
        yield preemptions
        team_labels = [*model_labels, "team"]
        team_families: list[tuple[GaugeMetricFamily | CounterMetricFamily, _ReadTeam]] = [
            *((GaugeMetricFamily(name, help_text, labels=team_labels), read) for name, help_text, read in TEAM_GAUGES),
            *((CounterMetricFamily(name, help_text, labels=team_labels), read)
              for name, help_text, read in TEAM_COUNTERS)]
        for reading in readings:
            for team, team_stats in sorted(reading.stats.teams.items()):
                for family, read_team in team_families:
                    family.add_metric([*own_values, reading.metrics.model_name, team], read_team(team_stats))
        yield from (family for family, _ in team_families)
        yield from self._latency_families(readings)

    def _latency_families(self, readings: list[ModelReading]) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for reading in readings:
            labels = {**self.constant_labels, "model_name": reading.metrics.model_name}
            for family in reading.metrics.families():
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples.extend(sample._replace(labels={**labels, **sample.labels}) for sample in family.samples)
        yield from merged.values()


def app_registry(read_models: Callable[[], Iterable[ModelReading]],
                 constant_labels: Mapping[str, str] | None = None) -> CollectorRegistry:
    """The registry /metrics encodes: the served models, and the process, platform and GC collectors
    (resident memory, CPU seconds, open fds, Python version) that every dashboard's first row uses."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServedModelsCollector(read_models, constant_labels))
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)  # they describe this process and hold no state: shared between apps
    return registry


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """(body, content type): OpenMetrics 1.0 when the scraper asks for it, else the text format 0.0.4.

    Not prometheus_client's choose_encoder: its OpenMetrics default (escaping=underscores) rewrites the
    colons of sample names but not of their # TYPE lines (prometheus/client_python#1177), which splits every
    `vllm:` family in two. Our names are all valid legacy names, so allow-utf-8 writes them as they are."""
    wants_openmetrics = any(part.split(";")[0].strip() == "application/openmetrics-text"
                            for part in (accept or "").split(","))
    if wants_openmetrics:
        return openmetrics.generate_latest(registry, escaping=openmetrics.ALLOWUTF8), openmetrics.CONTENT_TYPE_LATEST
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4
