"""`tokenmill models add|update|list|load|unload|enable|disable|remove`, against the running server's admin API.

Loading and unloading are things a running process does to its own memory, so these commands talk to
the server (TOKENMILL_URL or --url, with the admin key), not to the database: the change takes effect
at once, a registration is checked by the same code and on the same machine that will load the
weights, and aliases and prices apply to the next request. Registrations persist in the database.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from app.registry.spec import DEFAULT_SOURCE

TIMEOUT_S = 600.0  # a first load of a GGUF converts it
DEFAULT_HELP = (
    "a sampling default for requests that leave the field out, e.g. temperature=0.2 or "
    "max_tokens=512 (temperature, top_p, top_k, min_p, repetition/presence/frequency_penalty, "
    "max_tokens; repeat for more)"
)


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=None, help="the server [env TOKENMILL_URL; default http://TOKENMILL_HOST:TOKENMILL_PORT]"
    )
    parser.add_argument("--admin-key", default=None, help="[env TOKENMILL_ADMIN_KEY]")


def _base_url(args: argparse.Namespace) -> str:
    if args.url or os.environ.get("TOKENMILL_URL"):
        return (args.url or os.environ["TOKENMILL_URL"]).rstrip("/")
    host = os.environ.get("TOKENMILL_HOST") or "127.0.0.1"
    return f"http://{host}:{os.environ.get('TOKENMILL_PORT') or 8000}"


def _call(args: argparse.Namespace, method: str, path: str, **kwargs: Any) -> dict[str, Any] | None:
    """The JSON answer, or None after printing the server's error (or why it could not be reached)."""
    key = args.admin_key or os.environ.get("TOKENMILL_ADMIN_KEY")
    if not key:
        print("tokenmill: the admin key is needed: --admin-key or TOKENMILL_ADMIN_KEY", file=sys.stderr)
        return None
    url = f"{_base_url(args)}/admin/api{path}"
    try:
        response = httpx.request(method, url, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S, **kwargs)
    except httpx.HTTPError as error:
        print(f"tokenmill: cannot reach the server at {_base_url(args)}: {error}", file=sys.stderr)
        return None
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    if response.status_code >= 400:
        message = (body.get("error") or {}).get("message") or response.text
        print(f"tokenmill: {message}", file=sys.stderr)
        return None
    return body


COLUMNS = ["name", "kind", "state", "aliases", "price_in_out_per_1m", "defaults", "path"]


def _print_models(models: list[dict[str, Any]]) -> None:
    from app.cli.admin import _table

    rows = [
        {
            **model,
            "state": f"{model['state']} (loads on first use)"
            if model["state"] == "unloaded" and model.get("loads_on_first_use")
            else model["state"],
            "aliases": ",".join(model["aliases"]),
            "price_in_out_per_1m": ""
            if model.get("price") is None
            else f"${model['price']['input_per_1m']:g} / ${model['price']['output_per_1m']:g}",
            "defaults": " ".join(f"{name}={value:g}" for name, value in model.get("sampling_defaults", {}).items()),
        }
        for model in models
    ]
    _table(rows, COLUMNS)


def models_list(args: argparse.Namespace) -> int:
    body = _call(args, "GET", "/models")
    if body is None:
        return 1
    _print_models(body["data"])
    return 0


def models_add(args: argparse.Namespace) -> int:
    path = args.path if args.path == DEFAULT_SOURCE else str(Path(args.path).expanduser().resolve())
    fields = {
        "name": args.name,
        "path": path,
        "kind": args.kind,
        "aliases": args.alias or [],
        "load": args.load,
        "enabled": not args.disabled,
    }
    for field, value in (
        ("price_input_per_1m", args.price_in),
        ("price_cached_input_per_1m", args.price_cached_in),
        ("price_output_per_1m", args.price_out),
        ("dtype", args.dtype),
        ("max_model_len", args.max_model_len),
        ("adapter_of", args.adapter_of),
    ):
        if value is not None:
            fields[field] = value
    if args.engine_setting:
        fields["engine_settings"] = dict(_setting(text) for text in args.engine_setting)
    if args.default:
        fields["sampling_defaults"] = _sampling_defaults(args.default)
    body = _call(args, "POST", "/models", json=fields)
    if body is None:
        return 1
    _print_models([body])
    return 0


