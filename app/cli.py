"""`tokenmill` command line. A subcommand is a `Command` in COMMANDS: a name, its flags and what it runs."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import app.offline  # noqa: F401  (before anything imports huggingface_hub or transformers)

# Before torch loads: idle OpenMP workers sleep instead of spinning, so they don't starve the event loop
# and the engine thread on small machines (set OMP_WAIT_POLICY=ACTIVE to override on a dedicated box).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from app.settings import Settings, SettingsError, add_arguments, settings_from


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def load_settings(args: argparse.Namespace) -> Settings:
    try:
        return settings_from(vars(args), os.environ)
    except SettingsError as error:
        print(f"tokenmill: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.gateway.wiring import provision_configured_key
    from app.gateway_hooks import provision_admin_key
    from app.ray_cli import apply_replica_count, serve_on_ray
    from app.replica_app import build_server

    apply_replica_count(args)
    settings = load_settings(args)
    try:
        configured = provision_configured_key(settings)  # before the model loads: a bad key fails fast
    except ValueError as error:
        print(f"tokenmill: {error}", file=sys.stderr)
        return 2
    if configured:
        print(f"tokenmill: {configured}", flush=True)
    if args.ray:
        return serve_on_ray(settings, args)
    app, engine = build_server(settings)
    try:
        print(f"tokenmill: serving {engine.model_name} at {settings.base_url}", flush=True)
        admin_key = settings.admin_key or provision_admin_key(settings)
        if admin_key and not settings.admin_key:
            print(f"tokenmill: admin key (shown once, keep it): {admin_key}", flush=True)
        # proxy_headers=False: uvicorn would believe X-Forwarded-For from 127.0.0.1; the app itself trusts
        # only --forwarded-allow-ips.
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5, proxy_headers=False)
    finally:
        engine.shutdown()
    return 0


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    from app.ray_cli import add_ray_arguments

    add_ray_arguments(parser)


COMMANDS: list[Command] = [
    Command("serve", "run the OpenAI-compatible server", _serve_arguments, serve),
]


def _gateway_commands() -> list[Command]:
    from app.gateway.cli_commands import commands

    return [Command(*spec) for spec in commands()]


COMMANDS += _gateway_commands()  # teams, keys, usage


def _registry_commands() -> list[Command]:
    from app.registry.cli_commands import commands

    return [Command(*spec) for spec in commands()]


COMMANDS += _registry_commands()  # models


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="Self-hosted OpenAI-compatible server.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subcommands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
