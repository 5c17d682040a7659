"""Replicas on Ray Serve with shared system prompts: prefix-cache hit rate, throughput and balance with
prefix-aware routing against round-robin, over several seeds in one run (app/scaleout/ray_serve.py).

Several tenants each send chats that start with their own long system prompt, interleaved. Each replica's
KV pool holds only some of the tenants' prefixes: prefix-aware routing keeps a tenant on one replica, so
its prefix stays cached there; round-robin sends every tenant to every replica, where prefixes evict each
other. A seed draws the tenants' system prompts and the order of their chats, and so where each tenant's
prompt hashes to (one lucky assignment once made a router look better than it was). Each mode has its own
replicas, deployed once; for each seed both modes run at once, side by side, with the same requests in the
same order, so that a shared machine whose load comes and goes slows both alike (run one after the other,
other jobs' bursts swung single throughputs by 30%). Throughput is each mode's requests finished per second
while both were running (until the first one finished); hit rate and balance count every request. A seed's
system prompts share at most their opening block with another seed's, so each seed starts as cold as on
fresh replicas.
The hit rate is cached prompt tokens over prompt tokens, from the responses' usage. The defaults (10 tenants
x 4 chats a seed, 8 tokens each; once 12 x 6 and 16) keep 5 seeds within 15 minutes on a loaded 2-core machine.

    python bench/scale_bench.py              # SmolLM2, 2 replicas a mode, 5 seeds x 10 tenants x 4 chats
    python bench/scale_bench.py --seeds 1 --tenants 4 --chats-per-tenant 3 --max-tokens 4     # a quick look
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
ROUTE_PREFIXES = {"prefix": "/", "round-robin": "/round-robin"}
# What issue #23 asks of prefix-aware routing against round-robin, on every seed.
TARGETS = {"hit_rate_ratio": 1.3, "throughput_ratio": 1.15, "max_over_min_requests": 1.5}
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
                "finished_at": time.perf_counter(),
            }

    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers={"Authorization": f"Bearer {key}"}) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return records, started, time.perf_counter()


async def side_by_side(urls: dict[str, str], key: str, model: str, chats: list, concurrency: int, max_tokens: int):
    """Every mode's run_chats at once: {mode: (records, started, ended)}."""
    runs = await asyncio.gather(*(run_chats(url, key, model, chats, concurrency, max_tokens) for url in urls.values()))
    return dict(zip(urls, runs, strict=True))


