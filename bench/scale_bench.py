"""Replicas on Ray Serve with shared system prompts: prefix-cache hit rate and throughput with prefix-aware
routing against round-robin, in one run (app/scaleout/ray_serve.py).

Several tenants each send chats that start with their own long system prompt, interleaved. Each replica's
KV pool holds only some of the tenants' prefixes: prefix-aware routing keeps a tenant on one replica, so
its prefix stays cached there; round-robin sends every tenant to every replica, where prefixes evict each
other. Each routing mode gets fresh replicas (cold caches) and the same requests in the same order.
The hit rate is cached prompt tokens over prompt tokens, from the responses' usage.

    python bench/scale_bench.py                      # SmolLM2, 2 replicas, 12 tenants x 6 chats
    python bench/scale_bench.py --tenants 4 --chats-per-tenant 3 --max-tokens 4     # a quick look
Needs the `ray` extra and PostgreSQL (--database-url; by default a fresh database on the local server).
Writes bench/results/scale_bench.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

RESULTS = ROOT / "bench" / "results"
PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
ROUTERS = ("prefix", "round-robin")
COMPANIES = [
    "Acme",
    "Globex",
    "Initech",
    "Umbrella",
    "Hooli",
    "Vandelay",
    "Stark",
    "Wayne",
    "Tyrell",
    "Soylent",
    "Cyberdyne",
    "Wonka",
    "Gringotts",
    "Oscorp",
    "Massive",
    "Aperture",
]
POLICIES = [
    "Refunds are possible within {n} days of purchase.",
    "Never share a customer's data with anyone.",
    "Escalate complaints about billing to a human after {n} messages.",
    "Answer in at most {n} sentences.",
    "Our support desk is open {n} hours a day.",
    "Offer the premium plan only when asked about limits.",
    "Orders ship within {n} working days.",
    "Quote prices in euros and include VAT.",
    "Mention the status page when a service is down.",
    "Do not promise delivery dates.",
    "Warranty claims need the serial number and a photo.",
    "Passwords are reset from the login page only.",
]
QUESTIONS = [
    "Where is my order?",
    "How do I reset my password?",
    "Can I get a refund?",
    "Is the service down?",
    "What does the premium plan include?",
    "How long does shipping take?",
    "Can I change my address?",
    "Do you ship abroad?",
    "How do I cancel?",
    "Who do I talk to about an invoice?",
]


def system_prompt(company: str, words: int, rng: random.Random) -> str:
    sentences = [f"You are the support assistant of {company}."]
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(rng.choice(POLICIES).format(n=rng.randint(2, 60)))
    return " ".join(sentences)


def workload(tenants: int, chats_per_tenant: int, system_words: int, seed: int = 0) -> list[list[dict]]:
    """Chats of all tenants, shuffled together: each tenant's system prompt, then one question."""
    rng = random.Random(seed)
    systems = [
        system_prompt(COMPANIES[i % len(COMPANIES)] + (f" {i}" if i >= len(COMPANIES) else ""), system_words, rng)
        for i in range(tenants)
    ]
    chats = [
        [{"role": "system", "content": systems[t]}, {"role": "user", "content": rng.choice(QUESTIONS)}]
        for t in range(tenants)
        for _ in range(chats_per_tenant)
    ]
    rng.shuffle(chats)
    return chats


async def run_chats(
    base_url: str, key: str, model: str, chats: list[list[dict]], concurrency: int, max_tokens: int
) -> tuple[list[dict], float]:
    from app.scaleout.ray_serve import REPLICA_HEADER

    queue: asyncio.Queue = asyncio.Queue()
    for index, messages in enumerate(chats):
        queue.put_nowait((index, messages))
    records: list[dict] = [{} for _ in chats]

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            index, messages = queue.get_nowait()
            started = time.perf_counter()
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            response.raise_for_status()
            usage = response.json()["usage"]
            records[index] = {
                "latency_s": time.perf_counter() - started,
                "replica": response.headers[REPLICA_HEADER],
                "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            }

    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers={"Authorization": f"Bearer {key}"}) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return records, time.perf_counter() - started


def summarise(records: list[dict], wall_s: float) -> dict:
    latencies = np.array([r["latency_s"] for r in records])
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    output = sum(r["completion_tokens"] for r in records)
    per_replica: dict[str, int] = {}
    for r in records:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    return {
        "requests": len(records),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(records) / wall_s, 3),
        "output_tokens_per_s": round(output / wall_s, 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "latency_s": {
            "mean": round(float(latencies.mean()), 3),
            "p50": round(float(np.percentile(latencies, 50)), 3),
            "p99": round(float(np.percentile(latencies, 99)), 3),
        },
        "requests_per_replica": sorted(per_replica.values(), reverse=True),
    }


