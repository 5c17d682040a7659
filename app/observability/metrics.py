"""/metrics: engine stats under vLLM's metric names (dashboards and autoscalers work as is), plus the
latencies only the app can see (time to first token, between tokens, end to end)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

from app.observability.prometheus import Histogram, Labels, counter, gauge, header, sample
from engine.stats import TeamStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Time between successive output tokens of a request.", ITL_BUCKETS)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Time from request arrival to its end.", E2E_BUCKETS)
        self.finished_requests: Counter[str] = Counter()
        self._collectors: list[Callable[[], list[str]]] = []

    def add_collector(self, collect: Callable[[], list[str]]) -> None:
        """More metric families for /metrics (the gateway's own), as Prometheus text lines."""
        self._collectors.append(collect)

    def render(self, stats) -> str:
        labels = self.labels
        preemptions = stats.num_preemptions_recompute + stats.num_preemptions_swap
        lines = [
            *gauge("vllm:num_requests_running", "Requests in the running batch.", labels, stats.num_running),
            *gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, stats.num_waiting),
            *gauge("vllm:num_requests_swapped", "Requests swapped out to the CPU pool.", labels, stats.num_swapped),
            *gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", labels,
                   stats.kv_usage),
            *counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                     [(labels, stats.prefix_cache_queries)]),
            *counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                     [(labels, stats.prefix_cache_hits)]),
            *counter("vllm:num_preemptions_total", "Preemptions (recompute and swap).", [(labels, preemptions)]),
            *counter("vllm:prompt_tokens_total", "Prompt tokens processed.", [(labels, stats.prompt_tokens_total)]),
            *counter("vllm:generation_tokens_total", "Tokens generated.", [(labels, stats.generation_tokens_total)]),
            *counter("vllm:request_success_total", "Finished requests by finish reason.",
                     [({**labels, "finished_reason": reason}, count)
                      for reason, count in sorted(self.finished_requests.items())]),
            *self.time_to_first_token.render(labels),
            *self.inter_token_latency.render(labels),
            *self.e2e_request_latency.render(labels),
            *gauge("tokenmill:kv_blocks_total", "KV cache blocks in the pool.", labels, stats.kv_blocks_total),
            *gauge("tokenmill:kv_blocks_used", "KV cache blocks in use.", labels, stats.kv_blocks_used),
            *gauge("tokenmill:batch_seq_occupancy", "Sequences in the last step over max_num_seqs.", labels,
                   stats.scheduled_seqs_last_step / max(stats.max_num_seqs, 1)),
            *gauge("tokenmill:batch_token_occupancy", "Tokens in the last step over max_num_batched_tokens.",
                   labels, stats.scheduled_tokens_last_step / max(stats.max_num_batched_tokens, 1)),
            *counter("tokenmill:preemptions_total", "Preemptions by mode.",
                     [({**labels, "mode": "recompute"}, stats.num_preemptions_recompute),
                      ({**labels, "mode": "swap"}, stats.num_preemptions_swap)]),
            *counter("tokenmill:engine_steps_total", "Engine steps run.", [(labels, stats.steps_total)]),
            *counter("tokenmill:engine_step_seconds_total", "Time spent in engine steps.",
                     [(labels, stats.step_time_seconds_total)]),
            *counter("tokenmill:fair_preemptions_total", "Preemptions that gave another team its turn.",
                     [(labels, stats.num_preemptions_fair)]),
            *team_lines(labels, stats.teams),
        ]
        for collect in self._collectors:
            lines.extend(collect())
        return "\n".join(lines) + "\n"


def team_lines(labels: Labels, teams: Mapping[str, TeamStats]) -> list[str]:
    """Each team's share of the engine. Labelled by the engine's team id ('team:<id>', or 'default'
    without the gateway), never by key or team name: one series per team, and nothing a name would leak."""
    by_team = [({**labels, "team": team}, stats) for team, stats in sorted(teams.items())]
    series = (
        ("tokenmill:team_requests_running", "gauge", "A team's sequences running or swapped out.",
         lambda s: s.running),
        ("tokenmill:team_requests_waiting", "gauge", "A team's sequences waiting for a seat.", lambda s: s.waiting),
        ("tokenmill:team_tokens_last_minute", "gauge", "Prompt and generated tokens a team was served in the last 60 s.",
         lambda s: s.tokens_last_minute()),
        ("tokenmill:team_prompt_tokens_total", "counter", "Prompt tokens a team was served.",
         lambda s: s.prompt_tokens_total),
        ("tokenmill:team_generation_tokens_total", "counter", "Tokens generated for a team.",
         lambda s: s.generation_tokens_total),
    )
    lines: list[str] = []
    for name, kind, help_text, value_of in series:
        lines += [*header(name, kind, help_text), *(sample(name, team_labels, value_of(stats))
                                                     for team_labels, stats in by_team)]
    return lines


def merge_expositions(texts: list[str]) -> str:
    """Several models' /metrics text as one: each family's HELP and TYPE once, then every model's
    samples of it (Prometheus refuses a family declared twice)."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    family = ""
    for text in texts:
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                known = headers.setdefault(family, [])
                samples.setdefault(family, [])
                if line not in known:
                    known.append(line)
            elif line:
                samples.setdefault(family, []).append(line)
                headers.setdefault(family, [])
    return "".join(line + "\n" for name in headers for line in (*headers[name], *samples[name]))
