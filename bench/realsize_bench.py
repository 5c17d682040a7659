"""Real-size models: tokenmill against llama.cpp's llama-server on the same GGUF file, as a user would run them.

Makes random-weight checkpoints of real shapes (Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads, FFN 8192;
a 3B: 3072, 28 layers, 24/8, 8192; SmolLM2's 49,152-token vocabulary and chat template), converts and
quantizes them with llama.cpp's own tools (bench/llama_cpp_tools.py, cached in ~/.cache/tokenmill-bench/models),
then per file starts `tokenmill serve --model FILE` (default flags, a fresh data dir) and llama-server
(`-t 2 -np 8 -c 8192`) side by side and alternates them over rounds:
- one stream x 128 tokens (EOS ignored, so both make the same count): decode tok/s;
- 8 streams x 128 tokens at once: aggregate tok/s;
- TTFT of a 515-token prompt (chat template included): the median of three such prompts, each its own text.
Also per server: peak RSS (the process's VmHWM), first start (process start to /health), restart (tokenmill
started again on the same data dir after the rounds; llama-server keeps nothing, so its first start), bytes
written to its data dir; and, in the same run, the machine's plain memory-read bandwidth (torch sum over 1 GiB, 2
threads, the best of 3 passes), measured in every round right before each server's one stream: that stream's
weight-read rate (the file's weight bytes read per token x tok/s) is put against the read of its own round
(these shared VMs' bandwidth moves by half within an hour; a single read at the start made the share swing).
Medians over rounds; targets printed beside the numbers; JSON and a PNG under bench/results/. The registry's
memory estimate is reported for every shape, and for an 8B shape from a header-only GGUF.
Speed does not depend on the weights' values, so random weights measure what a real model of the shape would.

    python bench/realsize_bench.py                          # 1B and 3B in Q4_K_M, 3 rounds (~20 min, 2 cores)
    python bench/realsize_bench.py --shapes llama-1b --kinds Q4_K_M,Q8_0 --passive
    python bench/realsize_bench.py --tokenmill-flags "--quantization int4" --tag int4
    python bench/realsize_bench.py --quick --out /tmp/realsize.json   # tiny shape, 1 round: proves it runs
    python bench/realsize_bench.py --shapes llama-1b --memory-only     # peak RSS at load and serving only
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.latency_bench import LLAMA, Job, System, run_jobs, start_llama_server, summarize
from bench.llama_cpp_tools import (
    CACHE,
    LLAMA_8B,
    MODELS,
    SHAPES,
    ModelShape,
    ToolsUnavailable,
    find_tools,
    gguf_for,
    header_only_gguf,
)
from bench.serve_bench import Launched, launch_tokenmill, synthetic_chats
from bench.servers import stop

RESULTS = ROOT / "bench" / "results"
TOKENMILL = "tokenmill"
GIB = 2**30
GB = 1e9
BOX_BYTES = 24 * GIB  # "accepted on a 24 GB box": the machine
LLAMA_SLOTS = 8  # -np 8 -c 8192: 1024 tokens per slot, room for the 515-token prompt and its output
MEMORY_PROMPT_TOKENS = 300  # --memory-only: 8 streams' prompts together overfill one step's 2048 tokens
MEMORY_OUTPUT_TOKENS = 64
# Prompts of the longest context the model takes (up to this), as many as fill its pool: the worst step the
# registry's estimate covers is a full one whose attention reaches back the longest context
POOL_FILL_PROMPT_LIMIT = 16384
FILLER = (
    "a farmer walks along the river at dawn and counts the boats that carry grain to the market town where "
    "traders argue about prices while children watch the water and the old bridge creaks under carts"
).split()


@dataclass(frozen=True)
class Workload:
    rounds: int
    output_tokens: int
    streams: int
    prompt_tokens: int
    bandwidth_bytes: int  # the plain read's buffer
    # Long prompts a round, one after another (each its own text); the round's TTFT is their median. One a round
    # left the verdict to chance: at parity on a 2-core Xeon (1.99 s each) a round moved by 0.1 s either way.
    long_prompts: int = 3


FULL = Workload(rounds=3, output_tokens=128, streams=8, prompt_tokens=515, bandwidth_bytes=GIB)
QUICK = Workload(rounds=1, output_tokens=8, streams=2, prompt_tokens=64, bandwidth_bytes=64 * 2**20, long_prompts=2)


# ---- what the machine and the file allow ---------------------------------------------------------


def read_bandwidth(size: int, threads: int = 2, repeats: int = 7) -> dict[str, float]:
    """A plain read of `size` bytes (torch sum of float32, `threads` threads): bytes/s, median and best."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(size // 4, dtype=torch.float32)
        buffer.sum()  # pages touched, code warm
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - started)
        del buffer
    finally:
        torch.set_num_threads(previous)
    return {"median_bytes_s": size / statistics.median(times), "best_bytes_s": size / min(times), "threads": threads}


