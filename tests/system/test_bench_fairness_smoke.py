"""bench/fairness_bench.py --quick runs end to end (fair and fcfs, a tiny random model) and writes its
JSON and plot. No speed or TTFT is asserted here: tests/gateway/test_gateway_fair_flood.py does that."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import MODEL_CACHE, ROOT

pytestmark = pytest.mark.real_model


def test_quick_fairness_bench_writes_json_and_plot(smollm2, tmp_path):  # smollm2: the tokenizer is converted
    out = tmp_path / "fairness.json"
    command = [
        sys.executable,
        str(ROOT / "bench" / "fairness_bench.py"),
        "--quick",
        "--data-dir",
        str(MODEL_CACHE),
        "--out",
        str(out),
    ]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"fair", "fcfs"}
    for mode in report["modes"].values():
        assert mode["teams"]["quiet"]["requests"] == 4 and mode["teams"]["flood"]["requests"] == 48
    assert out.with_suffix(".png").stat().st_size > 0
