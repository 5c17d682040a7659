"""The README's commands are the ones the code takes: every `tokenmill ...` command in it (in a code block
or inline) parses with the real command line, every flag it names exists, every Python block compiles,
and every YAML / TOML block parses. What each command does is the business of the tests of that command
(tests/cli/, tests/api/test_first_request.py, tests/dashboard/test_dashboard_sso.py's README example ...);
this keeps the README from drifting away from them."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from app.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^ *```(\w+)\n(.*?)^ *```", re.M | re.S)
PLACEHOLDERS = {"NAME": "demo", "ID": "1", "KEY": "sk-chosen", "T": "0.5", "...": "x"}


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README) if lang == language]


def tokenmill_commands() -> list[str]:
    """`tokenmill ...` as written: shell lines (continuations joined, comments and `&&` chains split) and
    inline code spans. `load a | disable a` is the README's shorthand for several commands."""
    commands = []
    shell = "\n".join(blocks("bash")).replace("\\\n", " ")
    inline = re.findall(r"`([^`\n]*tokenmill [^`\n]*)`", BLOCK.sub("", README))
    for line in [*shell.splitlines(), *inline]:
        line = line.split(" # ")[0].split("   #")[0]
        for part in re.split(r"&&|;", line):
            words = part.split()
            while words and re.fullmatch(r"\w+=\S*", words[0]):
                words.pop(0)  # TOKENMILL_API_KEY=sk-... tokenmill ...
            if not words or not (words[0] == "tokenmill" or words[0].endswith("/bin/tokenmill")):
                continue
            first, *others = " ".join(words[1:]).split("|")
            commands.append(f"tokenmill {first.strip()}")
            for other in others:  # `models load a | disable a`: the shorthand keeps the first's command group
                commands.append(f"tokenmill {first.split()[0]} {other.strip()}")
    return commands


COMMANDS = tokenmill_commands()


def test_the_readme_names_tokenmill_commands():
    assert {command.split()[1] for command in COMMANDS} >= {"serve", "teams", "keys", "usage", "models"}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_tokenmill_command_in_the_readme_parses(command):
    words = [PLACEHOLDERS.get(word, word) for word in shlex.split(command)[1:]]
    try:
        build_parser().parse_args(words)
    except SystemExit as exit:
        if exit.code == 0:  # --help
            return
        pytest.fail(f"`{command}` does not parse (exit {exit.code})")


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_each_python_block_compiles(index):
    compile(blocks("python")[index], f"README.md python block {index}", "exec")


def test_each_yaml_and_toml_block_parses():
    assert blocks("yaml") and blocks("toml")
    for body in blocks("yaml"):
        yaml.safe_load(body)
    for body in blocks("toml"):
        tomllib.loads(body)
