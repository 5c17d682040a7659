"""Soak: the real server under 4x the load its KV pool can hold, for a bounded time, through the official
openai client. Mixed prompt and output lengths, streamed and whole, some clients walking away mid-stream.

Passes when: no 5xx; every request answered, or refused with 429 / 503 carrying Retry-After; the engine
goes back to nothing running, nothing waiting and no KV block in use; the server's RSS stays flat; the
usage rows equal the requests sent. Prints the figures and writes JSON to bench/results/.

    python bench/soak.py --duration 120 --num-kv-blocks 96 --max-waiting 16
    python bench/soak.py --url http://host:8000 --api-key sk-... --admin-key sk-admin-...   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import free_port, serve_command

RESULTS = ROOT / "bench" / "results"
MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
ADMIN_KEY = "sk-admin-soak-" + "s" * 24
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # ok, ok_stream, disconnected, 429, 503, 5xx, ...
    missing_retry_after: int = 0
    completion_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few unexpected ones, for the report

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())

    def unexpected(self, what: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(what[:300])


def prompt_of(rng: random.Random) -> list[dict]:
    words = rng.choice([4, 12, 40, 120])
    return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words)) + ". Go on."}]


async def one_request(client: openai.AsyncOpenAI, rng: random.Random, tally: Tally) -> None:
    kind = rng.choices(["whole", "stream", "walk_away"], weights=[4, 4, 2])[0]
    max_tokens = rng.choice([4, 16, 32, 64])
    started = time.monotonic()
    try:
        if kind == "whole":
            response = await client.chat.completions.create(
                model=MODEL, messages=prompt_of(rng), max_tokens=max_tokens, extra_body={"ignore_eos": True}
            )
            tally.completion_tokens += response.usage.completion_tokens
            tally.outcomes["ok"] += 1
        else:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=prompt_of(rng),
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = 0
            async for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    tally.completion_tokens += chunk.usage.completion_tokens
                if kind == "walk_away" and chunks == 3:
                    await stream.close()  # the client goes away mid-stream
                    tally.outcomes["disconnected"] += 1
                    return
            tally.outcomes["ok_stream" if kind == "stream" else "ok_stream_short"] += 1
        tally.latencies_s.append(time.monotonic() - started)
    except openai.APIStatusError as error:
        status = error.status_code
        if status in (429, 503):
            tally.outcomes[str(status)] += 1
            if not error.response.headers.get("retry-after"):
                tally.missing_retry_after += 1
            await asyncio.sleep(min(float(error.response.headers.get("retry-after") or 1), 2) * rng.random())
        else:
            tally.outcomes["5xx" if status >= 500 else f"{status}"] += 1
            tally.unexpected(f"{status}: {error.message}")
    except openai.APIError as error:  # connection reset, timeout, a stream that ended with an error event
        if getattr(error, "code", None) in ("queue_full", "shutting_down"):
            tally.outcomes["503_mid_stream"] += 1  # refused after a 200 went out: no status, no Retry-After
            return
        tally.outcomes["client_error"] += 1
        tally.unexpected(f"{type(error).__name__}: {error}")


async def drive(base_url: str, api_key: str, concurrency: int, duration_s: float, seed: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with openai.AsyncOpenAI(
        base_url=base_url + "/v1",
        api_key=api_key,
        max_retries=0,
        timeout=120,
        http_client=httpx.AsyncClient(limits=limits, timeout=120),
    ) as client:

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                await one_request(client, rng, tally)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return tally


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[re.sub(r"\{.*\}", "", name)] = float(value)
    return values


def wait_idle(url: str, timeout_s: float = 60) -> tuple[dict[str, float], float]:
    started = time.monotonic()
    while True:
        m = metrics(url)
        idle = (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() - started > timeout_s:
            return m, time.monotonic() - started
        time.sleep(0.2)


def usage_requests(url: str, admin_key: str, key_id: int, expected: int, timeout_s: float = 30) -> int:
    """Requests in the usage roll-up for the soak key; waits for the writer to catch up."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = httpx.get(
            url + "/admin/api/usage",
            params={"key_id": key_id, "group_by": "key"},
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=10,
        ).json()
        counted = sum(row["requests"] for row in report["data"])
        if counted >= expected or time.monotonic() > deadline:
            return counted
        time.sleep(0.5)