def summarise(records: list[dict], started: float, ended: float, window_end: float, replicas: int) -> dict:
    """`window_end`: when the first of the modes running side by side finished."""
    wall_s = ended - started
    window_s = window_end - started
    finished_in_window = sum(1 for r in records if r["finished_at"] <= window_end)
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
        "requests_per_s": round(len(records) / wall_s, 3),  # to its own end: the other mode may have stopped
        "requests_per_s_side_by_side": round(finished_in_window / window_s, 3),
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
        # a replica that answered nothing counts as 0: the ratio is then infinite (None in JSON)
        "max_over_min_requests": round(max(per_replica.values()) / min(per_replica.values()), 3)
        if len(per_replica) == replicas
        else None,
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

    seeds = report["seeds"]
    labels = [str(seed["seed"]) for seed in seeds]
    x = np.arange(len(seeds))
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [
        ("prefix_cache_hit_rate", "prefix-cache hit rate", None),
        ("requests_per_s_side_by_side", "requests / s (side by side)", None),
        ("max_over_min_requests", "max / min requests per replica", TARGETS["max_over_min_requests"]),
    ]
    for axis, (metric, title, limit) in zip(axes, panels, strict=True):
        for offset, (router, color) in zip(
            (-0.2, 0.2), zip(ROUTERS, ("tab:green", "tab:gray"), strict=True), strict=True
        ):
            values = [seed["runs"][router][metric] or 0.0 for seed in seeds]
            axis.bar(x + offset, values, width=0.4, color=color, label=router)
        if limit:
            axis.axhline(limit, color="tab:red", linestyle="--", linewidth=1, label=f"target <= {limit}")
        axis.set_xticks(x, labels)
        axis.set_xlabel("seed")
        axis.set_title(title)
    axes[0].legend(loc="lower right")
    axes[2].legend(loc="upper right")
    workload_ = report["workload"]
    medians = report["medians"]
    figure.suptitle(
        f"{report['replicas']} replicas, {workload_['tenants']} tenants x {workload_['chats_per_tenant']} chats, "
        f"~{workload_['system_words']}-word system prompts, {report['model']}: prefix-aware / round-robin, "
        f"median hit rate {medians['hit_rate_ratio']:.2f}x, throughput {medians['throughput_ratio']:.2f}x"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def compare(runs: dict) -> dict:
    prefix, round_robin = runs["prefix"], runs["round-robin"]
    return {
        "hit_rate_ratio": round(prefix["prefix_cache_hit_rate"] / round_robin["prefix_cache_hit_rate"], 3)
        if round_robin["prefix_cache_hit_rate"]
        else None,
        "throughput_ratio": round(
            prefix["requests_per_s_side_by_side"] / round_robin["requests_per_s_side_by_side"], 3
        ),
        "max_over_min_requests": prefix["max_over_min_requests"],
    }


def meets_targets(ratios: dict) -> bool:
    return (
        (ratios["hit_rate_ratio"] or 0) >= TARGETS["hit_rate_ratio"]
        and ratios["throughput_ratio"] >= TARGETS["throughput_ratio"]
        and ratios["max_over_min_requests"] is not None
        and ratios["max_over_min_requests"] <= TARGETS["max_over_min_requests"]
    )


def table(seeds: list[dict]) -> str:
    lines = [
        f"{'seed':>4} {'router':>12} {'hit rate':>9} {'req/s':>7} {'max/min':>8} {'per replica':>12}"
        f" | {'hit x':>6} {'tput x':>6} {'ok':>3}"
    ]
    for seed in seeds:
        for router in ROUTERS:
            run = seed["runs"][router]
            ratio = run["max_over_min_requests"]
            line = (
                f"{seed['seed']:>4} {router:>12} {run['prefix_cache_hit_rate']:>9.1%} {run['requests_per_s_side_by_side']:>7.3f}"
                f" {ratio if ratio is not None else float('inf'):>8.2f} {str(run['requests_per_replica']):>12}"
            )
            if router == "prefix":
                c = seed["prefix_over_round_robin"]
                line += f" | {c['hit_rate_ratio'] or 0:>6.2f} {c['throughput_ratio']:>6.2f} {'yes' if seed['meets_targets'] else 'NO':>3}"
            lines.append(line)
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2), a checkpoint folder or .gguf")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated: each draws tenants and chat order")
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--chats-per-tenant", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300, help="length of each tenant's system prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=160,
        help="each replica's KV pool: room for some tenants' prefixes, not all",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
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
    seeds = [int(seed) for seed in args.seeds.split(",")]
    base_url = f"http://127.0.0.1:{args.port}"
    results: list[dict] = []
    # Both modes stay deployed side by side (each app its own replicas, started once: a minute on a
    # loaded machine) and run each seed at once.
    ray.init(num_cpus=2 * args.replicas + 2, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for router in ROUTERS:
            serve.run(build_application(settings, router=router), name=router, route_prefix=ROUTE_PREFIXES[router])
        key = create_key(base_url, admin_key)
        models = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
        model = models["data"][0]["id"]
        print(f"replicas ready ({time.perf_counter() - started:.0f} s)", flush=True)
        for seed in seeds:
            chats = workload(args.tenants, args.chats_per_tenant, args.system_words, seed)
            urls = {router: base_url + ROUTE_PREFIXES[router].rstrip("/") for router in ROUTERS}
            raw = asyncio.run(side_by_side(urls, key, model, chats, args.concurrency, args.max_tokens))
            window_end = min(ended for _, _, ended in raw.values())
            runs = {
                router: summarise(records, started_at, ended, window_end, args.replicas)
                for router, (records, started_at, ended) in raw.items()
            }
            ratios = compare(runs)
            results.append(
                {
                    "seed": seed,
                    "runs": {router: runs[router] for router in ROUTERS},
                    "prefix_over_round_robin": ratios,
                    "meets_targets": meets_targets(ratios),
                }
            )
            print(table(results[-1:]).split("\n", 1)[1], f"({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()

    medians = {
        metric: round(float(np.median([seed["prefix_over_round_robin"][metric] or 0.0 for seed in results])), 3)
        for metric in ("hit_rate_ratio", "throughput_ratio")
    }
    for router in ROUTERS:
        for metric in ("prefix_cache_hit_rate", "requests_per_s_side_by_side"):
            medians[f"{router}_{metric}"] = round(
                float(np.median([seed["runs"][router][metric] for seed in results])), 4
            )
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
            "chats_per_seed": args.tenants * args.chats_per_tenant,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_end": [round(load, 2) for load in os.getloadavg()],
        },
        "wall_s": round(time.perf_counter() - started, 1),
        "targets": TARGETS,
        "seeds": results,
        "medians": medians,
        "every_seed_meets_targets": all(seed["meets_targets"] for seed in results),
    }
    print(table(results))
    print("medians:", medians, "| every seed meets the targets:", report["every_seed_meets_targets"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "scale_bench.png")
    print(f"wrote {out / 'scale_bench.json'} and {out / 'scale_bench.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
