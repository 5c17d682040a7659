"""The overview's Batch API numbers: the share of seats batch lines held, and the real cost per token
with and without the batch's tokens (what filling idle seats did to it)."""

from __future__ import annotations

import pytest

from tests.dashboard.test_dashboard_live import FakeModel, a_minute_of_tokens, sampler_for, tick


@pytest.fixture
def model():
    return FakeModel()


def test_the_batch_share_of_seats_is_a_mean_over_the_steps(model):
    sampler = sampler_for(model)
    sampler.sample()
    model.steps(10, seqs=2, tokens=2, kv_blocks=10)
    model.steps(10, seqs=8, tokens=8, kv_blocks=10)
    model.stats.scheduled_background_seqs_total += 10 * 6  # the batch took 6 of the 8 seats in the busy half
    model.stats.num_running_background = 6
    tick(sampler, model)
    current = sampler.current("m")
    assert current["seq_occupancy"] == pytest.approx(5 / 8)
    assert current["batch_seq_occupancy"] == pytest.approx(3 / 8)
    assert current["running_batch"] == 6
    assert sampler.series("m")["batch_seq_occupancy"] == [pytest.approx(3 / 8)]


def test_the_cost_without_the_batch_counts_the_same_hours_over_the_interactive_tokens(model):
    sampler = sampler_for(model, hardware_cost_per_hour=3.6)
    sampler.sample()
    for _ in range(60):
        model.stats.generation_tokens_total += 1000
        model.stats.generation_tokens_background_total += 750  # three quarters of the tokens were the batch's
        tick(sampler, model)
    current = sampler.current("m")
    assert current["cost_per_1m_out"] == pytest.approx(1.0)
    assert current["cost_per_1m_out_without_batch"] == pytest.approx(4.0)
    assert sampler.series("m")["cost_per_1m_out_without_batch"][-1] == pytest.approx(4.0)


def test_with_no_batch_both_costs_agree(model):
    sampler = sampler_for(model, hardware_cost_per_hour=3.6)
    sampler.sample()
    a_minute_of_tokens(sampler, model, 1000)
    current = sampler.current("m")
    assert current["cost_per_1m_out_without_batch"] == current["cost_per_1m_out"]
    assert current["batch_seq_occupancy"] == 0
