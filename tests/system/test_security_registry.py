"""The registry reads only what an operator could mean by a model: regular files of sane size and
depth, outside the registry lock and within a time limit. A crafted or broken source is a 400 that says
what is wrong; it never hangs, never eats memory and never answers 500."""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import pytest
from fastapi.testclient import TestClient

from tests.support.gateway import admin_headers, build_app

LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


@pytest.fixture
def database_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


@pytest.fixture
def client(make_gateway):
    with TestClient(build_app(make_gateway())) as client:
        yield client


def checkpoint(folder, config: dict | None = LLAMA_CONFIG):
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def register(client, name: str, path, timeout: float = 10.0):
    """POST /admin/api/models in a thread: a hang fails the test instead of freezing it."""
    answer = []
    thread = threading.Thread(
        target=lambda: answer.append(
            client.post("/admin/api/models", json={"name": name, "path": str(path)}, headers=admin_headers())
        ),
        daemon=True,
    )
    thread.start()
    thread.join(timeout)
    assert answer, f"registering {path} did not answer within {timeout}s"
    return answer[0]


def assert_refused(response, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "path"
    for word in words:
        assert word in error["message"]


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def test_a_gguf_with_deeply_nested_arrays_is_a_400_not_a_500(client, tmp_path):
    depth = 5000
    nested = b"".join(struct.pack("<IQ", 9, 1) for _ in range(depth)) + struct.pack("<IQ", 4, 0)
    body = (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 2)
        + gguf_string("general.architecture")
        + struct.pack("<I", 8)
        + gguf_string("llama")
        + gguf_string("llama.nested")
        + struct.pack("<I", 9)
        + nested
    )
    (tmp_path / "deep.gguf").write_bytes(body)
    assert_refused(register(client, "deep", tmp_path / "deep.gguf"), "nested")


def test_a_fifo_as_config_json_is_refused_at_once(client, tmp_path):
    folder = checkpoint(tmp_path / "fifo", config=None)
    os.mkfifo(folder / "config.json")
    try:
        assert_refused(register(client, "fifo", folder), "not a regular file")
    finally:  # on a server that blocked on it, let its reader go
        try:
            os.close(os.open(folder / "config.json", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_a_config_json_linked_to_dev_zero_is_refused_at_once(client, tmp_path):
    folder = checkpoint(tmp_path / "zero", config=None)
    os.symlink("/dev/zero", folder / "config.json")
    started = time.monotonic()
    assert_refused(register(client, "zero", folder, timeout=20), "not a regular file")
    assert time.monotonic() - started < 5


def test_an_oversized_config_json_is_refused(client, tmp_path):
    folder = checkpoint(tmp_path / "big", config={**LLAMA_CONFIG, "padding": "x" * (5 * 2**20)})
    assert_refused(register(client, "big", folder), "larger than")


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_position_embeddings", -1),
        ("max_position_embeddings", 0),
        ("hidden_size", "64"),
        ("num_hidden_layers", 10**12),
        ("num_attention_heads", True),
    ],
)
def test_nonsense_shapes_are_a_400_naming_the_field(client, tmp_path, field, value):
    folder = checkpoint(tmp_path / "shape", config={**LLAMA_CONFIG, field: value})
    response = register(client, "shape", folder)
    assert_refused(response, field)
    assert client.get("/admin/api/models/shape", headers=admin_headers()).status_code == 404


def test_a_sane_checkpoint_still_registers(client, tmp_path):
    response = register(client, "sane", checkpoint(tmp_path / "sane"))
    assert response.status_code == 201, response.text
    assert response.json()["max_model_len"] == 2048


def test_a_slow_source_holds_up_no_other_change_and_times_out(client, tmp_path, monkeypatch):
    """Inspection runs outside the registry lock: while one path takes its time, other models change."""
    import app.registry.pool as pool_module

    assert register(client, "other", checkpoint(tmp_path / "other")).status_code == 201
    real_inspect = pool_module.inspect_source
    release = threading.Event()

    def slow_inspect(kind, source):
        if source.endswith("slow"):
            release.wait(10)
        return real_inspect(kind, source)

    monkeypatch.setattr(pool_module, "inspect_source", slow_inspect)
    client.app.state.context.models.inspect_timeout_s = 1.0
    slow = []
    thread = threading.Thread(target=lambda: slow.append(register(client, "slow", checkpoint(tmp_path / "slow"))))
    thread.start()
    try:
        time.sleep(0.2)
        changed = client.patch("/admin/api/models/other", json={"aliases": ["other-alias"]}, headers=admin_headers())
        assert changed.status_code == 200 and not slow  # while the slow one is still being read
        thread.join(10)
        assert slow[0].status_code == 400
        assert slow[0].json()["error"]["code"] == "model_source_timeout"
    finally:
        release.set()
        thread.join(10)


def test_a_gguf_linked_to_another_file_does_not_echo_its_bytes(client, tmp_path):
    secret = tmp_path / "shadow"
    secret.write_bytes(b"rootpw:S3cr3tHash1234567890\n")
    (tmp_path / "model.gguf").symlink_to(secret)
    response = register(client, "linked", tmp_path / "model.gguf")
    assert_refused(response, "GGUF")
    message = response.json()["error"]["message"]
    assert "b'root'" not in message and "1396340592" not in message, message  # the first 8 bytes
