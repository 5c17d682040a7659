"""bench/realsize_bench.py --quick runs end to end: a tiny Llama-shaped GGUF made by llama.cpp's own converter
and quantizer, tokenmill and llama-server up side by side on it, and its JSON and plot written. No speed or
memory target is asserted here: the machine is shared and the model tiny (the bench prints the targets)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.llama_cpp_tools import ToolsUnavailable, find_tools
from tests.support import ROOT


@pytest.fixture(scope="module")
def llama_cpp_tools() -> None:
    try:
        find_tools()  # built by .ci/run (bench/build_llama_server.sh); cached afterwards
    except ToolsUnavailable as error:
        pytest.skip(f"llama.cpp's tools can't be built here: {error}")


def test_quick_realsize_bench_runs_both_servers_on_one_gguf(llama_cpp_tools: None, tmp_path: Path) -> None:
    out = tmp_path / "realsize.json"
    command = [sys.executable, str(ROOT / "bench" / "realsize_bench.py"), "--quick", "--passive", "--out", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "target: one stream reads weights" in run.stdout

    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert report["read_bandwidth"]["median_bytes_s"] > 0
    assert report["machine"]["vector_unit"] in {"avx512-vnni", "avx512", "avx2", "scalar", "none"}
    assert report["machine"]["matrix_unit"] in {"amx", "none"}
    (file,) = report["files"]
    assert file["kind"] == "Q4_K_M" and Path(file["file"]).name == "llama-tiny-Q4_K_M.gguf"
    assert 0 < file["weight_bytes_per_token"] < file["file_bytes"] * 1.01
    workload = report["workload"]
    assert set(file["systems"]) == {"tokenmill", "llama.cpp"}, file["skipped"]
    for name, system in file["systems"].items():
        assert system["failed"] == 0, (name, system["rounds"])
        (measured,) = system["rounds"]
        # ignore_eos: both servers make exactly the tokens asked for
        assert measured["one_stream_tokens"] == workload["output_tokens"], name
        assert measured["read_bytes_s"] > 0, name  # the round's own plain read, beside its one stream
        assert measured["streams_tokens"] == workload["streams"] * workload["output_tokens"], name
        # the round's TTFT is the median of its long prompts, each timed
        assert len(measured["ttft_samples_s"]) == workload["long_prompts"] > 1, name
        assert min(measured["ttft_samples_s"]) <= measured["ttft_s"] <= max(measured["ttft_samples_s"]), name
        assert system["one_stream_tok_s"] > 0 and system["ttft_s"] > 0 and system["peak_rss_bytes"] > 2**20
        assert system["first_start_s"] > 0 and 0 < system["weight_read_of_bandwidth"]
        assert system["restart_s"] > 0, name  # tokenmill's second start on the data dir its first one filled
    assert file["systems"]["llama.cpp"]["data_dir_bytes"] == 0
    assert file["registry_estimate"]["total_bytes"] > 0
    assert [target["target"] for target in file["targets"]][0] == "tokenmill loads it with its KV pool"
    # The 8B shape's estimate from a header-only file: 7.2 B parameters, over 3 GB of Q4_K/Q6_K data
    assert report["estimate_8b"]["parameters"] > 7e9 and report["estimate_8b"]["total_bytes"] > 3 * 2**30
