"""bench/engine_bench.py --quick runs end to end on a tiny workload and writes its JSON and plot.

No speed is asserted: the machine is shared and the workload is tiny.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import MODEL_CACHE, ROOT

pytestmark = pytest.mark.real_model


# "int4": the engine's weights packed (HF stays float32), reported under their own name and file
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_quick_engine_bench_writes_json_and_plot(smollm2, tmp_path, quantization):  # smollm2: converted weights
    command = [
        sys.executable,
        str(ROOT / "bench" / "engine_bench.py"),
        "--quick",
        "--requests",
        "3",
        "--prompt-len",
        "8-16",
        "--output-len",
        "3-6",
        "--dtypes",
        "float32",
        "--peak-seconds",
        "0.01",
        "--threads",
        "1",
        "--data-dir",
        str(MODEL_CACHE),
        "--out",
        str(tmp_path),
        "--quantization",
        quantization,
    ]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "out tok/s" in run.stdout

    stem = "engine_bench_quick" if quantization == "none" else f"engine_bench_quick-{quantization}"
    report = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    assert report["quantization"] == quantization
    assert report["workload"]["requests"] == 3
    assert report["machine"]["threads"] == 1
    result = report["results"]["float32" if quantization == "none" else f"float32+{quantization}"]
    for key in ("matmul_peak_gflops", "ratio_to_hf", "engine", "hf", "targets"):
        assert key in result
    engine, hf = result["engine"], result["hf"]
    for key in (
        "output_tokens_per_s",
        "mean_batch_occupancy",
        "mean_kv_utilisation",
        "gflops",
        "mfu",
        "decode_full_concurrency",
        "preemptions",
    ):
        assert key in engine
    assert engine["output_tokens"] == hf["output_tokens"] == report["workload"]["output_tokens"]
    assert hf["generated_tokens"] >= hf["output_tokens"]
    assert 0 < engine["mean_batch_occupancy"] <= 1 and 0 < engine["mean_kv_utilisation"] <= 1
    assert engine["preemptions"] == 0
    assert result["ratio_to_hf"] > 0 and result["matmul_peak_gflops"] > 0
