"""`tokenmill` command line. A subcommand is a `Command` in COMMANDS: a name, its flags and what it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import app.offline  # before anything imports huggingface_hub or transformers
import app.openmp  # noqa: F401 - before anything imports torch
from app.cli import admin, batches, models
from app.cli.serve import serve, serve_arguments


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: list[Command] = [
    Command("serve", "run the OpenAI-compatible server", serve_arguments, serve),
]
COMMANDS += [Command(*spec) for spec in admin.commands()]  # teams, keys, usage
COMMANDS += [Command(*spec) for spec in models.commands()]
COMMANDS += [Command(*spec) for spec in batches.commands()]


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
    run: Callable[[argparse.Namespace], int] = args.run  # every command's parser sets it
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
