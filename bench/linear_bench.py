"""The model's matmuls through F.linear (MKL's sgemm in float32, oneDNN in bfloat16) and through
kernels.linear.Linear (oneDNN on weights packed at load, rows padded to a bucket, long inputs chunked),
at the SmolLM2-135M shapes, per row count and dtype, in one process with the same threads.

A second pass walks every row count from 1 to --sweep-rows through both and records how much the process
grew: oneDNN keeps scratch memory per row count it meets, which the buckets bound.
Prints a table and writes JSON and a PNG plot under bench/results/.

    python bench/linear_bench.py                  # about a minute
    python bench/linear_bench.py --rows 1 8 64 2048 --dtypes float32
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in engine_bench: both sides under the same setting

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.linear import Linear

RESULTS = ROOT / "bench" / "results"
# SmolLM2-135M: hidden 576, 9 + 2x3 heads of 64, MLP 1536, vocabulary 49152.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "logits": (576, 49152)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def seconds_per_call(fn, flops: float, budget_s: float) -> float:
    fn()
    repeats = max(2, int(budget_s * 50e9 / max(flops, 1.0)))  # about budget_s at 50 GFLOP/s
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best


def measure(rows_list: list[int], dtypes: list[str], budget_s: float) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for name, (k, n) in SHAPES.items():
            weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
            linear = Linear(weight)
            for rows in rows_list:
                if name == "logits" and rows > 256:
                    continue  # logits are taken for the last token of each sequence only
                x = torch.randn(rows, k, generator=generator).to(dtype)
                flops = 2.0 * rows * k * n
                f_linear = seconds_per_call(lambda: F.linear(x, weight), flops, budget_s)
                packed = seconds_per_call(lambda: linear(x), flops, budget_s)
                rows_out.append(
                    {
                        "dtype": dtype_name,
                        "shape": name,
                        "rows": rows,
                        "f_linear_gflops": round(flops / f_linear / 1e9, 1),
                        "linear_gflops": round(flops / packed / 1e9, 1),
                        "speedup": round(f_linear / packed, 2),
                    }
                )
                r = rows_out[-1]
                print(
                    f"{dtype_name:8s} {name:8s} {rows:5d} rows  F.linear {r['f_linear_gflops']:7.1f}  "
                    f"Linear {r['linear_gflops']:7.1f} GFLOP/s  {r['speedup']:5.2f}x",
                    flush=True,
                )
    return rows_out


SWEEP = """
import sys, psutil, torch, torch.nn.functional as F
sys.path.insert(0, {root!r})
from kernels.linear import Linear
use_linear, top = {use_linear}, {top}
shapes = {shapes!r}
layers = [(Linear(w) if use_linear else (lambda x, w=w: F.linear(x, w)), k)
          for w, k in ((torch.randn(n, k) / k**0.5, k) for k, n in shapes)]
process = psutil.Process()
before = process.memory_info().rss
for rows in range(1, top + 1):
    for layer, k in layers:
        layer(torch.randn(rows, k))
first = process.memory_info().rss
for rows in range(1, top + 1, 3):
    for layer, k in layers:
        layer(torch.randn(rows, k))
print(round((first - before) / 2**20, 1), round((process.memory_info().rss - before) / 2**20, 1))
"""


def sweep_memory(top: int) -> dict:
    """RSS growth in a fresh process fed every row count 1..top through the four layer matmuls (float32)."""
    shapes = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    result = {"rows_swept": top}
    for label, use_linear in (("f_linear", False), ("linear", True)):
        print(f"sweeping rows 1..{top} through {label}", flush=True)
        out = subprocess.run(
            [sys.executable, "-c", SWEEP.format(root=str(ROOT), use_linear=use_linear, top=top, shapes=shapes)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        result[f"{label}_growth_mb"] = float(out[0])
        result[f"{label}_growth_after_second_pass_mb"] = float(out[1])
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for axis, dtype in zip(axes[0], dtypes):
        for name, color in zip(SHAPES, ("#2b7bba", "#e67e22", "#27ae60", "#8e44ad", "#7f8c8d")):
            points = [r for r in report["results"] if r["dtype"] == dtype and r["shape"] == name]
            rows = [r["rows"] for r in points]
            axis.plot(rows, [r["linear_gflops"] for r in points], "-o", color=color, label=f"{name} Linear")
            axis.plot(
                rows, [r["f_linear_gflops"] for r in points], "--", color=color, alpha=0.6, label=f"{name} F.linear"
            )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("rows (tokens in the step)")
        axis.set_ylabel("GFLOP/s")
        axis.set_title(f"{dtype}: packed Linear (solid) vs F.linear (dashed)")
        axis.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 37, 64, 128, 256, 512, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per timing repeat, roughly")
    parser.add_argument("--sweep-rows", type=int, default=1200, help="0 skips the memory sweep")
    parser.add_argument("--out", default=str(RESULTS / "linear_bench.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    report = {
        "threads": args.threads,
        "torch": torch.__version__,
        "results": measure(args.rows, args.dtypes, args.budget),
    }
    if args.sweep_rows:
        report["memory_sweep_float32"] = sweep_memory(args.sweep_rows)
    print(f"\n{'dtype':9s}{'shape':9s}{'rows':>6s}{'F.linear':>10s}{'Linear':>9s}{'speedup':>9s}")
    for r in report["results"]:
        print(
            f"{r['dtype']:9s}{r['shape']:9s}{r['rows']:6d}{r['f_linear_gflops']:10.1f}{r['linear_gflops']:9.1f}"
            f"{r['speedup']:8.2f}x"
        )
    if "memory_sweep_float32" in report:
        print(
            "memory, float32, every row count 1..{rows_swept}: F.linear +{f_linear_growth_mb} MB, "
            "Linear +{linear_growth_mb} MB (after a second pass: {f_linear_growth_after_second_pass_mb} / "
            "{linear_growth_after_second_pass_mb} MB)".format(**report["memory_sweep_float32"])
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
