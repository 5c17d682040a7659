"""Serving benchmark, in the manner of `vllm bench serve`: N streamed chat requests over HTTP at a fixed
concurrency (optionally with Poisson arrivals), against tokenmill and against a naive baseline (one HF
`generate` per request, one at a time: bench/naive_server.py) in the same run.

Reports request/s, output tokens/s, TTFT, TPOT and ITL (mean, p50, p99) per concurrency level, prints
tokenmill's throughput over the baseline's, and writes JSON and a PNG plot under bench/results/.

    python bench/serve_bench.py                      # starts both servers, concurrency 1, 8, 32
    python bench/serve_bench.py --concurrency 1,8 --num-prompts 16 --max-tokens 32
    python bench/serve_bench.py --tokenmill-url http://127.0.0.1:8000 --api-key sk-... --targets tokenmill
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import free_port, serve_command, stop, tokenmill_cli, wait_healthy
from bench.stream_client import StreamResult, outcome, stream_chat

RESULTS = ROOT / "bench" / "results"
MODEL = "SmolLM2-135M-Instruct"

TOPICS = [
    "rivers",
    "volcanoes",
    "the moon",
    "bread",
    "chess",
    "bees",
    "glaciers",
    "trains",
    "coffee",
    "octopuses",
    "libraries",
    "bridges",
    "tea",
    "deserts",
    "lighthouses",
    "owls",
    "maps",
    "bicycles",
    "clouds",
    "salt",
]
ASKS = [
    "Explain how {t} work in simple terms.",
    "Write a short poem about {t}.",
    "Give me three facts about {t}.",
    "Why do people find {t} interesting?",
    "Describe {t} to a child.",
    "What is the history of {t}?",
]
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise teacher who answers in plain words.",
    "You are a friendly guide. Keep answers short and accurate, and avoid jargon where possible.",
]


def synthetic_chats(count: int, seed: int = 0) -> list[list[dict]]:
    """A fixed-seed set of chats of varied length: a system prompt, sometimes an earlier turn, a question."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        topic = rng.choice(TOPICS)
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}]
        if rng.random() < 0.5:
            earlier = rng.choice(TOPICS)
            messages += [
                {"role": "user", "content": rng.choice(ASKS).format(t=earlier)},
                {"role": "assistant", "content": f"Here is something about {earlier}. " * rng.randint(1, 6)},
            ]
        detail = " Please include an example." * rng.randint(0, 3)
        messages.append({"role": "user", "content": rng.choice(ASKS).format(t=topic) + detail})
        chats.append(messages)
    return chats


RequestResult = StreamResult  # the name the rest of this file (and its readers) use


async def one_request(http: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> RequestResult:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    return await stream_chat(http, body)


async def run_level(
    base_url: str, headers: dict, chats: list[list[dict]], concurrency: int, rate: float, max_tokens: int, seed: int
) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(None, connect=10.0)  # the baseline's queue at high concurrency is slow, not broken
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as http:

        async def gated(messages):
            async with gate:
                return await one_request(http, messages, max_tokens)

        started = time.perf_counter()
        tasks = []
        for messages in chats:
            tasks.append(asyncio.create_task(gated(messages)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - started


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    array = np.asarray(values) * 1000.0
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        **outcome(results, duration),
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens for r in done),
        "ttft_ms": _stats([r.ttft for r in done]),
        "tpot_ms": _stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats([gap for r in done for gap in r.itl]),
        "e2e_ms": _stats([r.e2e for r in done]),
    }


# ---- servers ---------------------------------------------------------------------------------


@dataclass
class Launched:
    """A server this bench started: where it answers, and the process (for its memory and its exit)."""

    url: str
    headers: dict[str, str]
    process: subprocess.Popen[bytes]
    start_s: float  # from the process's start until /health answered


def start_tokenmill(stack: ExitStack, data_dir: str, extra_args: str) -> tuple[str, dict]:
    """`tokenmill serve` on a fresh database, with one team and key made through the CLI."""
    launched = launch_tokenmill(stack, data_dir, extra_args)
    return launched.url, launched.headers


def launch_tokenmill(stack: ExitStack, data_dir: str, extra_args: str, timeout: float = 300.0) -> Launched:
    """start_tokenmill, also giving the process and how long it took to come up (the CLI's team and key
    are made before the clock starts)."""
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serve-bench-")))
    database = ["--database-url", f"sqlite:///{workdir / 'bench.db'}"]
    tokenmill_cli("teams", "create", "bench", *database)
    key = tokenmill_cli("keys", "create", "--team", "bench", *database).strip().splitlines()[-1]
    port = free_port()
    log = open(workdir / "tokenmill.log", "w")
    started = time.perf_counter()
    process = subprocess.Popen(
        serve_command(port, data_dir, *database, *shlex.split(extra_args)),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    stack.callback(stop, process)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout)
    except RuntimeError as error:
        log.flush()
        tail = "\n".join((workdir / "tokenmill.log").read_text(errors="replace").strip().splitlines()[-5:])
        raise RuntimeError(f"{error}; its log ends:\n{tail}") from error
    return Launched(url, {"authorization": f"Bearer {key}"}, process, time.perf_counter() - started)


def start_naive(stack: ExitStack, data_dir: str) -> tuple[str, dict]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "naive_server.py"), "--port", str(port), "--data-dir", data_dir],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stack.callback(stop, process)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process)
    return url, {}


