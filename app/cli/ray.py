"""`tokenmill serve --ray` (and deploy/ray_serve.py): run tokenmill as Ray Serve replicas behind one HTTP
ingress (app/scaleout/ray_serve.py says how). Imports Ray only when it runs, so `tokenmill` works without the extra.

    tokenmill serve --ray --replicas 2 --database-url postgresql+psycopg://... --redis-url redis://...
    tokenmill serve --ray --min-replicas 1 --max-replicas 4 --ray-address auto   # join a running cluster

Every `tokenmill serve` flag applies to each replica (and each has its TOKENMILL_* variable). Replicas
share state only through the database and Redis, so both should be set: without them every replica
keeps its own SQLite file and its own rate-limit counters. SIGTERM or Ctrl-C drains (requests in flight
finish, new ones get 503 shutting_down), then the replicas flush their usage and stop.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TYPE_CHECKING

from app.settings import Settings

if TYPE_CHECKING:
    from app.gateway.wiring import PreparedStore


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas on Ray Serve (needs the `ray` extra)")
    group.add_argument("--ray", action="store_true", help="run replicas on Ray Serve behind one ingress")
    group.add_argument(
        "--replicas", type=int, help="a fixed number of replicas (sets --min-replicas and --max-replicas)"
    )
    group.add_argument(
        "--router",
        default="prefix",
        choices=("prefix", "round-robin"),
        help="prefix-aware routing (default) or replicas in turn",
    )
    group.add_argument(
        "--routing-epsilon",
        type=float,
        default=0.25,
        help="prefix-aware routing's load bound: no replica runs more than (1 + this) x the mean requests in flight",
    )
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    group.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")


def apply_replica_count(args: argparse.Namespace) -> None:
    if getattr(args, "replicas", None) is not None:
        args.min_replicas = args.max_replicas = args.replicas


def serve_on_ray(settings: Settings, args: argparse.Namespace, store: PreparedStore) -> int:
    """`store`: the database was migrated once, by `tokenmill serve` (app.gateway.wiring.prepare_store); the
    replicas don't migrate."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("tokenmill: --ray needs Ray Serve: pip install 'tokenmill[ray]'", file=sys.stderr)
        return 2

    from app.gateway.admin_identity import deliver_admin_key
    from app.scaleout.ray_serve import build_application, drain_and_shutdown

    if store.created_admin_key:
        deliver_admin_key(store.created_admin_key, settings.data_dir)

    ray.init(address=args.ray_address, include_dashboard=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(
        build_application(settings, router=args.router, replica_cpus=args.replica_cpus, epsilon=args.routing_epsilon),
        name="tokenmill",
        route_prefix="/",
    )
    print(
        f"tokenmill: serving at {settings.base_url} on Ray Serve ({settings.min_replicas}..{settings.max_replicas}"
        f" replicas, {args.router} routing)",
        flush=True,
    )

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    print("tokenmill: draining (new requests get 503 shutting_down)", flush=True)
    cut_short = drain_and_shutdown("tokenmill")
    if cut_short:
        print(f"tokenmill: {cut_short} requests were still running after the drain timeout", flush=True)
    ray.shutdown()
    return 0