def models_update(args: argparse.Namespace) -> int:
    if not args.default:
        print("tokenmill: nothing to change: give --default NAME=VALUE", file=sys.stderr)
        return 2
    body = _call(args, "PATCH", f"/models/{args.name}", json={"sampling_defaults": _sampling_defaults(args.default)})
    if body is None:
        return 1
    _print_models([body])
    return 0


def _sampling_defaults(texts: list[str]) -> dict[str, object]:
    """NAME=VALUE pairs; NAME=none drops that default (the server checks names and values)."""
    pairs = dict(_setting(text) for text in texts)
    return {name: None if value in ("none", "") else value for name, value in pairs.items()}


def _setting(text: str) -> tuple[str, object]:
    """name=value, the value read as JSON when it parses (numbers, true/false), else a string."""
    import json

    name, _, value = text.partition("=")
    try:
        return name.strip(), json.loads(value)
    except ValueError:
        return name.strip(), value


def _action(method: str, suffix: str = "", **json_body: Any) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        params = {"wait": "true"} if getattr(args, "wait", False) else None
        body = _call(
            args, method, f"/models/{args.name}{suffix}", params=params, **({"json": json_body} if json_body else {})
        )
        if body is None:
            return 1
        if body.get("deleted"):
            print(f"removed {args.name}")
        else:
            _print_models([body])
        return 0

    return run


def _models_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = sub.add_parser("add", help="register a model (checked: path, architecture)")
    add.add_argument("name")
    add.add_argument("--path", required=True, help="a safetensors folder, a .gguf file, or 'default'")
    add.add_argument("--kind", choices=("chat", "embedding"), default="chat")
    add.add_argument(
        "--adapter-of",
        default=None,
        metavar="BASE",
        help="--path is a PEFT LoRA adapter folder for this loaded chat model (served in its batches)",
    )
    add.add_argument("--alias", action="append", help="another name clients may use (repeat for more)")
    add.add_argument("--price-in", type=float, default=None, help="USD per 1M input tokens")
    add.add_argument("--price-cached-in", type=float, default=None, help="USD per 1M cached input tokens")
    add.add_argument("--price-out", type=float, default=None, help="USD per 1M output tokens")
    add.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    add.add_argument("--max-model-len", type=int, default=None)
    add.add_argument(
        "--engine-setting",
        action="append",
        metavar="NAME=VALUE",
        help="e.g. num_kv_blocks=256 or max_num_seqs=16 (repeat for more)",
    )
    add.add_argument("--default", action="append", metavar="NAME=VALUE", help=DEFAULT_HELP)
    add.add_argument("--disabled", action="store_true", help="register it disabled")
    add.add_argument("--load", action="store_true", help="load it now")
    add.set_defaults(run=models_add)
    update = sub.add_parser("update", help="change a model's sampling defaults (they apply to the next request)")
    update.add_argument("name")
    update.add_argument("--default", action="append", metavar="NAME=VALUE", help=DEFAULT_HELP + "; NAME=none drops one")
    update.set_defaults(run=models_update)
    listing = sub.add_parser("list", help="registered models and their state on the server")
    listing.set_defaults(run=models_list)
    for name, help_text, run in (
        ("load", "load a model on the server", _action("POST", "/load")),
        ("unload", "unload a model (requests in flight finish first)", _action("POST", "/unload")),
        ("enable", "let a model be loaded and served", _action("PATCH", enabled=True)),
        ("disable", "stop serving a model (it is unloaded)", _action("PATCH", enabled=False)),
        ("remove", "unload and delete a registration", _action("DELETE")),
    ):
        action = sub.add_parser(name, help=help_text)
        action.add_argument("name")
        if name == "unload":
            action.add_argument("--wait", action="store_true", help="return once it is unloaded")
        action.set_defaults(run=run)
    for action in sub.choices.values():
        _server_arguments(action)


def _dispatch(args: argparse.Namespace) -> int:
    run: Callable[[argparse.Namespace], int] = args.run  # set by set_defaults above
    return run(args)


def commands() -> list[tuple[Any, ...]]:
    """(name, help, add_arguments, run) for app.cli.main's COMMANDS."""
    return [("models", "register, list, load and unload models (on the running server)", _models_arguments, _dispatch)]