# ---- report ----------------------------------------------------------------------------------


def print_table(runs: dict[str, dict[int, dict]]) -> None:
    print(
        f"\n{'target':<10}{'conc':>5}{'done':>6}{'req/s':>8}{'out tok/s':>11}"
        f"{'TTFT p50/p99 ms':>19}{'TPOT p50/p99 ms':>19}{'ITL p50/p99 ms':>18}"
    )
    for target, levels in runs.items():
        for concurrency, s in levels.items():

            def pair(metric):
                p50, p99 = s[metric]["p50"], s[metric]["p99"]
                return "-" if p50 is None else f"{p50:.0f}/{p99:.0f}"

            print(
                f"{target:<10}{concurrency:>5}{s['completed']:>6}{s['request_throughput']:>8.2f}"
                f"{s['output_throughput']:>11.1f}{pair('ttft_ms'):>19}{pair('tpot_ms'):>19}{pair('itl_ms'):>18}"
            )


def ratios(runs: dict[str, dict[int, dict]]) -> dict[int, float]:
    if "tokenmill" not in runs or "naive" not in runs:
        return {}
    return {
        c: runs["tokenmill"][c]["output_throughput"] / runs["naive"][c]["output_throughput"]
        for c in runs["tokenmill"]
        if c in runs["naive"] and runs["naive"][c]["output_throughput"] > 0
    }


def write_report(
    stem: Path, args: argparse.Namespace, levels: list[int], runs: dict[str, dict[int, dict]]
) -> dict[int, float]:
    speedups = ratios(runs)
    report = {
        "config": {
            **vars(args),
            "request_rate": str(args.request_rate),
            "levels": levels,
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "results": runs,
        "ratio_output_throughput": speedups,
    }
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    return speedups


def plot(runs: dict[str, dict[int, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("output_throughput", None, "output tokens/s"),
        ("ttft_ms", "p50", "TTFT p50 (ms)"),
        ("tpot_ms", "p50", "TPOT p50 (ms)"),
    ]
    for axis, (metric, stat, label) in zip(axes, panels):
        for target, levels in runs.items():
            xs = sorted(levels)
            ys = [levels[c][metric] if stat is None else levels[c][metric][stat] for c in xs]
            axis.plot(xs, ys, marker="o", label=target)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="tokenmill,naive", help="comma-separated: tokenmill, naive")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="requests per level (default: max(8, concurrency))"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once, capped by concurrency)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (EOS ignored)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=str(ROOT / ".tokenmill"), help="where the converted weights live")
    parser.add_argument("--tokenmill-args", default="", help="extra flags for `tokenmill serve`")
    parser.add_argument("--tokenmill-url", default=None, help="use a running tokenmill instead of starting one")
    parser.add_argument("--api-key", default=os.environ.get("TOKENMILL_BENCH_KEY"), help="key for --tokenmill-url")
    parser.add_argument("--naive-url", default=None, help="use a running baseline instead of starting one")
    parser.add_argument("--output", default=None, help="results file stem (default: bench/results/serve_bench-TIME)")
    args = parser.parse_args()

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    stem = Path(args.output) if args.output else RESULTS / f"serve_bench-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, dict]] = {}
    with ExitStack() as stack:
        servers = {}
        for target in targets:
            if target == "tokenmill":
                servers[target] = (
                    (args.tokenmill_url.rstrip("/"), {"authorization": f"Bearer {args.api_key}"})
                    if args.tokenmill_url
                    else start_tokenmill(stack, args.data_dir, args.tokenmill_args)
                )
            elif target == "naive":
                servers[target] = (
                    (args.naive_url.rstrip("/"), {}) if args.naive_url else start_naive(stack, args.data_dir)
                )
            else:
                parser.error(f"unknown target {target!r}")
        for target, (url, headers) in servers.items():
            warmup = asyncio.run(run_level(url, headers, synthetic_chats(2, seed=999), 2, float("inf"), 4, 0))
            if not all(r.ok for r in warmup[0]):
                raise SystemExit(f"{target} failed its warm-up: {[r.error for r in warmup[0]]}")
            runs[target] = {}
        # targets take turns at each level, so that a ratio compares runs made minutes apart, not half an hour
        for concurrency in levels:
            count = args.num_prompts or max(8, concurrency)
            chats = synthetic_chats(count, seed=args.seed)
            for target, (url, headers) in servers.items():
                print(f"{target}: {count} requests at concurrency {concurrency} ...", flush=True)
                results, duration = asyncio.run(
                    run_level(url, headers, chats, concurrency, args.request_rate, args.max_tokens, args.seed)
                )
                runs[target][concurrency] = summary = summarize(results, duration)
                print(f"  {summary['output_throughput']:.1f} output tok/s, {summary['completed']} done", flush=True)
                write_report(stem, args, levels, runs)  # after every level: a long run keeps what it measured
    print_table(runs)
    for concurrency, ratio in write_report(stem, args, levels, runs).items():
        print(f"tokenmill / naive output tokens/s at concurrency {concurrency}: {ratio:.2f}x")
    plot(runs, stem.with_suffix(".png"), f"serve_bench: {MODEL}, {args.max_tokens} output tokens, streamed chat")
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")


if __name__ == "__main__":
    main()
