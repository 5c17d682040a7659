"""`tokenmill serve`: the OpenAI-compatible server in this process, or on Ray Serve with --ray."""

from __future__ import annotations

import argparse
import os
import sys

from app.settings import Settings, SettingsError, add_arguments, environment_only_help, settings_from

# What loading a model that can't be run raises: a missing file, an unsupported architecture or tensor
# type (engine.models.llama.UnsupportedModel, engine.gguf_file.UnsupportedTensorType: ValueErrors), a file
# that isn't a checkpoint.
MODEL_ERRORS = (ValueError, OSError)

# How long an idle keep-alive connection stays open. uvicorn's default, 5 s, is also httpx's pool expiry
# (the openai client's): a client reusing a connection idle for ~5 s races the server's close and gets
# "Server disconnected without sending a response". Ray Serve's proxy keeps them 90 s; so does serve.
IDLE_CONNECTION_TIMEOUT_S = 90


def load_settings(args: argparse.Namespace) -> Settings:
    try:
        return settings_from(vars(args), os.environ)
    except SettingsError as error:
        print(f"tokenmill: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.cli.ray import apply_replica_count, serve_on_ray
    from app.gateway.admin_identity import deliver_admin_key
    from app.gateway.wiring import prepare_store
    from app.scaleout.replica_app import build_server

    apply_replica_count(args)
    settings = load_settings(args)
    try:
        store = prepare_store(settings)  # the one migration of this start; before the model loads: a bad key fails fast
    except ValueError as error:
        print(f"tokenmill: {error}", file=sys.stderr)
        return 2
    if store.configured_key:
        print(f"tokenmill: {store.configured_key}", flush=True)
    if args.ray:
        return serve_on_ray(settings, args, store)
    try:
        app, engine = build_server(settings, migrated=True)
    except MODEL_ERRORS as error:  # a model it can't run: one line saying why, not a traceback
        print(f"tokenmill: can't serve {settings.engine.model}: {error}", file=sys.stderr)
        return 2
    try:
        print(f"tokenmill: serving {engine.model_name} at {settings.base_url}", flush=True)
        if store.created_admin_key:
            deliver_admin_key(store.created_admin_key, settings.data_dir)
        # proxy_headers=False: uvicorn would believe X-Forwarded-For from 127.0.0.1; the app itself trusts
        # only --forwarded-allow-ips.
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=IDLE_CONNECTION_TIMEOUT_S,
            proxy_headers=False,
        )
    finally:
        engine.shutdown()
    return 0


def serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.epilog = environment_only_help()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    from app.cli.ray import add_ray_arguments

    add_ray_arguments(parser)