def weight_bytes_per_token(gguf: Path) -> int:
    """Bytes of weights one decode step reads: every tensor as stored, except the embedding table where a
    separate output matrix exists (then only one row of it is read; tied, it is the output matrix too)."""
    from gguf import GGUFReader

    tensors = {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(gguf).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def registry_estimate(gguf: Path, data_dir: str, tokenmill_flags: str = "") -> dict[str, Any]:
    """app/registry/memory.py's estimate for serving `gguf` with `tokenmill serve`'s settings and these flags."""
    try:
        from app.registry.memory import available_bytes, estimate
        from app.registry.spec import ModelSpec
        from app.settings import add_arguments, settings_from

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        argv = ["--model", str(gguf), "--data-dir", data_dir, *shlex.split(tokenmill_flags)]
        settings = settings_from(vars(parser.parse_known_args(argv)[0]), {})
        spec = ModelSpec(gguf.stem, "chat", str(gguf), "llama", dtype=settings.engine.dtype)
        found = estimate(spec, settings.engine)
    except Exception as error:  # the registry is under change (#42): report, don't stop the bench
        return {"error": f"{type(error).__name__}: {error}"}
    if found is None:
        return {"error": "the registry can't tell this file's size from its headers"}
    return {
        "total_bytes": found.total_bytes,
        "weights_bytes": found.weights_bytes,
        "kv_bytes": found.kv_bytes,
        "describe": found.describe(),
        "accepted_on_24gb_box": found.total_bytes <= BOX_BYTES,
        "fits_here_now": found.total_bytes <= available_bytes(),
    }


def peak_rss(process: Any, field: str = "VmHWM") -> int:
    """The process's peak resident set (VmHWM; or another /proc/PID/status field, e.g. VmRSS), bytes."""
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def llama_kv_bytes(gguf: Path, context: int) -> int:
    """The KV cache llama-server allocates for `-c context` (f16 keys and values for every layer), bytes."""
    from engine.gguf_file import read_tensor_index

    widths = [entry.shape[0] for entry in read_tensor_index(gguf) if entry.name.endswith("attn_k.weight")]
    return 2 * context * sum(widths) * 2


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


# ---- requests ------------------------------------------------------------------------------------


def exact_prompt(tokens: int, seed: int) -> list[dict[str, str]]:
    """A one-message chat whose prompt, with SmolLM2's chat template, is exactly `tokens` tokens."""
    import random

    tokenizer = _tokenizer()

    def count(words: list[str]) -> int:
        messages = [{"role": "user", "content": " ".join(words)}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(seed)
    words = [f"Round {seed}:"]
    while count(words) < tokens:
        words.extend(rng.choice(FILLER) for _ in range(max(1, (tokens - count(words)) // 2)))
    while count(words) > tokens:
        words.pop()
    while count(words) < tokens:
        words.append("a")  # one token each
    if count(words) != tokens:
        raise RuntimeError(f"could not make a {tokens}-token prompt (got {count(words)})")
    return [{"role": "user", "content": " ".join(words)}]


_TOKENIZER: Any = None


def _tokenizer() -> Any:
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        from engine.loader import default_model_path

        embedded = default_model_path()
        _TOKENIZER = AutoTokenizer.from_pretrained(str(embedded.parent), gguf_file=embedded.name)
    return _TOKENIZER


def measure_round(system: System, workload: Workload, round_number: int, threads: int) -> dict[str, Any]:
    """A plain read, one stream, then `streams` at once, then the long prompt's TTFT, on one server.

    The plain read runs right before the one stream: on these shared VMs it swung 30-59 GB/s within an hour
    (2-core EPYC Zen 4), so one stream's share of it is taken against the read of the same minute."""
    seed = 1000 * round_number
    one = [Job(chat, workload.output_tokens, 0.0) for chat in synthetic_chats(1, seed=seed)]
    many = [Job(chat, workload.output_tokens, 0.0) for chat in synthetic_chats(workload.streams, seed=seed + 1)]
    long = [Job(exact_prompt(workload.prompt_tokens, seed + 2 + n), 2, 0.0) for n in range(workload.long_prompts)]
    read = read_bandwidth(workload.bandwidth_bytes, threads, repeats=3)
    single = summarize(*asyncio.run(run_jobs(system, one, 1)))
    streams = summarize(*asyncio.run(run_jobs(system, many, workload.streams)))
    prompts, prompts_s = asyncio.run(run_jobs(system, long, 1))
    prompt = summarize(prompts, prompts_s)
    failed = single["failed"] + streams["failed"] + prompt["failed"]
    errors = single["errors"] + streams["errors"] + prompt["errors"]
    return {
        "one_stream_tok_s": single["per_stream_tok_s"],  # decode rate, after the first token
        "one_stream_tokens": single["output_tokens"],
        "read_bytes_s": read["best_bytes_s"],  # the plain read just before the one stream
        "streams_tok_s": streams["tok_s"],  # aggregate, first token included
        "streams_tokens": streams["output_tokens"],
        "ttft_s": (prompt["ttft_ms"]["p50"] or 0.0) / 1000.0,  # the median of the round's long prompts
        "ttft_samples_s": [result.ttft for result in prompts if result.ok],
        "failed": failed,
        "errors": errors[:3],
    }


def served_model(url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The first entry of /v1/models (tokenmill's says what weight format it runs, once #42 lands)."""
    reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    reply.raise_for_status()
    entry: dict[str, Any] = reply.json()["data"][0]
    return entry


def tokenmill_system(launched: Launched) -> tuple[System, dict[str, Any]]:
    """A started tokenmill as a System to measure, and its /v1/models entry (the model it serves)."""
    card = served_model(launched.url, launched.headers)
    return System(TOKENMILL, launched.url, launched.headers, card["id"], launched.process, launched.start_s), card


# ---- one file ------------------------------------------------------------------------------------


def bench_file(
    shape: ModelShape, kind: str, workload: Workload, args: argparse.Namespace, bandwidth: float
) -> dict[str, Any]:
    gguf = gguf_for(shape, kind, Path(args.models))
    report: dict[str, Any] = {
        "shape": asdict(shape) | {"parameters": shape.parameters},
        "kind": kind,
        "file": str(gguf),
        "file_bytes": gguf.stat().st_size,
        "weight_bytes_per_token": weight_bytes_per_token(gguf),
        "streams": workload.streams,
        "systems": {},
        "skipped": {},
    }
    systems: list[System] = []
    work = Path(tempfile.mkdtemp(prefix="realsize-", dir=CACHE))
    data_dir = work / "data"
    data_dir.mkdir()
    report["registry_estimate"] = registry_estimate(gguf, str(data_dir), args.tokenmill_flags)
    with ExitStack() as stack:
        stack.callback(_remove, work)
        if args.no_llama:
            report["skipped"][LLAMA] = "--no-llama"
        else:
            llama = start_llama_server(stack, find_tools().server, gguf, args.threads, LLAMA_SLOTS, args.passive)
            systems.append(llama)
        why_not = _tokenmill_refused(report["registry_estimate"], args.max_tokenmill_gib)
        if why_not:
            report["skipped"][TOKENMILL] = why_not
        else:
            launched = launch_tokenmill(stack, str(data_dir), f"--model {gguf} {args.tokenmill_flags}", timeout=1800)
            system, report["tokenmill_model"] = tokenmill_system(launched)
            systems.append(system)
        print(f"{gguf.name}: up: " + ", ".join(f"{s.name} in {s.start_s:.1f} s" for s in systems), flush=True)
        # Unmeasured warm-up: first requests pay one-off allocations (bench/latency_bench.py saw 0.66x without).
        for system in systems:
            asyncio.run(run_jobs(system, [Job(chat, 8, 0.0) for chat in synthetic_chats(2, seed=99)], 2))
        rounds: dict[str, list[dict[str, Any]]] = {system.name: [] for system in systems}
        for number in range(workload.rounds):
            for system in systems if number % 2 == 0 else systems[::-1]:  # alternate who goes first
                row = measure_round(system, workload, number, args.threads)
                rounds[system.name].append(row)
                print(
                    f"  round {number + 1} {system.name:10} read {row['read_bytes_s'] / GB:4.1f} GB/s, "
                    f"one stream {row['one_stream_tok_s']:6.1f} tok/s, "
                    f"{workload.streams} streams {row['streams_tok_s']:6.1f} tok/s, TTFT {row['ttft_s']:.2f} s, "
                    f"failed {row['failed']} {row['errors'][:1]}",
                    flush=True,
                )
        for system in systems:
            assert system.process is not None
            medians = {
                # no rounds (--rounds 0: load and warm up only): nothing measured
                key: statistics.median([row[key] for row in rounds[system.name]] or [float("nan")])
                for key in ("one_stream_tok_s", "streams_tok_s", "ttft_s")
            }
            read_rate = report["weight_bytes_per_token"] * medians["one_stream_tok_s"]
            # each round's one stream against the plain read of that round (bandwidth: the run's first read)
            shares = [
                report["weight_bytes_per_token"] * row["one_stream_tok_s"] / row["read_bytes_s"]
                for row in rounds[system.name]
            ]
            report["systems"][system.name] = {
                **medians,
                "peak_rss_bytes": peak_rss(system.process),
                "first_start_s": system.start_s,
                "data_dir_bytes": folder_bytes(data_dir) if system.name == TOKENMILL else 0,
                "weight_read_bytes_s": read_rate,
                "weight_read_of_bandwidth": statistics.median(shares) if shares else read_rate / bandwidth,
                "weight_read_of_first_read": read_rate / bandwidth,
                "failed": sum(row["failed"] for row in rounds[system.name]),
                "rounds": rounds[system.name],
                # llama-server keeps nothing between starts: its restart is its first start
                "restart_s": system.start_s,
            }
        if TOKENMILL in report["systems"]:
            # a restart as an operator's deploy does it: the same data dir, what the first start kept in it
            stop(launched.process)
            again = launch_tokenmill(stack, str(data_dir), f"--model {gguf} {args.tokenmill_flags}", timeout=1800)
            report["systems"][TOKENMILL]["restart_s"] = again.start_s
            stop(again.process)
    report["targets"] = targets(shape, kind, report)
    return report


def memory_file(shape: ModelShape, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """--memory-only: each server alone on the file (llama-server, then tokenmill: neither's memory is beside
    the other's), its peak RSS once up and settled (the load: weights and KV pool) and after a short
    load (8 streams of a 300-token prompt and 64 tokens, at once), then tokenmill's load again, restarted on
    the data dir its first start filled (a first start makes the file's metadata folder), and the same load on
    it in full steps (`restart_load`); no speed is measured, so a busy machine does not matter."""
    gguf = gguf_for(shape, kind, Path(args.models))
    report: dict[str, Any] = {
        "shape": asdict(shape) | {"parameters": shape.parameters},
        "kind": kind,
        "file": str(gguf),
        "file_bytes": gguf.stat().st_size,
        "llama_kv_bytes": llama_kv_bytes(gguf, 1024 * LLAMA_SLOTS),
        "systems": {},
        "skipped": {},
    }
    work = Path(tempfile.mkdtemp(prefix="realsize-", dir=CACHE))
    data_dir = work / "data"
    data_dir.mkdir()
    report["registry_estimate"] = registry_estimate(gguf, str(data_dir), args.tokenmill_flags)
    # 8 x 300 prompt tokens at once, each fitting a llama-server slot (1024 tokens): with default flags tokenmill
    # takes them in steps of its time budget (engine/step_budget.py), on a 2-core CPU a few hundred tokens
    jobs = [Job(exact_prompt(MEMORY_PROMPT_TOKENS, seed), MEMORY_OUTPUT_TOKENS, 0.0) for seed in range(LLAMA_SLOTS)]
    for name in (LLAMA, TOKENMILL):
        with ExitStack() as stack:
            if name == LLAMA:
                if args.no_llama:
                    report["skipped"][LLAMA] = "--no-llama"
                    continue
                system = start_llama_server(stack, find_tools().server, gguf, args.threads, LLAMA_SLOTS, args.passive)
            else:
                stack.callback(_remove, work)
                stack.callback(restart_load, report, gguf, data_dir, jobs, args)  # after this start has stopped
                why_not = _tokenmill_refused(report["registry_estimate"], args.max_tokenmill_gib)
                if why_not:
                    report["skipped"][TOKENMILL] = why_not
                    continue
                launched = launch_tokenmill(
                    stack, str(data_dir), f"--model {gguf} {args.tokenmill_flags}", timeout=1800
                )
                system, report["tokenmill_model"] = tokenmill_system(launched)
            settle(system.process)
            row: dict[str, Any] = {"load_peak_rss_bytes": peak_rss(system.process), "first_start_s": system.start_s}
            row["rss_up_bytes"] = peak_rss(system.process, "VmRSS")
            results = summarize(*asyncio.run(run_jobs(system, jobs, len(jobs))))
            row |= {
                "peak_rss_bytes": peak_rss(system.process),
                "rss_after_bytes": peak_rss(system.process, "VmRSS"),
                "output_tokens": results["output_tokens"],
                "failed": results["failed"],
            }
            report["systems"][name] = row
            print(f"{gguf.name}: {name}: " + ", ".join(f"{key} {value}" for key, value in row.items()), flush=True)
    report["targets"] = memory_targets(report)
    return report


def restart_load(report: dict[str, Any], gguf: Path, data_dir: Path, jobs: list[Job], args: argparse.Namespace) -> None:
    """tokenmill's settled load peak once more, started again on `data_dir` (after the first start stopped),
    then its peak serving `jobs` in full steps: `--max-step-seconds 0` takes --max-num-batched-tokens a step, as
    a machine fast enough for it would with default flags. That is the largest step the engine allows.

    The KV pool's pages are resident only once written (kernels/huge_pages.py), so `jobs` leave most of the
    pool out of that peak: then as many prompts of the longest context as fill the whole pool, at once, the most
    the registry's estimate must cover (`full_pool_peak_rss_bytes`)."""
    row = report["systems"].get(TOKENMILL)
    if row is None:
        return
    flags = f"--model {gguf} {args.tokenmill_flags} --max-step-seconds 0"
    with ExitStack() as stack:
        launched = launch_tokenmill(stack, str(data_dir), flags, timeout=1800)
        settle(launched.process)
        row["restart_load_peak_rss_bytes"] = peak_rss(launched.process)
        system, _ = tokenmill_system(launched)
        results = summarize(*asyncio.run(run_jobs(system, jobs, len(jobs))))
        row["full_step_peak_rss_bytes"] = peak_rss(launched.process)
        row["full_step_failed"] = results["failed"]
        blocks, longest = pool_blocks(launched.url), int(served_model(launched.url, launched.headers)["max_model_len"])
        prompt = min(longest, blocks * 16, POOL_FILL_PROMPT_LIMIT) - 16  # fits the pool, with room for 8 new tokens
        filling = [Job(exact_prompt(prompt, seed), 8, 0.0) for seed in range(blocks * 16 // prompt + 2)]
        results = summarize(*asyncio.run(run_jobs(system, filling, len(filling))))
        row["full_pool_peak_rss_bytes"] = peak_rss(launched.process)
        row["full_pool_failed"] = results["failed"]
    print(
        f"{gguf.name}: tokenmill restarted: load_peak_rss_bytes {row['restart_load_peak_rss_bytes']}, "
        f"full_step_peak_rss_bytes {row['full_step_peak_rss_bytes']}, "
        f"full_pool_peak_rss_bytes {row['full_pool_peak_rss_bytes']} ({blocks} blocks)",
        flush=True,
    )


def pool_blocks(url: str) -> int:
    """The served model's KV pool, in blocks (its /metrics)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "tokenmill:kv_blocks_total":
                return int(sample.value)
    raise RuntimeError(f"{url}/metrics has no tokenmill:kv_blocks_total")


def settle(process: Any, quiet_s: float = 3.0, limit_s: float = 120.0) -> None:
    """Waits until the process's RSS has moved by less than 10 MB for `quiet_s` (tokenmill answers /health
    while the registry's other enabled models may still load in the background)."""
    started = last_change = time.monotonic()
    last = peak_rss(process, "VmRSS")
    while time.monotonic() - last_change < quiet_s and time.monotonic() - started < limit_s:
        time.sleep(0.25)
        now = peak_rss(process, "VmRSS")
        if abs(now - last) > 10 * 2**20:
            last, last_change = now, time.monotonic()


def memory_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """#42's memory targets for a --memory-only file: serving peak against llama-server's, the load's peak
    against the file and the KV pool, and the registry's estimate against the measured peak."""
    mill, llama = report["systems"].get(TOKENMILL), report["systems"].get(LLAMA)
    estimate = report["registry_estimate"]
    rows = []
    if mill:
        pool = estimate.get("kv_bytes", float("nan"))
        rows.append(("peak RSS serving <= 1.5x llama-server's", _ratio(mill, llama, "peak_rss_bytes"), 0.0, 1.5))
        load_bound = report["file_bytes"] + pool
        rows.append(("peak RSS at load <= 1.2x (file + KV pool)", mill["load_peak_rss_bytes"] / load_bound, 0.0, 1.2))
        if "restart_load_peak_rss_bytes" in mill:
            restarted = mill["restart_load_peak_rss_bytes"] / load_bound
            rows.append(("the same, restarted on its data dir", restarted, 0.0, 1.2))
        if "full_pool_peak_rss_bytes" in mill:  # full steps into a full pool: the most the estimate must cover
            total = estimate.get("total_bytes", float("nan"))
            peak = mill["full_pool_peak_rss_bytes"]
            rows.append(("registry estimate / peak with the pool full, in [1.0, 1.05]", total / peak, 1.0, 1.05))
    return [
        {"target": name, "value": value, "unit": "x", "met": bool(low <= value <= high)}
        for name, value, low, high in rows
    ]


def print_report_footer(name: str, report: dict[str, Any]) -> None:
    """A file's skipped systems, the registry's estimate and the targets, below its rows of either table."""
    for system, why in report["skipped"].items():
        print(f"{name:24} {system:10} skipped: {why}")
    estimate = report["registry_estimate"]
    print(f"{'':24} registry estimate: {estimate.get('describe') or estimate.get('error')}")
    for target in report["targets"]:
        value = "-" if target["value"] != target["value"] else f"{target['value']:.2f}{target['unit']}"
        print(f"{'':24} target: {target['target']:58} {value:>9}  {'met' if target['met'] else 'MISSED'}")


def print_memory_report(files: list[dict[str, Any]]) -> None:
    print(f"\n{'file':24} {'system':10} {'file GB':>8} {'KV GB':>6} {'load peak GB':>12} {'serving peak GB':>15}")
    for report in files:
        name = Path(report["file"]).name.removesuffix(".gguf")
        pools = {TOKENMILL: report["registry_estimate"].get("kv_bytes", float("nan")), LLAMA: report["llama_kv_bytes"]}
        for system, row in report["systems"].items():
            print(
                f"{name:24} {system:10} {report['file_bytes'] / GB:8.2f} {pools[system] / GB:6.2f} "
                f"{row['load_peak_rss_bytes'] / GB:12.2f} {row['peak_rss_bytes'] / GB:15.2f}"
            )
            if "restart_load_peak_rss_bytes" in row:
                full_steps = row.get("full_step_peak_rss_bytes", float("nan")) / GB
                print(
                    f"{'':24} {'restarted':10} {'':8} {'':6} {row['restart_load_peak_rss_bytes'] / GB:12.2f} "
                    f"{full_steps:15.2f} (full steps)"
                )
            if "full_pool_peak_rss_bytes" in row:
                full_pool = row["full_pool_peak_rss_bytes"] / GB
                print(f"{'':24} {'restarted':10} {'':8} {'':6} {'':12} {full_pool:15.2f} (full steps, pool full)")
        print_report_footer(name, report)


def _tokenmill_refused(estimate: dict[str, Any], limit_gib: float) -> str:
    """Why tokenmill is not started on this file: the registry estimates it over --max-tokenmill-gib (a float32
    copy of a 3B would take a shared machine down). Raise the limit where the estimate is known to overstate."""
    total = estimate.get("total_bytes")
    if total is not None and total > limit_gib * GIB:
        return f"the registry estimates {total / GIB:.1f} GiB, over --max-tokenmill-gib {limit_gib:g}"
    return ""


# ---- targets and report --------------------------------------------------------------------------


def targets(shape: ModelShape, kind: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for this file, each with the measured value and whether it is met."""
    mill, llama = report["systems"].get(TOKENMILL), report["systems"].get(LLAMA)
    checks: list[tuple[str, Callable[[], float], Callable[[float], bool], str]] = []
    if shape.name == "llama-3b" or kind != "Q4_K_M":
        checks.append(
            ("one stream >= 1.0x llama-server", lambda: _ratio(mill, llama, "one_stream_tok_s"), _at_least(1.0), "x")
        )
    else:
        checks += [
            ("peak RSS <= 1.5x llama-server's", lambda: _ratio(mill, llama, "peak_rss_bytes"), _at_most(1.5), "x"),
            ("TTFT (long prompt) <= llama-server's", lambda: _ratio(mill, llama, "ttft_s"), _at_most(1.0), "x"),
            (
                f"{report['streams']} streams >= 2x llama-server",
                lambda: _ratio(mill, llama, "streams_tok_s"),
                _at_least(2.0),
                "x",
            ),
            (
                "one stream reads weights at >= 80% of plain read bandwidth",
                lambda: 100 * mill["weight_read_of_bandwidth"] if mill else float("nan"),
                _at_least(80.0),
                "%",
            ),
        ]
    rows = []
    for name, value_of, passes, unit in checks:
        value = value_of()
        rows.append({"target": name, "value": value, "unit": unit, "met": bool(value == value and passes(value))})
    loads = {"target": "tokenmill loads it with its KV pool", "value": float(mill is not None), "unit": ""}
    rows.insert(0, loads | {"met": mill is not None and mill["failed"] == 0})
    return rows


def _ratio(mill: dict[str, Any] | None, llama: dict[str, Any] | None, key: str) -> float:
    if not mill or not llama or not llama[key]:
        return float("nan")
    return float(mill[key] / llama[key])


def _at_least(bound: float) -> Callable[[float], bool]:
    return lambda value: value >= bound


def _at_most(bound: float) -> Callable[[float], bool]:
    return lambda value: value <= bound


def print_report(files: list[dict[str, Any]], bandwidth: dict[str, float], workload: Workload) -> None:
    print(
        f"\nplain read bandwidth (torch sum, {bandwidth['threads']} threads): "
        f"{bandwidth['median_bytes_s'] / GB:.1f} GB/s median, {bandwidth['best_bytes_s'] / GB:.1f} best"
    )
    print(
        f"\n{'file':24} {'system':10} {'peak RSS GB':>11} {'start s':>8} {'restart s':>9} {'written GB':>10} {'1x tok/s':>9} "
        f"{f'{workload.streams}x tok/s':>9} {'TTFT s':>7} {'read GB/s':>9} {'% of bw':>7}"
    )
    for report in files:
        name = Path(report["file"]).name.removesuffix(".gguf")
        for system, row in report["systems"].items():
            print(
                f"{name:24} {system:10} {row['peak_rss_bytes'] / GB:11.2f} {row['first_start_s']:8.1f} "
                f"{row.get('restart_s', float('nan')):9.1f} "
                f"{row['data_dir_bytes'] / GB:10.2f} {row['one_stream_tok_s']:9.1f} {row['streams_tok_s']:9.1f} "
                f"{row['ttft_s']:7.2f} {row['weight_read_bytes_s'] / GB:9.1f} {100 * row['weight_read_of_bandwidth']:6.0f}%"
            )
        print_report_footer(name, report)


def plot(files: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("one_stream_tok_s", "one stream, tok/s", 1.0),
        ("streams_tok_s", "streams at once, aggregate tok/s", 1.0),
        ("ttft_s", "TTFT of the long prompt, s", 1.0),
        ("peak_rss_bytes", "peak RSS, GB", 1 / GB),
    ]
    figure, axes = plt.subplots(1, len(metrics), figsize=(16, 4.2))
    names = [Path(report["file"]).name.removesuffix(".gguf") for report in files]
    for axis, (key, label, scale) in zip(axes, metrics, strict=True):
        for offset, system in enumerate((TOKENMILL, LLAMA)):
            values = [report["systems"].get(system, {}).get(key, 0.0) * scale for report in files]
            axis.bar([i + offset * 0.4 for i in range(len(files))], values, 0.4, label=system)
        axis.set_xticks([i + 0.2 for i in range(len(files))], names, fontsize=7)
        axis.set_title(label, fontsize=9)
        axis.legend(fontsize=7)
    figure.suptitle("tokenmill vs llama-server on the same GGUF (random weights of real shapes; medians)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def estimate_8b(models: Path, data_dir: str, template: Path, kind: str) -> dict[str, Any]:
    """The registry's estimate for an 8B shape, from a header-only GGUF with `template`'s tensor types (the
    estimate reads only headers). Tied embeddings and SmolLM2's vocabulary: 7.2 B parameters, not 8.0."""
    # Named by its template: its types per layer come from there (a 2-layer template makes every layer Q6_K-heavy).
    header = header_only_gguf(template, LLAMA_8B, models / f"{LLAMA_8B.name}-{kind}-header-from-{template.stem}.gguf")
    return {"file": str(header), "parameters": LLAMA_8B.parameters, **registry_estimate(header, data_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-1b,llama-3b", help=f"of {list(SHAPES)}")
    parser.add_argument("--kinds", default="Q4_K_M", help="llama-quantize types, e.g. Q4_K_M,Q8_0,Q4_0")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternated rounds (default 3; --quick 1; 0: load, warm up, memory only)",
    )
    parser.add_argument("--tokenmill-flags", default="", help="extra `tokenmill serve` flags (default: none)")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t / -tb")
    parser.add_argument(
        "--passive",
        action="store_true",
        help="threads wait without spinning (OMP_WAIT_POLICY=PASSIVE, llama-server --poll 0): for a shared machine",
    )
    parser.add_argument("--no-llama", action="store_true", help="tokenmill alone")
    parser.add_argument(
        "--max-tokenmill-gib",
        type=float,
        default=12.0,
        help="skip tokenmill on a file the registry estimates above this (a float32 3B would need ~25 GiB)",
    )
    parser.add_argument("--models", default=str(MODELS), help="where the made GGUFs are cached")
    parser.add_argument("--no-8b-estimate", action="store_true", help="skip the 8B shape's registry estimate")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 1 round, a few tokens: proves it runs")
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="no speed rounds: each server alone, peak RSS at load and after 8 streams (300-token prompts, 64 tokens)",
    )
    parser.add_argument("--tag", default="", help="results go to realsize_bench-TAG.json/.png")
    parser.add_argument("--out", default=None, help="JSON path (the PNG goes beside it)")
    args = parser.parse_args()
    workload = QUICK if args.quick else FULL
    if args.rounds is not None:
        workload = dataclasses.replace(workload, rounds=args.rounds)
    shapes = ["llama-tiny"] if args.quick else args.shapes.split(",")
    if args.passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # tokenmill inherits it
    try:
        find_tools()
    except ToolsUnavailable as error:
        sys.exit(f"llama.cpp's tools are needed to make the GGUFs: {error}")
    if args.memory_only:
        memory_only(shapes, args)
        return
    load_start = os.getloadavg()
    bandwidth = read_bandwidth(workload.bandwidth_bytes, args.threads)
    print(f"plain read bandwidth: {bandwidth['best_bytes_s'] / GB:.1f} GB/s (best pass)", flush=True)
    files = [
        # The best pass is the machine's limit; a median taken while others load the machine is not
        bench_file(SHAPES[shape], kind, workload, args, bandwidth["best_bytes_s"])
        for shape in shapes
        for kind in args.kinds.split(",")
    ]
    report: dict[str, Any] = {
        "machine": {
            "cpu": _cpu_name(),
            **_cpu_kind(),
            "cores": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
            "platform": platform.platform(),
        },
        "command": " ".join(sys.argv),
        "workload": asdict(workload),
        "thread_wait": "passive" if args.passive else "each system's default",
        "tokenmill_flags": args.tokenmill_flags or "(defaults)",
        "llama_server_flags": f"-t {args.threads} -tb {args.threads} -np {LLAMA_SLOTS} -c {1024 * LLAMA_SLOTS}"
        + (" --poll 0" if args.passive else ""),
        "read_bandwidth": bandwidth,
        "files": files,
    }
    if not args.no_8b_estimate and files:
        with tempfile.TemporaryDirectory(prefix="realsize-8b-", dir=CACHE) as data_dir:
            first = files[0]
            report["estimate_8b"] = estimate_8b(Path(args.models), data_dir, Path(first["file"]), first["kind"])
    print_report(files, bandwidth, workload)
    if "estimate_8b" in report:
        estimate = report["estimate_8b"]
        print(
            f"\n8B shape ({LLAMA_8B.parameters / 1e9:.2f} B parameters), registry estimate: "
            f"{estimate.get('describe') or estimate.get('error')}; accepted on a 24 GB box: "
            f"{estimate.get('accepted_on_24gb_box')}"
        )
    out = Path(args.out) if args.out else RESULTS / ("realsize_bench" + (f"-{args.tag}" if args.tag else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(files, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")


def memory_only(shapes: list[str], args: argparse.Namespace) -> None:
    files = [memory_file(SHAPES[shape], kind, args) for shape in shapes for kind in args.kinds.split(",")]
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "tokenmill_flags": args.tokenmill_flags or "(defaults)",
        "llama_server_flags": f"-t {args.threads} -tb {args.threads} -np {LLAMA_SLOTS} -c {1024 * LLAMA_SLOTS}",
        "files": files,
    }
    if not args.no_8b_estimate and files:
        with tempfile.TemporaryDirectory(prefix="realsize-8b-", dir=CACHE) as data_dir:
            first = files[0]
            report["estimate_8b"] = estimate_8b(Path(args.models), data_dir, Path(first["file"]), first["kind"])
    print_memory_report(files)
    if "estimate_8b" in report:
        estimate = report["estimate_8b"]
        print(
            f"\n8B shape, registry estimate: {estimate.get('describe') or estimate.get('error')}; "
            f"accepted on a 24 GB box: {estimate.get('accepted_on_24gb_box')}"
        )
    name = "realsize_memory" + (f"-{args.tag}" if args.tag else "") + ".json"
    out = Path(args.out) if args.out else RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cpu_kind() -> dict[str, str]:
    """What tells these VMs' CPUs apart where the name does not (every EPYC here is just "AMD EPYC"): family and
    model (AMD 23/49 a Zen 2, 25/1 a Zen 3, 25/17 a Zen 4), the vector unit tokenmill's kernels were built for, and
    whether their many-row K-quant products ran on AMX tiles."""
    from kernels.qlinear import matrix_unit, vector_unit

    fields = {"cpu family": "", "model": ""}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in fields and not fields[key.strip()]:
            fields[key.strip()] = value.strip()
    return {
        "cpu_family": fields["cpu family"],
        "cpu_model": fields["model"],
        "vector_unit": vector_unit() or "none",
        "matrix_unit": matrix_unit() or "none",
    }


if __name__ == "__main__":
    main()
