"""`tokenmill serve` as a user runs it: a real process on a port, found through its printed URL, with a
key made by `tokenmill keys create` against the same database."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from app.cli.main import main
from app.registry.loading import embedded_defaults
from bench.servers import ROOT, free_port, serve_command
from tests.support.server import MODEL

pytestmark = pytest.mark.real_model


def wait_for_models(client: openai.OpenAI, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.models.list()
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def model_status(port: int, name: str, key: str) -> str:
    card = httpx.get(f"http://127.0.0.1:{port}/v1/models/{name}", headers={"Authorization": f"Bearer {key}"})
    status: str = card.json()["status"]
    return status


def test_serve_prints_its_url_and_answers_the_openai_client(smollm2, tmp_path, capsys):
    database = ("--database-url", f"sqlite:///{tmp_path / 'tokenmill.db'}")
    assert main(["teams", "create", "cli-team", *database]) == 0
    assert main(["keys", "create", "--team", "cli-team", *database]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    port = free_port()
    configured_key = "sk-chosen-by-the-operator-0123456789"
    data_dir = smollm2.folder.parents[1]  # where the converted weights are cached already
    process = subprocess.Popen(
        serve_command(port, data_dir, "--num-kv-blocks", "128", *database, "--api-key", configured_key),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        said = process.stdout.readline()
        assert "--api-key added as a key of team 'default'" in said and configured_key not in said
        assert f"serving {MODEL} at http://127.0.0.1:{port}/v1" in process.stdout.readline()
        said = process.stdout.readline()  # first start on this database: where the new admin key is
        assert "admin key" in said and "sk-admin-" not in said
        Path(re.search(r"it is in (\S+) \(", said).group(1)).unlink()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        # --model, and the embedded embedding model registered beside it on first start; that one loads when a
        # request first names it, not at start
        embedded = [spec["name"] for spec in embedded_defaults()]
        assert [model.id for model in wait_for_models(client)] == [MODEL, *embedded]
        for name in embedded:
            assert model_status(port, name, key) == "unloaded"
            with pytest.raises(
                openai.BadRequestError, match="is a model of kind embedding"
            ):  # another kind's request: no load
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
            assert model_status(port, name, key) == "unloaded"
            assert len(client.embeddings.create(model=name, input="Hi").data[0].embedding) == 384
            assert model_status(port, name, key) == "loaded"
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert reply.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-nope", max_retries=0).models.list()
        # The --api-key works like any key made by the CLI, and is metered under team "default".
        chosen = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=configured_key, max_retries=0)
        assert (
            chosen.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            ).usage.completion_tokens
            >= 1
        )
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    assert main(["keys", "list", "--team", "default", *database]) == 0
    assert "--api-key" in capsys.readouterr().out  # stored as a key of its own (hashed, like the rest)


def test_a_weak_api_key_is_refused_before_the_model_loads(tmp_path, capsys):
    database = ("--database-url", f"sqlite:///{tmp_path / 'tokenmill.db'}")
    started = time.monotonic()
    assert main(["serve", "--api-key", "short", "--data-dir", str(tmp_path), *database]) == 2
    assert "--api-key must be at least 16 characters" in capsys.readouterr().err
    assert time.monotonic() - started < 10  # refused up front, not after a model load


def test_a_model_of_an_unsupported_architecture_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2", "max_position_embeddings": 512}')
    (folder / "model.safetensors").write_bytes(b"")
    database = ("--database-url", f"sqlite:///{tmp_path / 'tokenmill.db'}")
    assert main(["serve", "--model", str(folder), "--data-dir", str(tmp_path), *database]) == 2
    error = capsys.readouterr().err.strip()
    assert "Traceback" not in error and len(error.splitlines()) == 1
    assert "'gpt2' is not supported" in error and "gemma3_text" in error and "qwen3_moe" in error