def start_server(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = args.port or free_port()
    env = {
        **os.environ,
        "TOKENMILL_ADMIN_KEY": ADMIN_KEY,
        "TOKENMILL_DATABASE_URL": args.database_url or f"sqlite:///{workdir / 'soak.db'}",
    }
    env.pop("TOKENMILL_API_KEY", None)
    options = ["--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs)]
    options += ["--max-waiting", str(args.max_waiting), "--max-tokens-cap", "64"]
    command = serve_command(port, args.data_dir, *options)
    log = open(workdir / "server.log", "w")  # the child writes to it until it exits
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            models = httpx.get(url + "/admin/api/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=1)
            # Enabled models (the embedded MiniLM too) load in the background after start-up; memory is
            # measured against a server that has finished loading.
            if models.status_code == 200 and "loading" not in [model["state"] for model in models.json()["data"]]:
                return process, url
            time.sleep(0.3)
        except httpx.TransportError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("the server did not start:\n" + (workdir / "server.log").read_text())


def make_key(url: str, admin_key: str) -> tuple[str, int]:
    headers = {"Authorization": f"Bearer {admin_key}"}
    team = httpx.post(url + "/admin/api/teams", json={"name": f"soak-{time.time_ns()}"}, headers=headers).json()
    key = httpx.post(url + "/admin/api/keys", json={"team_id": team["id"]}, headers=headers).json()
    return key["key"], key["id"]


def run(args: argparse.Namespace) -> dict:
    # The largest request: a 120-word prompt (~200 tokens with the template) and 64 new tokens.
    blocks_per_request = -(-(200 + 64) // BLOCK_SIZE)
    pool_holds = max(1, min(args.num_kv_blocks // blocks_per_request, args.max_num_seqs))
    concurrency = args.concurrency or 4 * pool_holds
    with tempfile.TemporaryDirectory(prefix="tokenmill-soak-") as tmp:
        process = None
        if args.url:
            url, admin_key = args.url.rstrip("/"), args.admin_key
        else:
            process, url = start_server(args, Path(tmp))
            admin_key = ADMIN_KEY
        try:
            api_key, key_id = make_key(url, admin_key)
            rss = (lambda: psutil.Process(process.pid).memory_info().rss) if process else (lambda: 0)
            warmup = asyncio.run(drive(url, api_key, concurrency, args.warmup, args.seed + 1))
            wait_idle(url)
            rss_before = rss()
            started = time.monotonic()
            tally = asyncio.run(drive(url, api_key, concurrency, args.duration, args.seed))
            elapsed = time.monotonic() - started
            after, drain_s = wait_idle(url)
            rss_after = rss()
            sent = warmup.sent + tally.sent
            rows = usage_requests(url, admin_key, key_id, sent)
        finally:
            if process is not None:
                process.terminate()
                process.wait(60)
    latencies = sorted(tally.latencies_s) or [0.0]
    result = {
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("api_key", "admin_key")},
            "concurrency": concurrency,
            "pool_holds": pool_holds,
        },
        "requests": tally.sent,
        "outcomes": dict(tally.outcomes),
        "warmup_requests": warmup.sent,
        "requests_per_s": round(tally.sent / elapsed, 2),
        "completion_tokens_per_s": round(tally.completion_tokens / elapsed, 1),
        "latency_p50_s": round(latencies[len(latencies) // 2], 3),
        "latency_p99_s": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 3),
        "server_errors": tally.outcomes["5xx"],
        "client_errors": tally.outcomes["client_error"],
        "refusals_without_retry_after": tally.missing_retry_after + warmup.missing_retry_after,
        "idle_after": {
            name: after[name]
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        },
        "drain_s": round(drain_s, 2),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
        "usage_rows": rows,
        "requests_sent_incl_warmup": sent,
        "unexpected": tally.errors + warmup.errors,
    }
    growth_mb = result["rss_after_mb"] - result["rss_before_mb"]
    result["checks"] = {
        "no_5xx": result["server_errors"] == 0 and warmup.outcomes["5xx"] == 0,
        "no_client_errors": result["client_errors"] == 0 and warmup.outcomes["client_error"] == 0,
        "refused_before_the_headers": tally.outcomes["503_mid_stream"] + warmup.outcomes["503_mid_stream"] == 0,
        "refusals_carry_retry_after": result["refusals_without_retry_after"] == 0,
        "engine_idle_after": all(v == 0 for v in result["idle_after"].values()),
        "rss_flat": growth_mb <= args.max_rss_growth_mb,
        "usage_rows_equal_requests": rows == sent,
    }
    result["passed"] = all(result["checks"].values())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load after the warm-up")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before RSS is measured")
    parser.add_argument("--concurrency", type=int, default=0, help="clients (default: 4x what the KV pool holds)")
    parser.add_argument("--num-kv-blocks", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-waiting", type=int, default=16, help="the bounded waiting queue")
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0)
    parser.add_argument("--data-dir", default=str(ROOT / ".tokenmill"), help="where converted weights are cached")
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temp folder")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--url", default=None, help="soak a running server instead of starting one")
    parser.add_argument("--admin-key", default=None, help="with --url")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default: bench/results/soak-TIME.json)")
    args = parser.parse_args(argv)
    result = run(args)
    out = Path(args.out) if args.out else RESULTS / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name in (
        "requests",
        "outcomes",
        "requests_per_s",
        "completion_tokens_per_s",
        "latency_p50_s",
        "latency_p99_s",
        "idle_after",
        "drain_s",
        "rss_before_mb",
        "rss_after_mb",
        "usage_rows",
        "requests_sent_incl_warmup",
        "checks",
        "unexpected",
    ):
        print(f"{name:28s} {result[name]}")
    print(f"{'passed':28s} {result['passed']}   ({out})")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
