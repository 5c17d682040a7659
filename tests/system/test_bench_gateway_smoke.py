"""bench/gateway_bench.py runs end to end on a tiny load (no gateway, and SQLite) and writes its JSON
and plot. No speed is asserted: the machine is shared and the load is tiny."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_quick_gateway_bench_writes_json_and_plot_and_loses_no_row(tmp_path):
    out = tmp_path / "gateway_bench.json"
    command = [
        sys.executable,
        str(ROOT / "bench" / "gateway_bench.py"),
        "--rounds",
        "1",
        "--requests",
        "200",
        "--warmup",
        "50",
        "--rate",
        "100",
        "--duration",
        "1",
        "--configs",
        "none,sqlite",
        "--out",
        str(out),
    ]
    run = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    none, sqlite = report["results"]
    for result in (none, sqlite):
        assert result["closed"]["requests"] == 200 and result["closed"]["failures"] == 0
        assert result["paced"]["requests"] == 100 and result["paced"]["failures"] == 0
        assert result["closed"]["server_cpu_ms_per_req"] > 0 and result["closed"]["client_cpu_ms_per_req"] > 0
    assert sqlite["rows_expected"] == 350 and sqlite["rows_written"] == 350 and sqlite["rows_lost"] == 0
    assert "p99_ms_added" in sqlite["paced"] and "gateway_hooks_p99_ms" in sqlite["paced"]
    assert report["machine"]["load_average_start"] and "pinning" in report
