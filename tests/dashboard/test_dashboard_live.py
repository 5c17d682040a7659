"""The live sampler: occupancy and KV use averaged over engine steps, token rates, percentiles over the
last minute, real cost per token (hardware cost over tokens produced), 15 minutes of history."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from prometheus_client import Histogram

from app.dashboard.histograms import HistogramCounts, quantile
from app.dashboard.live import LiveSampler, ModelSource, cost_per_million
from engine.stats import EngineStats

START = datetime(2026, 11, 29, 12, 0, tzinfo=UTC).timestamp()


class FakeModel:
    """Engine stats and latency histograms that a test moves by hand, and a clock."""

    def __init__(self) -> None:
        self.now = START
        self.stats = EngineStats(max_num_seqs=8, max_num_batched_tokens=100, kv_blocks_total=200)
        self.ttft = Histogram("ttft", "", buckets=(0.1, 0.2, 0.5, 1.0), registry=None)
        self.itl = Histogram("itl", "", buckets=(0.01, 0.02, 0.05), registry=None)

    def source(self) -> ModelSource:
        return ModelSource(
            "m", self.stats.snapshot, lambda: HistogramCounts.of(self.ttft), lambda: HistogramCounts.of(self.itl)
        )

    def steps(self, count: int, *, seqs: int, tokens: int, kv_blocks: int) -> None:
        s = self.stats
        s.steps_total += count
        s.scheduled_seqs_total += count * seqs
        s.scheduled_tokens_total += count * tokens
        s.kv_blocks_used = kv_blocks
        s.kv_blocks_used_step_sum += count * kv_blocks
        s.scheduled_seqs_last_step, s.scheduled_tokens_last_step = seqs, tokens


@pytest.fixture
def model():
    return FakeModel()


def sampler_for(model: FakeModel, **options) -> LiveSampler:
    return LiveSampler(lambda: [model.source()], clock=lambda: model.now, **options)


def tick(sampler: LiveSampler, model: FakeModel, seconds: float = 1.0) -> None:
    model.now += seconds
    sampler.sample()


def a_minute_of_tokens(sampler: LiveSampler, model: FakeModel, per_second: int) -> None:
    """Sixty one-second ticks, `per_second` tokens generated in each."""
    for _ in range(60):
        model.stats.generation_tokens_total += per_second
        tick(sampler, model)


def test_quantile_interpolates_inside_its_bucket():
    counts = HistogramCounts((0.1, 0.2, 0.5), (0, 10, 0, 0))
    assert quantile(0.5, counts) == pytest.approx(0.15)
    assert quantile(0.99, counts) == pytest.approx(0.199)


def test_quantile_of_nothing_is_none_and_of_the_overflow_bucket_is_the_last_bound():
    assert quantile(0.5, HistogramCounts((0.1,), (0, 0))) is None
    assert quantile(0.5, HistogramCounts((0.1, 0.2), (0, 0, 5))) == 0.2


def test_occupancy_and_kv_use_are_means_over_the_steps_in_the_window(model):
    sampler = sampler_for(model)
    sampler.sample()
    model.steps(10, seqs=2, tokens=50, kv_blocks=20)
    model.steps(10, seqs=6, tokens=10, kv_blocks=60)
    tick(sampler, model)
    current = sampler.current("m")
    assert current["seq_occupancy"] == pytest.approx(4 / 8)
    assert current["token_occupancy"] == pytest.approx(30 / 100)
    assert current["kv_usage"] == pytest.approx(40 / 200)
    assert (current["seqs_last_step"], current["tokens_last_step"], current["kv_usage_now"]) == (6, 10, 0.3)


def test_an_idle_engine_has_an_empty_batch(model):
    sampler = sampler_for(model)
    sampler.sample()
    tick(sampler, model)
    current = sampler.current("m")
    assert current["seq_occupancy"] == 0 and current["token_occupancy"] == 0
    assert current["tokens_out_per_s"] == 0 and current["cost_per_1m_out"] is None


def test_token_rates_are_per_second_over_the_last_ten_seconds(model):
    sampler = sampler_for(model)
    sampler.sample()
    for _ in range(20):
        model.stats.prompt_tokens_total += 30
        model.stats.generation_tokens_total += 10
        tick(sampler, model)
    current = sampler.current("m")
    assert current["tokens_in_per_s"] == pytest.approx(30)
    assert current["tokens_out_per_s"] == pytest.approx(10)


def test_real_cost_is_the_hardware_cost_over_the_tokens_produced(model):
    assert cost_per_million(3.6, 60, 60_000) == pytest.approx(1.0)  # $0.06 a minute over 60k tokens
    sampler = sampler_for(model, hardware_cost_per_hour=3.6)
    sampler.sample()
    a_minute_of_tokens(sampler, model, 1000)
    current = sampler.current("m")
    assert current["cost_per_1m_out"] == pytest.approx(1.0)
    assert current["today_cost_per_1m_out"] == pytest.approx(1.0)
    assert current["today_cost_usd"] == pytest.approx(0.06)
    assert current["today_tokens_out"] == 60_000


def test_a_hardware_cost_set_while_running_counts_from_then(model):
    """Set on the Models page: the minute's cost per token follows at once; today's is not repriced."""
    cost = {"per_hour": 0.0}
    sampler = sampler_for(model, hardware_cost_per_hour=lambda: cost["per_hour"])
    sampler.sample()
    a_minute_of_tokens(sampler, model, 1000)
    assert sampler.current("m")["cost_per_1m_out"] == 0 and sampler.current("m")["today_cost_usd"] == 0
    cost["per_hour"] = 3.6
    a_minute_of_tokens(sampler, model, 1000)
    current = sampler.current("m")
    assert current["cost_per_1m_out"] == pytest.approx(1.0) and current["hardware_cost_per_hour"] == 3.6
    assert current["today_cost_usd"] == pytest.approx(0.06)  # the second minute only
    assert current["today_cost_per_1m_out"] == pytest.approx(0.5)  # over both minutes' tokens
    assert sampler.live()["hardware_cost_per_hour"] == 3.6


def test_a_models_own_hardware_cost_wins_over_the_servers(model):
    own = ModelSource(name="m", stats=model.source().stats, hardware_cost_per_hour=lambda: 36.0)
    sampler = LiveSampler(lambda: [own], hardware_cost_per_hour=3.6, clock=lambda: model.now)
    sampler.sample()
    a_minute_of_tokens(sampler, model, 1000)
    assert sampler.current("m")["cost_per_1m_out"] == pytest.approx(10.0)


def test_a_fuller_batch_makes_tokens_cheaper(model):
    sampler = sampler_for(model, hardware_cost_per_hour=3.6)
    sampler.sample()
    a_minute_of_tokens(sampler, model, 100)
    sparse = sampler.current("m")["cost_per_1m_out"]
    a_minute_of_tokens(sampler, model, 800)
    assert sampler.current("m")["cost_per_1m_out"] == pytest.approx(sparse / 8)


def test_percentiles_cover_the_last_minute_only(model):
    sampler = sampler_for(model)
    for _ in range(100):
        model.ttft.observe(0.9)
    sampler.sample()
    for _ in range(70):
        tick(sampler, model)
    for _ in range(100):
        model.ttft.observe(0.15)
        model.itl.observe(0.015)
    tick(sampler, model)
    current = sampler.current("m")
    assert 0.1 <= current["ttft_p50"] <= 0.2 and current["ttft_p99"] <= 0.2
    assert 0.01 <= current["itl_p50"] <= 0.02


def test_prefix_hit_rate_is_over_the_last_minute(model):
    sampler = sampler_for(model)
    sampler.sample()
    model.stats.prefix_cache_queries += 400
    model.stats.prefix_cache_hits += 100
    tick(sampler, model)
    assert sampler.current("m")["prefix_hit_rate"] == pytest.approx(0.25)


def test_draft_acceptance_is_over_the_last_minute(model):
    sampler = sampler_for(model)
    sampler.sample()
    tick(sampler, model)
    assert sampler.current("m")["spec_acceptance_rate"] is None  # nothing drafted: no rate, not 0 %
    model.stats.spec_draft_tokens_total += 80
    model.stats.spec_accepted_tokens_total += 60
    tick(sampler, model)
    assert sampler.current("m")["spec_acceptance_rate"] == pytest.approx(0.75)


def test_history_keeps_fifteen_minutes(model):
    sampler = sampler_for(model)
    for _ in range(1200):
        tick(sampler, model)
    series = sampler.series("m")
    assert 899 <= len(series["t"]) <= 900
    assert series["t"][-1] - series["t"][0] <= 900


def test_series_after_a_time_holds_only_newer_points(model):
    sampler = sampler_for(model)
    for _ in range(5):
        tick(sampler, model)
    seen = sampler.series("m")["t"][-1]
    tick(sampler, model)
    tick(sampler, model)
    newer = sampler.series("m", after=seen)
    assert newer["t"] == [seen + 1, seen + 2]
    assert set(newer) >= {"tokens_out_per_s", "seq_occupancy", "kv_usage", "ttft_p99", "cost_per_1m_out", "running"}


def test_today_starts_again_at_utc_midnight(model):
    model.now = datetime(2026, 11, 29, 23, 59, 58, tzinfo=UTC).timestamp()
    sampler = sampler_for(model, hardware_cost_per_hour=1.0)
    sampler.sample()
    model.stats.generation_tokens_total += 500
    tick(sampler, model)
    assert sampler.current("m")["today_tokens_out"] == 500
    tick(sampler, model, 2)  # 00:00:01
    model.stats.generation_tokens_total += 70
    tick(sampler, model)
    current = sampler.current("m")
    assert current["today_tokens_out"] == 70
    assert datetime.fromtimestamp(current["today_since"], UTC).day == 30


def test_the_live_payload_samples_on_first_use(model):
    sampler = sampler_for(model)
    payload = sampler.live()
    assert [entry["current"]["name"] for entry in payload["models"]] == ["m"]
    assert payload["history_s"] == 900 and payload["interval_s"] == 1.0


def test_the_share_by_team_is_the_tokens_each_team_was_served_last_minute(model):
    import time

    from engine.stats import TeamStats

    second = int(time.monotonic())
    model.stats.teams = {
        "team:1": TeamStats(running=1, recent_tokens=((second - 5, 300),)),
        "team:2": TeamStats(waiting=2, recent_tokens=((second - 2, 900), (second - 90, 5000))),  # one is too old
        "team:3": TeamStats(recent_tokens=((second - 120, 50),)),  # nothing this minute, nothing now: left out
    }
    sampler = sampler_for(model, team_names=lambda: {"team:1": "alpha", "team:2": "beta"})
    tick(sampler, model)
    shares = sampler.current("m")["teams"]
    assert [(s["name"], s["tokens_last_minute"], s["running"], s["waiting"]) for s in shares] == [
        ("beta", 900, 0, 2),
        ("alpha", 300, 1, 0),
    ]
    assert sampler.live()["models"][0]["current"]["teams"] == shares  # what the overview polls
