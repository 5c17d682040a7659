"""bench/lora_bench.py --quick runs end to end (base alone and 4 adapters, a tiny random model) and writes its
JSON and plot. No speed is asserted here: the ratio on a tiny model is all overhead, and timing is the
benchmark's job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import MODEL_CACHE, ROOT

pytestmark = pytest.mark.real_model


def test_quick_lora_bench_writes_json_and_plot(smollm2, tmp_path):  # smollm2: the tokenizer is converted
    out = tmp_path / "lora.json"
    command = [sys.executable, str(ROOT / "bench" / "lora_bench.py"), "--quick", "--data-dir", str(MODEL_CACHE)]
    run = subprocess.run([*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["config"]["adapters"] == 4 and report["config"]["streams"] == 8
    assert report["base_tok_s_median"] > 0 and report["lora_tok_s_median"] > 0
    assert report["bytes_per_adapter"] > 0 and report["load_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
