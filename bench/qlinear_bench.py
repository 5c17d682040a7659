"""How close the packed linears come to reading their weights at the machine's speed, at 1 to 64 rows.

One "pass" is every matmul of a SmolLM2-135M decode step: 30 layers of qkv / o / gate_up / down, each layer
with its own copy of the weights (so a pass streams a whole model's worth, as a decode step does), then the
logits head. Per weight format and row count it prints the time of a pass, the weight bytes it read per
second, and that as a fraction of a plain streaming read over a buffer of the same size, timed in the same
run with the same threads, alternating with the passes (`torch.sum`). On VMs whose last-level cache holds
the whole model that read runs at the cache's speed, which moves with what the neighbours do: compare
fractions across runs, not GB/s.
Formats: the native kernel's int4 (groups of 32, head int8 per 32, as `--quantization int4`), int8 (per
channel, head per 32) and packed bf16, and oneDNN's bf16 `F.linear` as the peer (`onednn-f32`: float32, the
unquantized default, for CPUs without fast bf16). Writes JSON and a PNG under bench/results/ (`--tag` names
another pair, for a second machine kind).

    python bench/qlinear_bench.py                       # about a minute
    python bench/qlinear_bench.py --rows 1 4 --threads 1
    python bench/qlinear_bench.py --formats int4,int8,onednn-f32 --tag avx2
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.openmp import default_openmp_waiting

default_openmp_waiting()  # OpenMP workers wait as in the server (set before torch loads)

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.qlinear import PackedWeight, native_available, pack_weight, place_together, qlinear_native, vector_unit

RESULTS = ROOT / "bench" / "results"
LAYERS = 30
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
# format -> (layer format, layer group, head format, head group), as engine/models/llama.py packs them
FORMATS = {
    "int4": ("int4", None, "int8", 32),
    "int8": ("int8", None, "int8", None),
    "bf16": ("bf16", None, "bf16", None),
}


def model_weights(fmt: str) -> list[PackedWeight]:
    layer_format, layer_group, head_format, head_group = FORMATS[fmt]
    generator = torch.Generator().manual_seed(0)
    weights = [
        pack_weight(torch.randn(*shape, generator=generator) * 0.05, layer_format, layer_group)
        for _ in range(LAYERS)
        for shape in LAYER_SHAPES.values()
    ]
    head = pack_weight(torch.randn(*HEAD_SHAPE, generator=generator) * 0.05, head_format, head_group)
    return place_together([*weights, head])  # in one buffer on huge pages, as the model holds them


ONEDNN_DTYPES = {"onednn-bf16": torch.bfloat16, "onednn-f32": torch.float32}


def onednn_weights(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(LAYERS) for shape in LAYER_SHAPES.values()] + [HEAD_SHAPE]
    return [(torch.randn(*shape, generator=generator) * 0.05).to(dtype) for shape in shapes]


def interleaved(runs: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each of `runs`, taken in turn (so a neighbour's load falls on all alike)."""
    for run in runs:
        run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, times in zip(runs, samples):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
    return [statistics.median(times) for times in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--formats", default="int4,int8,bf16,onednn-bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tag", default="", help="results go to qlinear_bench-TAG.json/.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native_available(torch.zeros(1, 2)):
        sys.exit("the native kernel can't be built here (no C++ compiler)")

    results = []
    for fmt in args.formats.split(","):
        if fmt in ONEDNN_DTYPES:
            dense = onednn_weights(ONEDNN_DTYPES[fmt])
            nbytes = sum(w.numel() * w.element_size() for w in dense)
        else:
            packed = model_weights(fmt)
            nbytes = sum(w.nbytes() for w in packed)
        read_buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # a plain read of as many bytes
        for rows in args.rows:
            if fmt in ONEDNN_DTYPES:
                x = {w.shape[1]: torch.randn(rows, w.shape[1]).to(ONEDNN_DTYPES[fmt]) for w in dense}

                def one_pass() -> None:
                    for weight in dense:
                        F.linear(x[weight.shape[1]], weight)

            else:
                x = {w.in_features: torch.randn(rows, w.in_features) for w in packed}

                def one_pass() -> None:
                    for weight in packed:
                        qlinear_native(x[weight.in_features], weight)

            seconds, read_seconds = interleaved([one_pass, read_buffer.sum], args.repeats)
            bandwidth = nbytes / read_seconds
            row = {
                "format": fmt,
                "rows": rows,
                "pass_ms": round(seconds * 1e3, 3),
                "weight_mb": round(nbytes / 1e6, 1),
                "weights_gb_s": round(nbytes / seconds / 1e9, 2),
                "read_gb_s": round(bandwidth / 1e9, 2),
                "fraction_of_read": round(nbytes / seconds / bandwidth, 3),
            }
            results.append(row)
            print(
                f"{fmt:12s} rows {rows:3d}: {row['pass_ms']:8.2f} ms/pass  {row['weight_mb']:6.1f} MB  "
                f"{row['weights_gb_s']:6.1f} GB/s  = {row['fraction_of_read']:.2f} of a {row['read_gb_s']:.1f} GB/s read",
                flush=True,
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {
        "vector_unit": vector_unit(),
        "threads": args.threads,
        "command": " ".join(sys.argv),
        "results": results,
    }
    name = f"qlinear_bench-{args.tag}" if args.tag else "qlinear_bench"
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(results, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and .png")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for fmt in dict.fromkeys(r["format"] for r in results):
        rows = [r for r in results if r["format"] == fmt]
        left.plot([r["rows"] for r in rows], [r["pass_ms"] for r in rows], marker="o", label=fmt)
        right.plot([r["rows"] for r in rows], [r["fraction_of_read"] for r in rows], marker="o", label=fmt)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("rows of x")
        axis.legend()
    left.set_ylabel("ms per decode step's matmuls")
    right.set_ylabel("weight bytes/s over a plain read's")
    figure.suptitle("SmolLM2-135M matmuls: packed kernel vs oneDNN bf16")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
