"""Real cost per token (app/observability/costs.py) on a synthetic clock: the hardware hour is fixed, tokens vary."""

from __future__ import annotations

import threading

import pytest

from app.observability.costs import HardwareCostMeter, TokenBuckets


class SyntheticClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def serve(
    meter: HardwareCostMeter,
    clock: SyntheticClock,
    *,
    concurrent_requests: int,
    seconds: int,
    steps_per_second: int = 10,
    model: str = "m",
) -> None:
    """A batched engine: every step makes one token per running request, and a step takes the same
    time whether one request runs or many (what batching buys on the same hardware)."""
    for _ in range(seconds * steps_per_second):
        clock.advance(1 / steps_per_second)
        meter.record(concurrent_requests, model)


def usd_per_million_last_minute(concurrent_requests: int) -> float:
    clock = SyntheticClock()
    meter = HardwareCostMeter(3.6, clock)  # USD 3.60 an hour: USD 0.06 a minute
    serve(meter, clock, concurrent_requests=concurrent_requests, seconds=60)
    return meter.snapshot()["windows"]["minute"]["usd_per_1m_tokens"]


def test_cost_per_token_falls_as_more_concurrent_requests_share_the_hardware_hour():
    costs = [usd_per_million_last_minute(n) for n in (1, 4, 16, 64)]
    assert costs == sorted(costs, reverse=True) and len(set(costs)) == 4
    # Same minute of the same machine, 64x the tokens: 1/64 of the cost per token.
    assert costs[-1] == pytest.approx(costs[0] / 64, rel=0.02)
    # One request, 10 tokens/s for a minute: 600 tokens for USD 0.06 -> USD 100 per 1M.
    assert costs[0] == pytest.approx(0.06 / 600 * 1e6, rel=0.02)


def test_the_window_cost_is_the_hardware_cost_of_its_duration_capped_by_uptime():
    clock = SyntheticClock()
    meter = HardwareCostMeter(36.0, clock)
    clock.advance(120)  # up two minutes
    windows = meter.snapshot()["windows"]
    assert windows["minute"]["cost_usd"] == pytest.approx(36.0 / 60)
    assert windows["hour"]["cost_usd"] == pytest.approx(36.0 * 2 / 60)  # not a whole hour yet
    assert windows["day"]["seconds"] == pytest.approx(120)
    clock.advance(2 * 86400)
    assert meter.snapshot()["windows"]["day"]["cost_usd"] == pytest.approx(36.0 * 24)


def test_idle_hardware_costs_money_but_has_no_cost_per_token():
    clock = SyntheticClock()
    meter = HardwareCostMeter(1.0, clock)
    clock.advance(30)
    minute = meter.snapshot()["windows"]["minute"]
    assert minute["tokens"] == 0 and minute["cost_usd"] > 0 and minute["usd_per_1m_tokens"] is None


def test_tokens_leave_each_window_as_it_slides_past_them():
    clock = SyntheticClock()
    meter = HardwareCostMeter(1.0, clock)
    meter.record(500, "m")
    clock.advance(61)
    meter.record(7, "m")
    windows = meter.snapshot()["windows"]
    assert (windows["minute"]["tokens"], windows["hour"]["tokens"], windows["day"]["tokens"]) == (7, 507, 507)
    clock.advance(3601)
    windows = meter.snapshot()["windows"]
    assert (windows["minute"]["tokens"], windows["hour"]["tokens"], windows["day"]["tokens"]) == (0, 0, 507)
    clock.advance(86400)
    assert meter.snapshot()["windows"]["day"]["tokens"] == 0


def test_the_server_cost_is_split_over_models_by_token_share():
    clock = SyntheticClock()
    meter = HardwareCostMeter(6.0, clock)
    clock.advance(60)
    meter.record(300, "chat")
    meter.record(100, "embed")
    minute = meter.snapshot()["windows"]["minute"]
    assert minute["cost_usd"] == pytest.approx(0.1)
    assert minute["models"]["chat"]["cost_usd"] == pytest.approx(0.075)
    assert minute["models"]["embed"]["cost_usd"] == pytest.approx(0.025)
    # Same price per token for both: they share one machine.
    assert minute["models"]["chat"]["usd_per_1m_tokens"] == pytest.approx(minute["usd_per_1m_tokens"])
    assert minute["models"]["embed"]["usd_per_1m_tokens"] == pytest.approx(minute["usd_per_1m_tokens"])


def test_a_model_with_its_own_cost_carries_it_and_the_server_cost_goes_to_the_others():
    clock = SyntheticClock()
    meter = HardwareCostMeter(6.0, clock, model_costs_per_hour={"big": 60.0})
    clock.advance(60)
    meter.record(1000, "big")
    meter.record(100, "small")
    minute = meter.snapshot()["windows"]["minute"]
    assert minute["models"]["big"]["cost_usd"] == pytest.approx(1.0)
    assert minute["models"]["small"]["cost_usd"] == pytest.approx(0.1)
    assert minute["cost_usd"] == pytest.approx(1.1)
    assert minute["tokens"] == 1100


def test_a_model_cost_set_later_counts_only_from_then():
    clock = SyntheticClock()
    meter = HardwareCostMeter(0.0, clock)
    clock.advance(3000)
    meter.set_model_cost("late", 3.6)
    clock.advance(600)
    hour = meter.snapshot()["windows"]["hour"]
    assert hour["models"]["late"]["cost_usd"] == pytest.approx(0.6)
    assert hour["models"]["late"]["usd_per_1m_tokens"] is None
    meter.set_model_cost("late", None)
    assert "late" not in meter.snapshot()["windows"]["hour"]["models"]


def test_a_server_cost_set_later_counts_only_from_then():
    """An administrator sets the cost on the Models page an hour in: the hours before it stay at $0."""
    clock = SyntheticClock()
    meter = HardwareCostMeter(0.0, clock)
    clock.advance(3000)
    meter.set_server_cost(3.6)
    serve(meter, clock, concurrent_requests=1, seconds=600)
    hour = meter.snapshot()["windows"]["hour"]
    assert hour["cost_usd"] == pytest.approx(0.6)  # 10 minutes at $3.60/h, not the 60 minutes of uptime
    assert hour["models"]["m"]["usd_per_1m_tokens"] == pytest.approx(0.6 / 6000 * 1e6)
    assert meter.snapshot()["cost_per_hour"] == 3.6
    with pytest.raises(ValueError):
        meter.set_server_cost(float("inf"))


def test_tokens_without_a_model_count_in_the_totals_only():
    clock = SyntheticClock()
    meter = HardwareCostMeter(1.0, clock)
    meter.record(10)
    minute = meter.snapshot()["windows"]["minute"]
    assert minute["tokens"] == 10 and minute["models"] == {}


def test_memory_stays_bounded_however_long_it_runs():
    buckets = TokenBuckets(1.0, 3600.0)
    for second in range(3 * 3600):
        buckets.add(float(second), "m", 1)
    assert len(buckets.buckets) <= 3601
    assert sum(buckets.totals(3 * 3600.0, 3600.0).values()) == 3600


def test_concurrent_recording_loses_no_token():
    meter = HardwareCostMeter(1.0)

    def work() -> None:
        for _ in range(2000):
            meter.record(1, "m")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert meter.snapshot()["windows"]["minute"]["models"]["m"]["tokens"] == 16000


def test_a_negative_cost_is_refused():
    with pytest.raises(ValueError):
        HardwareCostMeter(-1.0)
    with pytest.raises(ValueError):
        HardwareCostMeter(1.0, model_costs_per_hour={"m": -2.0})
