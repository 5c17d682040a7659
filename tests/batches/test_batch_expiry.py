"""File expiry through the official client: a batch's output_expires_after and an upload's expires_after
set the files' expires_at; past it a file is 404 everywhere and the periodic sweep deletes its row and
bytes; policies outside OpenAI's bounds are clear 400s."""

from __future__ import annotations

import io
import time
from datetime import timedelta

import openai
import pytest
from sqlalchemy import select

import app.batches.files
from app.gateway.crud import utcnow
from app.tables import StoredFile
from tests.support.batches import download, jsonl, line, serving, submit, team_client, wait_for


def stored_ids(gateway) -> set[str]:
    with gateway.sessions() as session:
        return set(session.scalars(select(StoredFile.id)))


def test_batch_outputs_expire_as_output_expires_after_says_and_the_sweep_deletes_them(
    make_gateway, tmp_path, monkeypatch
):
    gateway = make_gateway()
    with serving(gateway, tmp_path, files_sweep_interval_s=0.05) as http:
        client = team_client(http)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("a"), b"{broken"]))), purpose="batch")
        created = client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 3600},
        )
        batch = wait_for(client, created.id)
        output = client.files.retrieve(batch.output_file_id)
        assert output.expires_at == output.created_at + 3600
        assert client.files.retrieve(batch.error_file_id).expires_at is not None
        assert uploaded.expires_at is None
        assert [o["custom_id"] for o in download(client, batch.output_file_id)] == ["a"]

        an_hour_later = utcnow() + timedelta(seconds=3601)
        monkeypatch.setattr(app.batches.files, "utcnow", lambda: an_hour_later)
        for gone in (
            lambda: client.files.retrieve(batch.output_file_id),
            lambda: client.files.content(batch.output_file_id),
            lambda: client.files.delete(batch.error_file_id),
        ):
            with pytest.raises(openai.NotFoundError):
                gone()
        assert [f.id for f in client.files.list()] == [uploaded.id]
        deadline = time.monotonic() + 10
        while stored_ids(gateway) != {uploaded.id}:
            assert time.monotonic() < deadline, "the sweep never deleted the expired files"
            time.sleep(0.05)
        files_dir = tmp_path / "files"
        assert not (files_dir / batch.output_file_id).exists() and not (files_dir / batch.error_file_id).exists()
        assert client.files.content(uploaded.id).content  # the input, with no expiry, stays


def test_an_upload_expires_as_its_expires_after_says(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        client = team_client(http)
        note = client.files.create(
            file=("notes.txt", io.BytesIO(b"hello")),
            purpose="user_data",
            expires_after={"anchor": "created_at", "seconds": 7200},
        )
        assert note.expires_at == note.created_at + 7200
        assert client.files.retrieve(note.id).expires_at == note.expires_at


def test_expiry_policies_outside_openais_bounds_are_400s(make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        client = team_client(http)
        with pytest.raises(openai.BadRequestError, match="expires_after.seconds"):
            client.files.create(
                file=("a.jsonl", io.BytesIO(jsonl([line("a")]))),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 60},
            )
        uploaded = client.files.create(file=("a.jsonl", io.BytesIO(jsonl([line("a")]))), purpose="batch")
        for policy in (
            {"anchor": "created_at", "seconds": 31 * 24 * 3600},
            {"anchor": "last_active_at", "seconds": 3600},
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                client.batches.create(
                    input_file_id=uploaded.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                    output_expires_after=policy,  # type: ignore[arg-type]
                )
            assert refused.value.body["param"].startswith("output_expires_after")  # type: ignore[index]
        assert submit(client, [line("b")]).status in ("validating", "in_progress")
