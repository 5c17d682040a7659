"""Per-stream speed at 1 to 8 users (and 64 mixed), tokenmill against llama.cpp's llama-server, one run.

Starts tokenmill once per mode and llama-server (built by bench/build_llama_server.sh from the pinned
llama-cpp-python sdist's vendored llama.cpp, on the embedded model's own GGUF file), then for each level
runs the same streamed chat requests against every system in turn (systems interleaved level by level, so
load from other work on the machine falls on all of them alike):
- 1, 4 and 8 concurrent streams: chat, 128 output tokens (EOS ignored), greedy and temperature 0.7;
- 64 mixed: 64 requests at once, prompts of 8-200 words, 32-256 output tokens.
Reports aggregate output tok/s, TTFT p50/p99 and inter-token latency p50/p99 per system and level, and
each tokenmill mode's tok/s over llama-server's. Prints a table, writes JSON and a PNG under bench/results/.
If llama-server can't be built, it says why and measures tokenmill alone.

    python bench/latency_bench.py                                  # all levels (~10 minutes on 2 cores)
    python bench/latency_bench.py --levels 1,4 --modes int4 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve_bench import start_tokenmill, synthetic_chats
from bench.servers import free_port, stop, wait_healthy
from bench.stream_client import StreamResult, outcome, stream_chat

RESULTS = ROOT / "bench" / "results"
BUILD_SCRIPT = ROOT / "bench" / "build_llama_server.sh"
# tokenmill modes: name -> serve flags
MODES = {
    "int4": "--quantization int4",  # float32 activations: the configuration that meets the quality bar
    "int4-bf16": "--quantization int4 --dtype bfloat16",
    "bf16": "--dtype bfloat16 --quantization none",
    "fp32": "--quantization none",  # the default before int4 on CPUs without VNNI
}
LLAMA = "llama.cpp"
OUTPUT_TOKENS = 128
MIXED_REQUESTS = 64
WORDS = (
    "the river carries sand from the mountains to the sea and farmers use its water for their fields "
    "while towns along the banks trade goods and people travel by boat"
).split()


Result = StreamResult  # the name the rest of this file (and its readers) use


@dataclass(frozen=True)
class Job:
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float


@dataclass
class System:
    name: str
    url: str
    headers: dict[str, str]
    model: str
    process: subprocess.Popen[bytes] | None = None  # where this bench started it
    start_s: float = 0.0  # from the process's start until /health answered


async def one_request(http: httpx.AsyncClient, system: System, job: Job) -> Result:
    result = await _attempt(http, system, job)
    if not result.ok and result.error.startswith("RemoteProtocolError") and result.ttft == 0.0:
        # The server closed a kept-alive connection as the request went out on it (llama-server does, now
        # and then): nothing was processed, so the request goes again on a fresh connection.
        result = await _attempt(http, system, job)
    return result


async def _attempt(http: httpx.AsyncClient, system: System, job: Job) -> Result:
    body: dict[str, Any] = {
        "model": system.model,
        "messages": job.messages,
        "max_tokens": job.max_tokens,
        "temperature": job.temperature,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "seed": 7,
    }
    return await stream_chat(http, body)


async def run_jobs(system: System, jobs: list[Job], concurrency: int) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        base_url=system.url, headers=system.headers, limits=limits, timeout=httpx.Timeout(600.0, connect=10.0)
    ) as http:

        async def gated(job: Job) -> Result:
            async with gate:
                return await one_request(http, system, job)

        started = time.perf_counter()
        results = await asyncio.gather(*(gated(job) for job in jobs))
        return list(results), time.perf_counter() - started


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    array = np.asarray(values) * 1000.0
    return {"p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99))}


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    return {
        **outcome(results, duration),
        "output_tokens": tokens,
        "tok_s": tokens / duration if duration else 0.0,
        "per_stream_tok_s": float(
            np.mean(
                [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in done if r.output_tokens > 1 and r.e2e > r.ttft]
                or [0.0]
            )
        ),
        "ttft_ms": percentiles([r.ttft for r in done]),
        "itl_ms": percentiles([g for r in done for g in r.itl]),
    }


def level_jobs(level: str, rounds: int, seed: int) -> tuple[list[Job], int]:
    """(requests, concurrency) of a level: 'N@T' = N streams at temperature T, or 'mixed'."""
    rng = random.Random(seed)
    if level == "mixed":
        jobs = []
        for _ in range(MIXED_REQUESTS):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200)))
            jobs.append(Job([{"role": "user", "content": f"Continue this text: {words}"}], rng.randint(32, 256), 0.0))
        return jobs, MIXED_REQUESTS
    streams, temperature = level.split("@")
    count = int(streams)
    chats = synthetic_chats(count * rounds, seed=seed)
    return [Job(chat, OUTPUT_TOKENS, float(temperature)) for chat in chats], count


# ---- llama-server --------------------------------------------------------------------------------


def llama_server_binary() -> tuple[Path | None, str]:
    """Builds (once, cached) or finds llama-server; (None, why) where it can't be had."""
    try:
        done = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"the build did not finish: {error}"
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["unknown error"])[-1]
    return Path(done.stdout.strip().splitlines()[-1]), ""


def start_llama_server(
    stack: ExitStack, binary: Path, gguf: Path, threads: int, slots: int, passive: bool = False
) -> System:
    port = free_port()
    log = stack.enter_context(tempfile.NamedTemporaryFile("w", prefix="llama-server-", suffix=".log", delete=False))
    # Every slot has room for its prompt and output (-c is shared by the slots). With `passive`, threads wait
    # without spinning (OMP_WAIT_POLICY=PASSIVE, --poll 0): on a shared 2-core machine spinning threads
    # waited on a descheduled sibling and one stream fell from 27 to 1.4 tok/s. Otherwise its defaults.
    environment = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"} if passive else dict(os.environ)
    started = time.perf_counter()
    process = subprocess.Popen(
        [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(1024 * slots),
            *(["--poll", "0"] if passive else []),
            "--no-webui",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=environment,
    )
    stack.callback(stop, process)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, timeout=300)
    return System(LLAMA, url, {}, "default", process, time.perf_counter() - started)


