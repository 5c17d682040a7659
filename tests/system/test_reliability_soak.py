"""A short soak (bench/soak.py) in CI: a real `tokenmill serve` with a small KV pool and a small waiting
queue, 16 clients through the openai client for ~20 s, streamed, whole and walking away mid-stream."""

from __future__ import annotations

import argparse

import pytest

from bench import soak
from tests.support import MODEL_CACHE

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    return soak.run(
        argparse.Namespace(
            duration=20.0,
            warmup=3.0,
            concurrency=16,
            num_kv_blocks=48,
            max_num_seqs=8,
            max_waiting=4,
            max_rss_growth_mb=64.0,
            data_dir=str(MODEL_CACHE),
            database_url=None,
            port=0,
            url=None,
            admin_key=None,
            seed=0,
            out=str(out),
        )
    )


def test_no_5xx_and_every_request_answered_or_refused_with_retry_after(result):
    checks = result["checks"]
    assert checks["no_5xx"] and checks["no_client_errors"], result["unexpected"]
    assert checks["refusals_carry_retry_after"]
    assert result["outcomes"].get("ok", 0) + result["outcomes"].get("ok_stream", 0) > 0
    assert result["outcomes"].get("503", 0) + result["outcomes"].get("503_mid_stream", 0) > 0  # the queue is bounded


def test_the_engine_goes_back_to_idle_with_no_kv_block_held(result):
    assert result["checks"]["engine_idle_after"], result["idle_after"]


def test_memory_stays_flat(result):
    assert result["checks"]["rss_flat"], (result["rss_before_mb"], result["rss_after_mb"])


def test_usage_rows_equal_the_requests_sent(result):
    assert result["usage_rows"] == result["requests_sent_incl_warmup"]


def test_streams_are_refused_before_the_headers(result):
    assert result["checks"]["refused_before_the_headers"], result["outcomes"]