def fresh_database(url: str | None) -> str:
    if url:
        return url
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text('DROP DATABASE IF EXISTS "tokenmill_scale_bench" WITH (FORCE)'))
        connection.execute(text('CREATE DATABASE "tokenmill_scale_bench"'))
    admin.dispose()
    return PG_SERVER.rsplit("/", 1)[0] + "/tokenmill_scale_bench"


def create_key(base_url: str, admin_key: str) -> str:
    admin = {"Authorization": f"Bearer {admin_key}"}
    team = httpx.post(f"{base_url}/admin/api/teams", json={"name": "scale-bench"}, headers=admin, timeout=60)
    team.raise_for_status()
    key = httpx.post(f"{base_url}/admin/api/keys", json={"team_id": team.json()["id"]}, headers=admin, timeout=60)
    key.raise_for_status()
    return key.json()["key"]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    names = list(runs)
    figure, axes = plt.subplots(1, 3, figsize=(12, 4))
    panels = [
        ("prefix_cache_hit_rate", "prefix-cache hit rate"),
        ("requests_per_s", "requests / s"),
        ("output_tokens_per_s", "output tokens / s"),
    ]
    for axis, (metric, label) in zip(axes, panels, strict=True):
        values = [runs[name][metric] for name in names]
        axis.bar(names, values, color=["tab:green", "tab:gray"][: len(names)])
        axis.set_title(label)
        for x, value in enumerate(values):
            axis.text(x, value, f"{value:.2f}", ha="center", va="bottom")
    workload_ = report["workload"]
    figure.suptitle(
        f"{report['replicas']} replicas, {workload_['tenants']} tenants x {workload_['chats_per_tenant']}"
        f" chats, ~{workload_['system_words']}-word system prompts, {report['model']}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2), a checkpoint folder or .gguf")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--chats-per-tenant", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=300, help="length of each tenant's system prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=160,
        help="each replica's KV pool: room for some tenants' prefixes, not all",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--data-dir", default=str(ROOT / ".tokenmill"), help="where converted weights are cached")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", default=str(RESULTS))
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    import ray
    from ray import serve

    from app.gateway.wiring import prepare_store
    from app.scaleout.ray_serve import build_application
    from app.settings import Settings
    from engine.config import EngineConfig

    admin_key = "sk-admin-bench-" + secrets.token_urlsafe(24)
    settings = Settings(
        port=args.port,
        data_dir=args.data_dir,
        database_url=fresh_database(args.database_url),
        admin_key=admin_key,
        min_replicas=args.replicas,
        max_replicas=args.replicas,
        engine=EngineConfig(
            model=args.model,
            dtype=args.dtype,
            num_kv_blocks=args.num_kv_blocks,
            num_threads=args.threads,
            max_num_seqs=max(args.concurrency, 2),
            data_dir=args.data_dir,
        ),
    )
    prepare_store(settings)
    chats = workload(args.tenants, args.chats_per_tenant, args.system_words)
    base_url = f"http://127.0.0.1:{args.port}"
    runs: dict[str, dict] = {}
    ray.init(num_cpus=args.replicas + 1, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        key = model = None
        for router in args.routers.split(","):
            serve.run(build_application(settings, router=router), name="tokenmill", route_prefix="/")
            if key is None:
                key = create_key(base_url, admin_key)
                models = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
                model = models["data"][0]["id"]
            records, wall_s = asyncio.run(run_chats(base_url, key, model, chats, args.concurrency, args.max_tokens))
            runs[router] = summarise(records, wall_s)
            print(
                f"{router:>12}: hit rate {runs[router]['prefix_cache_hit_rate']:.1%}, "
                f"{runs[router]['requests_per_s']:.2f} req/s, {runs[router]['output_tokens_per_s']:.1f} out tok/s, "
                f"mean latency {runs[router]['latency_s']['mean']:.2f} s, "
                f"requests per replica {runs[router]['requests_per_replica']}",
                flush=True,
            )
            serve.delete("tokenmill")  # the next mode starts on fresh replicas, with cold caches
    finally:
        serve.shutdown()
        ray.shutdown()

    report = {
        "model": model,
        "dtype": args.dtype,
        "replicas": args.replicas,
        "threads_per_replica": args.threads,
        "num_kv_blocks_per_replica": args.num_kv_blocks,
        "concurrency": args.concurrency,
        "workload": {
            "tenants": args.tenants,
            "chats_per_tenant": args.chats_per_tenant,
            "system_words": args.system_words,
            "max_tokens": args.max_tokens,
            "chats": len(chats),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "runs": runs,
    }
    if set(ROUTERS) <= set(runs):
        report["prefix_over_round_robin"] = {
            metric: round(runs["prefix"][metric] / runs["round-robin"][metric], 3)
            if runs["round-robin"][metric]
            else None
            for metric in ("prefix_cache_hit_rate", "requests_per_s", "output_tokens_per_s")
        }
        print("prefix-aware / round-robin:", report["prefix_over_round_robin"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "scale_bench.png")
    print(f"wrote {out / 'scale_bench.json'} and {out / 'scale_bench.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
