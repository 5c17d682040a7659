"""Run tokenmill as Ray Serve replicas behind one HTTP ingress (app/ray_serve.py says how it works).

    python deploy/ray_serve.py --replicas 2 --database-url postgresql+psycopg://... --redis-url redis://...
    python deploy/ray_serve.py --min-replicas 1 --max-replicas 4 --address auto   # join a running cluster

Every `tokenmill serve` flag applies to each replica (and each has its TOKENMILL_* variable). Replicas
share state only through the database and Redis, so both should be set: without them every replica
keeps its own SQLite file and its own rate-limit counters. SIGTERM or Ctrl-C drains the replicas
(requests in flight finish, usage is flushed) and shuts Serve down.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `tokenmill serve`: idle OpenMP threads sleep

from app.settings import SettingsError, add_arguments, settings_from


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deploy/ray_serve.py", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--replicas", type=int, help="a fixed number of replicas (sets --min-replicas and --max-replicas)")
    parser.add_argument("--router", default="prefix", choices=("prefix", "round-robin"),
                        help="prefix-aware routing (default) or replicas in turn")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replicas is not None:
        args.min_replicas = args.max_replicas = args.replicas
    try:
        settings = settings_from(vars(args), os.environ)
    except SettingsError as error:
        print(f"ray_serve: {error}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from app.gateway_hooks import provision_admin_key
    from app.ray_serve import build_application, drain_and_shutdown

    # Migrate once here, not in N replicas at the same time; create the admin key on first start.
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    admin_key = settings.admin_key or provision_admin_key(settings)
    if admin_key and not settings.admin_key:
        print(f"ray_serve: admin key (shown once, keep it): {admin_key}", flush=True)

    ray.init(address=args.address, include_dashboard=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    application = build_application(settings, router=args.router, replica_cpus=args.replica_cpus)
    serve.run(application, name="tokenmill", route_prefix="/")
    print(f"ray_serve: serving at {settings.base_url} ({settings.min_replicas}..{settings.max_replicas} replicas,"
          f" {args.router} routing)", flush=True)

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    print("ray_serve: draining (new requests get 503 shutting_down)", flush=True)
    cut_short = drain_and_shutdown("tokenmill")  # in-flight requests finish, then replicas flush usage and stop
    if cut_short:
        print(f"ray_serve: {cut_short} requests were still running after the drain timeout", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
