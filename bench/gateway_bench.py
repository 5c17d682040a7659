"""Gateway overhead: what auth + limits + budgets + usage metering add to a request.

The engine is replaced by an instant fake (here only), so what is left is the HTTP server, the routes
and the gateway. Each configuration runs a server process and 50 concurrent clients against it:

    none        no gateway (no auth, no metering): the baseline
    sqlite      the gateway on a SQLite file, counters in process
    postgresql  the gateway on PostgreSQL, counters in process
    pg+redis    the gateway on PostgreSQL, counters in Redis

Reported per configuration: requests/s, client latency p50/p99, the time spent inside the gateway's
hooks per request (authenticate + admit + request_finished) p50/p99, and usage rows expected vs
written after a SIGTERM shutdown (zero lost is the target). Target: 500 req/s, p99 overhead < 10 ms.

    python bench/gateway_bench.py [--requests 6000] [--concurrency 50] [--configs none,sqlite,postgresql,pg+redis]
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PG_SERVER = os.environ.get("TOKENMILL_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TOKENMILL_BENCH_REDIS", "redis://127.0.0.1:6379/0")
ADMIN_KEY = "sk-admin-bench-" + "b" * 24
TEAMS, KEYS_PER_TEAM = 10, 10


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the server process ----

def serve(port: int, mode: str, database_url: str, redis_url: str, timings_path: str) -> None:
    import uvicorn

    from app.main import create_app
    from app.settings import Settings
    from tests.gateway_support import FakeEngine

    gateway = None
    if mode != "none":
        from app.gateway.config import GatewayConfig
        from app.gateway.service import Gateway

        gateway = Gateway(GatewayConfig(database_url=database_url, admin_key=ADMIN_KEY,
                                        redis_url=redis_url or None, redis_prefix=f"tokenmill-bench:{os.getpid()}:",
                                        spill_dir=str(Path(timings_path).parent)))
        spent: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("spent", default=None)
        totals: list[float] = []

        def timed_async(method):  # noqa: ANN001, ANN202
            async def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                holder = spent.get()
                if holder is None:
                    holder = [0.0]
                    spent.set(holder)
                start = time.perf_counter()
                try:
                    return await method(*args, **kwargs)
                finally:
                    holder[0] += time.perf_counter() - start
            return wrapper

        def timed_finish(method):  # noqa: ANN001, ANN202
            def wrapper(record):  # noqa: ANN001, ANN202
                start = time.perf_counter()
                try:
                    return method(record)
                finally:
                    holder = spent.get()
                    totals.append((holder[0] if holder else 0.0) + time.perf_counter() - start)
            return wrapper

        gateway.authenticate = timed_async(gateway.authenticate)
        gateway.admit = timed_async(gateway.admit)
        gateway.request_finished = timed_finish(gateway.request_finished)
        stop = gateway.stop

        def stop_and_report() -> None:
            stop()
            Path(timings_path).write_text(json.dumps({"gateway_s": totals, "rows_written": gateway.writer.rows_written,
                                                      "rows_spilled": gateway.writer.rows_spilled}))
        gateway.stop = stop_and_report
    app = create_app(Settings(), FakeEngine(), gateway=gateway)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=30)


# ---- the client side ----

async def setup_keys(url: str) -> list[str]:
    import httpx

    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    keys = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        for t in range(TEAMS):
            team = (await client.post("/admin/api/teams", json={
                "name": f"team-{t}", "rpm_limit": 1_000_000, "tpm_limit": 100_000_000, "max_budget_usd": 1000.0,
                "budget_period": "month"})).json()
            for k in range(KEYS_PER_TEAM):
                key = (await client.post("/admin/api/keys", json={
                    "team_id": team["id"], "name": f"key-{k}", "rpm_limit": 1_000_000,
                    "tpm_limit": 100_000_000})).json()
                keys.append(key["key"])
    return keys


async def load(url: str, keys: list[str], total: int, concurrency: int) -> tuple[list[float], float, int]:
    import httpx

    body = {"model": "fake-model", "messages": [{"role": "user", "content": "say hello world"}], "max_tokens": 16}
    latencies: list[float] = []
    failures = 0
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failures
        for i in counter:
            headers = {"Authorization": f"Bearer {keys[i % len(keys)]}"} if keys else {}
            start = time.perf_counter()
            try:
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
            except httpx.HTTPError:
                failures += 1
                continue
            latencies.append(time.perf_counter() - start)
            if response.status_code != 200:
                failures += 1

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return latencies, elapsed, failures


def run_config(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    from sqlalchemy import create_engine, func, select, text

    from tests.gateway_support import free_port

    database_url, pg_name = "", None
    if mode == "sqlite":
        database_url = f"sqlite:///{workdir / 'bench.db'}"
    elif mode in ("postgresql", "pg+redis"):
        pg_name = f"tokenmill_bench_{os.getpid()}"
        admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)'))
            c.execute(text(f'CREATE DATABASE "{pg_name}"'))
        database_url = PG_SERVER.rsplit("/", 1)[0] + "/" + pg_name
    port = free_port()
    timings = workdir / f"timings-{mode}.json"
    server_log = open(workdir / f"server-{mode}.log", "w")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), mode, database_url,
         REDIS_URL if mode == "pg+redis" else "", str(timings)], cwd=ROOT, stdout=server_log,
        stderr=subprocess.STDOUT)
    server_log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_up(url, process)
        except RuntimeError:
            print((workdir / f"server-{mode}.log").read_text(), file=sys.stderr)
            raise
        keys = asyncio.run(setup_keys(url)) if mode != "none" else []
        _, _, warmup_failures = asyncio.run(load(url, keys, args.warmup, args.concurrency))
        latencies, elapsed, failures = asyncio.run(load(url, keys, args.requests, args.concurrency))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    result = {"config": mode, "requests": args.requests, "concurrency": args.concurrency, "failures": failures,
              "req_per_s": args.requests / elapsed, "p50_ms": percentile(latencies, 0.5) * 1000,
              "p99_ms": percentile(latencies, 0.99) * 1000, "mean_ms": statistics.fmean(latencies) * 1000}
    if mode != "none":
        server = json.loads(timings.read_text())
        hooks = server["gateway_s"][args.warmup:]  # the measured run, after the warm-up
        result.update(gateway_p50_ms=percentile(hooks, 0.5) * 1000, gateway_p99_ms=percentile(hooks, 0.99) * 1000)
        engine = create_engine(database_url)
        from app.gateway.models import UsageRow

        with engine.connect() as c:
            rows = c.scalar(select(func.count()).select_from(UsageRow))
        engine.dispose()
        answered = args.warmup + args.requests - warmup_failures - failures  # each 200 must have its row
        result.update(rows_expected=answered, rows_written=rows,
                      rows_lost=max(0, answered - rows - server["rows_spilled"]))
    if pg_name:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)'))
        admin.dispose()
    return result


def wait_until_up(url: str, process: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the bench server exited")
        try:
            httpx.get(url + "/v1/models", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError("the bench server did not start")


def print_table(results: list[dict]) -> None:
    base = next((r for r in results if r["config"] == "none"), None)
    head = f"{'config':<11}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'+p50':>8}{'+p99':>8}{'gw p50':>9}{'gw p99':>9}" \
           f"{'rows':>9}{'lost':>6}{'fail':>6}"
    print(head)
    print("-" * len(head))
    for r in results:
        added50 = r["p50_ms"] - base["p50_ms"] if base and r is not base else float("nan")
        added99 = r["p99_ms"] - base["p99_ms"] if base and r is not base else float("nan")
        print(f"{r['config']:<11}{r['req_per_s']:>8.0f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{added50:>8.2f}"
              f"{added99:>8.2f}{r.get('gateway_p50_ms', float('nan')):>9.3f}{r.get('gateway_p99_ms', float('nan')):>9.3f}"
              f"{r.get('rows_written', 0):>9}{r.get('rows_lost', 0):>6}{r['failures']:>6}")
    print("+p50/+p99: client latency over the no-gateway baseline (same run); gw: time inside the gateway's hooks")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--configs", default="none,sqlite,postgresql,pg+redis")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway_bench.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for mode in args.configs.split(","):
            results.append(run_config(mode, args, Path(workdir)))
            print(f"{mode}: {results[-1]['req_per_s']:.0f} req/s", file=sys.stderr)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "bench": "gateway_overhead", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "note": "engine replaced by an instant fake; clients and server share the machine",
        "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
