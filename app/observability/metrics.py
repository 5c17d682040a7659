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
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.registry import Collector

from engine.stats import EngineStats, TeamStats

# vLLM's bucket boundaries, so that its dashboards' histogram_quantile panels read ours alike.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class ModelMetrics:
    """What the app observes of one served model's requests. Unregistered on purpose: the app's collector
    adds them to /metrics with the model's label while the model is served, and they go with it."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            buckets=TTFT_BUCKETS,
            registry=None,
        )
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive output tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=None,
        )
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from request arrival to its end.",
            buckets=E2E_BUCKETS,
            registry=None,
        )
        # Where time to first token goes, per stage: `admission` (the route took the HTTP request to admitted:
        # chat template, tokenization, the gateway's holds, the fair admission queue), `queue` (admitted to
        # the engine's first step for it), `prefill` (that step to the first token). Labelled by stage only.
        self.request_stage = Histogram(
            "tokenmill:request_stage_seconds",
            "Time a request spends in each stage before its first token: admission, queue, prefill.",
            ["stage"],
            buckets=TTFT_BUCKETS,
            registry=None,
        )
        # finish reasons are the engine's few ("stop", "length", "abort"...), so the label stays bounded
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=None
        )

    def request_finished(self, finish_reason: str) -> None:
        self.request_success.labels(finish_reason).inc()

    def families(self) -> list[Metric]:
        return [
            family
            for metric in (
                self.request_success,
                self.time_to_first_token,
                self.inter_token_latency,
                self.e2e_request_latency,
                self.request_stage,
            )
            for family in metric.collect()
        ]


@dataclass(frozen=True)
class ModelReading:
    """One served model at scrape time: its engine's stats snapshot and its own latency metrics."""

    metrics: ModelMetrics
    stats: EngineStats
    weight_format: str = ""


_Read = Callable[[EngineStats], float]
ENGINE_GAUGES: tuple[tuple[str, str, _Read], ...] = (
    ("vllm:num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    ("vllm:num_requests_swapped", "Requests swapped out to the CPU pool.", lambda s: s.num_swapped),
    ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", lambda s: s.kv_usage),
    ("tokenmill:kv_blocks_total", "KV cache blocks in the pool.", lambda s: s.kv_blocks_total),
    ("tokenmill:kv_blocks_used", "KV cache blocks in use.", lambda s: s.kv_blocks_used),
    (
        "tokenmill:batch_seq_occupancy",
        "Sequences in the last step over max_num_seqs.",
        lambda s: s.scheduled_seqs_last_step / max(s.max_num_seqs, 1),
    ),
    (
        "tokenmill:batch_token_occupancy",
        "Tokens in the last step over max_num_batched_tokens.",
        lambda s: s.scheduled_tokens_last_step / max(s.max_num_batched_tokens, 1),
    ),
    (
        "tokenmill:step_token_budget",
        "Token budget of the next step: max_num_batched_tokens, or less to keep a step near max_step_seconds.",
        lambda s: s.step_token_budget,
    ),
    (
        "tokenmill:spec_decode_acceptance_rate",
        "Speculated draft tokens accepted over those drafted, since the start (0 before any draft).",
        lambda s: s.spec_acceptance_rate,
    ),
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
    # vLLM v1's speculative decoding counters: acceptance rate = accepted / draft tokens over any window.
    ("vllm:spec_decode_num_drafts", "Sequence steps that carried speculated drafts.", lambda s: s.spec_num_drafts),
    ("vllm:spec_decode_num_draft_tokens", "Speculated draft tokens verified.", lambda s: s.spec_draft_tokens_total),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "Speculated draft tokens the model accepted.",
        lambda s: s.spec_accepted_tokens_total,
    ),
)
_ReadTeam = Callable[[TeamStats], float]
# Labelled by the engine's team id ('team:<id>', or 'default' without the gateway), never by key or team
# name: one series per team, and nothing a name would leak.
TEAM_GAUGES: tuple[tuple[str, str, _ReadTeam], ...] = (
    ("tokenmill:team_requests_running", "A team's sequences running or swapped out.", lambda t: t.running),
    ("tokenmill:team_requests_waiting", "A team's sequences waiting for a seat.", lambda t: t.waiting),
    (
        "tokenmill:team_tokens_last_minute",
        "Prompt and generated tokens a team was served in the last 60 s.",
        lambda t: t.tokens_last_minute(),
    ),
)
TEAM_COUNTERS: tuple[tuple[str, str, _ReadTeam], ...] = (
    ("tokenmill:team_prompt_tokens", "Prompt tokens a team was served.", lambda t: t.prompt_tokens_total),
    ("tokenmill:team_generation_tokens", "Tokens generated for a team.", lambda t: t.generation_tokens_total),
)


