"""The Batch API filling idle seats, measured: interactive traffic at light load alone, then the same
traffic while a batch runs, through the whole server (HTTP, gateway, batch runner, engine).

Reports per phase: seat occupancy (running sequences / max_num_seqs, sampled), interactive TTFT p50 /
p99 (streamed chat), batch output tokens/s gained, and the real cost per output token (the machine's
hourly cost over every token it produced). Writes JSON and a PNG under bench/results/.

    python bench/batch_bench.py            # the embedded SmolLM2 in bf16 (a few minutes on 2 cores)
    python bench/batch_bench.py --quick    # fewer, shorter requests: a smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see engine_bench.py: spinning OpenMP threads on a shared VM

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.gateway.config import GatewayConfig
from app.gateway.service import TeamGateway
from app.main import create_app
from app.settings import Settings
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.loader import load_model

RESULTS = ROOT / "bench" / "results"
ADMIN_KEY = "sk-admin-bench-" + "x" * 24
PROMPTS = [
    "Write one sentence about the sea.",
    "Name three fruits.",
    "What is a prime number?",
    "Describe a cat in a few words.",
    "Give me a tip for cooking rice.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def interactive(client: httpx.AsyncClient, key: str, model: str, number: int, max_tokens: int) -> float:
    """One streamed chat request; its time to first token."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[number % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    sent = time.monotonic()
    first = None
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        async for text in response.aiter_lines():
            if first is None and text.startswith("data: {") and '"content":"' in text and '"content":""' not in text:
                first = time.monotonic() - sent
    return first if first is not None else time.monotonic() - sent


async def phase(
    url: str, key: str, model: str, engine: AsyncEngine, *, requests: int, every_s: float, max_tokens: int
) -> dict:
    occupancy: list[float] = []
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            stats = engine.stats()
            occupancy.append(stats.num_running / stats.max_num_seqs)
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        tasks = []
        for number in range(requests):
            tasks.append(asyncio.create_task(interactive(client, key, model, number, max_tokens)))
            await asyncio.sleep(every_s)
        ttfts = await asyncio.gather(*tasks)
    seconds = time.monotonic() - started
    done.set()
    await sampler
    return {
        "seconds": seconds,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttfts": ttfts,
        "occupancy_mean": statistics.fmean(occupancy),
        "occupancy": occupancy,
        "interactive_output_tokens": requests * max_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--hardware-cost-per-hour", type=float, default=1.0, help="USD per hour of this machine")
    parser.add_argument("--out", type=Path, default=RESULTS / "batch_bench.json")
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("TOKENMILL_DATA_DIR", ".tokenmill"),
        help="where the converted embedded model is cached",
    )
    args = parser.parse_args()
    requests, every_s, max_tokens, batch_lines, seats = (8, 0.5, 16, 32, 8) if args.quick else (60, 0.2, 32, 200, 16)
    loaded = load_model(EngineConfig(dtype=args.dtype, data_dir=args.data_dir))
    config = EngineConfig(model=str(loaded.folder), dtype=args.dtype, max_num_seqs=seats, num_kv_blocks=2048)
    work = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    gateway = TeamGateway(
        GatewayConfig(database_url=f"sqlite:///{work / 'bench.db'}", admin_key=ADMIN_KEY, spill_dir=str(work))
    )
    settings = Settings(
        port=0,
        data_dir=str(work),
        files_dir=str(work / "files"),
        hardware_cost_per_hour=args.hardware_cost_per_hour,
        engine=config,
    )
    engine = AsyncEngine.start(config, loaded)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, engine, gateway=gateway), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    team = httpx.post(f"{url}/admin/api/teams", json={"name": "bench"}, headers=admin).json()
    key = httpx.post(f"{url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin).json()["key"]
    model = engine.model_name
    try:
        alone = asyncio.run(phase(url, key, model, engine, requests=requests, every_s=every_s, max_tokens=max_tokens))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        lines = "".join(
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": model,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    },
                }
            )
            + "\n"
            for i in range(batch_lines)
        )
        uploaded = client.files.create(file=("bench.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with_batch = asyncio.run(
            phase(url, key, model, engine, requests=requests, every_s=every_s, max_tokens=max_tokens)
        )
        lines_done = client.batches.retrieve(batch.id).request_counts.completed
        client.batches.cancel(batch.id)
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()
    with_batch["batch_lines_done"] = lines_done
    with_batch["batch_tokens_per_s"] = lines_done * max_tokens / with_batch["seconds"]
    for result, batch_tokens in ((alone, 0), (with_batch, lines_done * max_tokens)):
        tokens = result["interactive_output_tokens"] + batch_tokens
        result["real_cost_per_1m_output_tokens_usd"] = (
            args.hardware_cost_per_hour * result["seconds"] / 3600 / tokens * 1e6
        )
    report = {
        "model": model,
        "seats": seats,
        "interactive": {"requests": requests, "every_s": every_s, "max_tokens": max_tokens},
        "batch_lines": batch_lines,
        "alone": alone,
        "with_batch": with_batch,
    }
    for name, result in (("alone", alone), ("with batch", with_batch)):
        print(
            f"{name:10s} occupancy {result['occupancy_mean']:5.1%}  TTFT p50 {result['ttft_p50_s']:.3f}s "
            f"p99 {result['ttft_p99_s']:.3f}s  real cost ${result['real_cost_per_1m_output_tokens_usd']:.2f}/1M tok"
        )
    print(
        f"batch: {lines_done} lines, {with_batch['batch_tokens_per_s']:.1f} tok/s gained; TTFT p99 ratio "
        f"{with_batch['ttft_p99_s'] / alone['ttft_p99_s']:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_axis, seats_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ("alone", "with_batch")
    for offset, stat in enumerate(("ttft_p50_s", "ttft_p99_s")):
        ttft_axis.bar(
            [i + (offset - 0.5) * 0.35 for i in range(2)], [report[n][stat] for n in names], 0.35, label=stat[5:8]
        )
    ttft_axis.set_xticks(range(2), ["interactive alone", "interactive + batch"])
    ttft_axis.set_ylabel("time to first token (s)")
    ttft_axis.set_title("interactive TTFT")
    ttft_axis.legend()
    for name, color in zip(names, ("tab:blue", "tab:orange")):
        samples = report[name]["occupancy"]
        seats_axis.plot(
            [i * 0.1 for i in range(len(samples))],
            samples,
            color=color,
            label=f"{name} (mean {report[name]['occupancy_mean']:.0%}, "
            f"${report[name]['real_cost_per_1m_output_tokens_usd']:.2f}/1M tok)",
        )
    seats_axis.set_xlabel("seconds")
    seats_axis.set_ylabel("seats in use")
    seats_axis.set_title("seat occupancy")
    seats_axis.legend()
    fig.suptitle(f"Batch API filling idle seats: {report['model']}, {report['seats']} seats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