# ---- report --------------------------------------------------------------------------------------


def print_table(levels: list[str], runs: dict[str, dict[str, dict[str, Any]]]) -> None:
    print(
        f"\n{'level':10} {'system':12} {'tok/s':>8} {'per-stream':>10} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} "
        f"{'p99':>7} {'vs llama':>8} {'fail':>4}"
    )
    for level in levels:
        llama = runs.get(LLAMA, {}).get(level)
        for system, by_level in runs.items():
            row = by_level.get(level)
            if row is None:
                continue
            ratio = f"{row['tok_s'] / llama['tok_s']:.2f}x" if llama and llama["tok_s"] and system != LLAMA else ""

            def ms(value: float | None) -> str:
                return "-" if value is None else f"{value:.0f}"

            print(
                f"{level:10} {system:12} {row['tok_s']:8.1f} {row['per_stream_tok_s']:10.1f} "
                f"{ms(row['ttft_ms']['p50']):>9} {ms(row['ttft_ms']['p99']):>7} {ms(row['itl_ms']['p50']):>8} "
                f"{ms(row['itl_ms']['p99']):>7} {ratio:>8} {row['failed']:4d}"
            )


def plot(levels: list[str], runs: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(runs))
    for index, (system, by_level) in enumerate(runs.items()):
        xs = [i + index * width for i, level in enumerate(levels) if level in by_level]
        throughput.bar(xs, [by_level[level]["tok_s"] for level in levels if level in by_level], width, label=system)
        latency.bar(
            xs, [by_level[level]["ttft_ms"]["p50"] or 0 for level in levels if level in by_level], width, label=system
        )
    for axis, label in ((throughput, "output tok/s (aggregate)"), (latency, "TTFT p50 (ms)")):
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(levels))], levels)
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    throughput.set_title("streams@temperature: throughput")
    latency.set_title("time to first token")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="int4,bf16", help=f"tokenmill modes, of {list(MODES)}")
    parser.add_argument("--levels", default="1,4,8,mixed", help="stream counts and/or 'mixed'")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream at the 1/4/8 levels")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=str(ROOT / ".tokenmill"))
    parser.add_argument("--no-llama", action="store_true", help="tokenmill alone")
    parser.add_argument("--tag", default="", help="results go to latency_bench-TAG.json/.png")
    parser.add_argument(
        "--passive",
        action="store_true",
        help="all threads wait without spinning (OMP_WAIT_POLICY=PASSIVE, llama-server --poll 0): for a shared "
        "machine; by default each system runs with its own defaults",
    )
    args = parser.parse_args()
    if args.passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # tokenmill inherits it and keeps it

    from engine.loader import default_model_path

    levels = []
    for level in args.levels.split(","):
        if level == "mixed":
            levels.append("mixed")
        else:
            levels.extend(f"{level}@{t}" for t in args.temperatures.split(","))
    systems: list[System] = []
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    skipped = ""
    with ExitStack() as stack:
        if not args.no_llama:
            binary, skipped = llama_server_binary()
            if binary is None:
                print(f"llama-server skipped: {skipped}", flush=True)
            else:
                systems.append(start_llama_server(stack, binary, default_model_path(), args.threads, 32, args.passive))
        for mode in args.modes.split(","):
            url, headers = start_tokenmill(stack, args.data_dir, f"{MODES[mode]} --num-threads {args.threads}")
            systems.append(System(f"tokenmill {mode}", url, headers, "SmolLM2-135M-Instruct"))
        # Warm up, unmeasured: first requests pay for one-off allocations. After a single warm-up request,
        # llama-server's first measured level (one greedy stream) ran at 0.66x the next (inter-token 12.1 vs
        # 8.5 ms, 2-core EPYC); so four streams at once, then one, on every system.
        for system in systems:
            for warm_up in ("4@0", "1@0"):
                jobs, concurrency = level_jobs(warm_up, 1, seed=99)
                asyncio.run(run_jobs(system, jobs, concurrency))
        for number, level in enumerate(levels):
            jobs, concurrency = level_jobs(level, args.rounds, seed=number)
            order = systems if number % 2 == 0 else systems[::-1]  # alternate who goes first
            for system in order:
                results, duration = asyncio.run(run_jobs(system, jobs, concurrency))
                runs.setdefault(system.name, {})[level] = summarize(results, duration)
                row = runs[system.name][level]
                print(
                    f"{level:10} {system.name:18} {row['tok_s']:7.1f} tok/s, TTFT p50 "
                    f"{row['ttft_ms']['p50'] or 0:.0f} ms, failed {row['failed']} {row['errors'][:1]}",
                    flush=True,
                )
    print_table(levels, {s.name: runs.get(s.name, {}) for s in systems})
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpu": _cpu_name(),
        "threads": args.threads,
        "thread_wait": "passive" if args.passive else "each system's default",
        "levels": levels,
        "output_tokens": OUTPUT_TOKENS,
        "llama_server_skipped": skipped,
        "command": " ".join(sys.argv),
        "runs": runs,
    }
    stem = RESULTS / ("latency_bench" + (f"-{args.tag}" if args.tag else ""))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(levels, {s.name: runs.get(s.name, {}) for s in systems}, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")


def _cpu_name() -> str:
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