class ServedModelsCollector(Collector):
    """Every served model's engine numbers and latencies, each family once with one series per model
    (Prometheus refuses a family declared twice). `read_models` is called at every scrape."""

    def __init__(self, read_models: Callable[[], Iterable[ModelReading]]) -> None:
        self.read_models = read_models

    def collect(self) -> Iterator[Metric]:
        readings = list(self.read_models())
        model_labels = ["model_name"]

        def by_model(family: GaugeMetricFamily | CounterMetricFamily, read: _Read) -> Metric:
            for reading in readings:
                family.add_metric([reading.metrics.model_name], read(reading.stats))
            return family

        for name, help_text, read in ENGINE_GAUGES:
            yield by_model(GaugeMetricFamily(name, help_text, labels=model_labels), read)
        for name, help_text, read in ENGINE_COUNTERS:
            yield by_model(CounterMetricFamily(name, help_text, labels=model_labels), read)
        preemptions = CounterMetricFamily(
            "tokenmill:preemptions", "Preemptions by mode.", labels=[*model_labels, "mode"]
        )
        for reading in readings:
            labels = [reading.metrics.model_name]
            preemptions.add_metric([*labels, "recompute"], reading.stats.num_preemptions_recompute)
            preemptions.add_metric([*labels, "swap"], reading.stats.num_preemptions_swap)
        yield preemptions
        formats = GaugeMetricFamily(
            "tokenmill:model_weight_format",
            "1 for the weight format each loaded model runs (e.g. 'gguf Q4_K/Q6_K -> int4k/int6k', 'bfloat16').",
            labels=[*model_labels, "weight_format"],
        )
        for reading in readings:
            formats.add_metric([reading.metrics.model_name, reading.weight_format or "unknown"], 1)
        yield formats
        team_labels = [*model_labels, "team"]
        team_families: list[tuple[GaugeMetricFamily | CounterMetricFamily, _ReadTeam]] = [
            *((GaugeMetricFamily(name, help_text, labels=team_labels), read) for name, help_text, read in TEAM_GAUGES),
            *(
                (CounterMetricFamily(name, help_text, labels=team_labels), read)
                for name, help_text, read in TEAM_COUNTERS
            ),
        ]
        for reading in readings:
            for team, team_stats in sorted(reading.stats.teams.items()):
                for family, read_team in team_families:
                    family.add_metric([reading.metrics.model_name, team], read_team(team_stats))
        yield from (family for family, _ in team_families)
        yield from self._latency_families(readings)

    def _latency_families(self, readings: list[ModelReading]) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for reading in readings:
            labels = {"model_name": reading.metrics.model_name}
            for family in reading.metrics.families():
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples.extend(sample._replace(labels={**labels, **sample.labels}) for sample in family.samples)
        yield from merged.values()


class WithLabels(Collector):
    """Another collector's families with `labels` added to every sample: a Ray Serve replica's id, so
    that the ingress can put every replica's series side by side."""

    def __init__(self, inner: Collector, labels: Mapping[str, str]) -> None:
        self.inner = inner
        self.labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(labels={**self.labels, **sample.labels}) for sample in family.samples]
            yield labelled


def app_registry(
    read_models: Callable[[], Iterable[ModelReading]], constant_labels: Mapping[str, str] | None = None
) -> CollectorRegistry:
    """The registry /metrics encodes: the served models, and the process, platform and GC collectors
    (resident memory, CPU seconds, open fds, Python version) that every dashboard's first row uses."""
    registry = CollectorRegistry(auto_describe=False)
    # The process collectors describe this process and hold no state: the library's own are shared.
    for collector in (ServedModelsCollector(read_models), PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(WithLabels(collector, constant_labels) if constant_labels else collector)
    return registry


class Expositions(Collector):
    """Several processes' OpenMetrics expositions (Ray Serve replicas, each with its own `replica` label)
    as one: each family once, with every process's samples of it."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.families: dict[str, Metric] = {}
        for text in texts:
            for family in parse_openmetrics(text):
                merged = self.families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                merged.samples.extend(family.samples)

    def collect(self) -> Iterator[Metric]:
        yield from self.families.values()


def exposition(registry: Collector, accept: str | None) -> tuple[bytes, str]:
    """(body, content type): OpenMetrics 1.0 when the scraper asks for it, else the text format 0.0.4.

    Not prometheus_client's choose_encoder: its OpenMetrics default (escaping=underscores) rewrites the
    colons of sample names but not of their # TYPE lines (prometheus/client_python#1177), which splits every
    `vllm:` family in two. Our names are all valid legacy names, so allow-utf-8 writes them as they are."""
    wants_openmetrics = any(
        part.split(";")[0].strip() == "application/openmetrics-text" for part in (accept or "").split(",")
    )
    if wants_openmetrics:
        return openmetrics.generate_latest(registry, escaping=openmetrics.ALLOWUTF8), openmetrics.CONTENT_TYPE_LATEST
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0"
