"""`tokenmill serve` killed with SIGKILL in the middle of a batch, started again on the same database and
data folder: the batch completes with every line answered exactly once, and the second server bills
exactly the lines it ran. The tiny random Llama keeps it to seconds; the claim is about the runner."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from sqlalchemy import create_engine, func, select

from app.tables import BatchLine, UsageRow
from tests.support.batches import download, submit, wait_for
from tests.support.gateway import ADMIN_KEY, admin_headers, free_port

ROOT = Path(__file__).resolve().parents[2]
LINES = 60
MAX_TOKENS = 24
IN_FLIGHT = 4


def serve(model_dir: Path, database_url: str, data_dir: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "app.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--database-url", database_url, "--data-dir", str(data_dir), "--admin-key", ADMIN_KEY]
    command += ["--dtype", "float32", "--quantization", "none", "--num-kv-blocks", "256", "--log-level", "warning"]
    command += ["--batch-max-in-flight", str(IN_FLIGHT), "--batch-lease-s", "2"]
    log = open(data_dir / f"server-{port}.log", "w")  # the child writes to it
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 90
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/admin/api/teams", headers=admin_headers(), timeout=1).is_success:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start:\n" + (data_dir / f"server-{port}.log").read_text())


def counted(database_url: str) -> tuple[int, int]:
    """(batch lines recorded, batch usage rows billed as ok)."""
    engine = create_engine(database_url)
    with engine.connect() as c:
        lines = c.execute(select(func.count()).select_from(BatchLine)).scalar_one()
        rows = c.execute(
            select(func.count()).select_from(UsageRow).where(UsageRow.batch.is_(True), UsageRow.status == "ok")
        ).scalar_one()
    engine.dispose()
    return lines, rows


def test_a_batch_survives_sigkill_of_the_server_with_each_line_answered_once(tiny_llama_dir, tmp_path):
    database_url = f"sqlite:///{tmp_path / 'tokenmill.db'}"
    port = free_port()
    process = serve(tiny_llama_dir, database_url, tmp_path, port)
    try:
        url = f"http://127.0.0.1:{port}"
        team = httpx.post(f"{url}/admin/api/teams", json={"name": "nightly"}, headers=admin_headers()).json()
        key = httpx.post(f"{url}/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()["key"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        model = client.models.list().data[0].id
        body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        lines = [
            {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"n {i}"}}
            for i in range(LINES)
        ]
        created = submit(client, lines, endpoint="/v1/completions")
        wait_for(client, created.id, until=lambda b: b.request_counts.completed >= 10, timeout=60)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    lines_at_kill, billed_at_kill = counted(database_url)
    assert 10 <= lines_at_kill < LINES  # killed mid-batch
    # A usage row is written apart from its line's record, so SIGKILL can catch one without the other: rows
    # still in the usage writer's buffer are lost, and a row may be in while its line's record is not
    # (at most the lines in flight; that line runs, and is billed, again).
    assert billed_at_kill <= lines_at_kill + IN_FLIGHT

    port = free_port()
    process = serve(tiny_llama_dir, database_url, tmp_path, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        batch = wait_for(client, created.id, timeout=90)
        outputs = download(client, batch.output_file_id)
        deadline = time.monotonic() + 10
        while counted(database_url)[1] < billed_at_kill + LINES - lines_at_kill and time.monotonic() < deadline:
            time.sleep(0.1)  # the last rows are on their way to the database
        time.sleep(0.3)
        lines_recorded, billed = counted(database_url)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        LINES,
        LINES,
        0,
    )
    assert batch.error_file_id is None
    custom_ids = [output["custom_id"] for output in outputs]
    assert sorted(custom_ids) == sorted(f"line-{i}" for i in range(LINES))  # none lost, none twice
    assert all(output["response"]["body"]["usage"]["completion_tokens"] == MAX_TOKENS for output in outputs)
    assert lines_recorded == LINES
    assert billed - billed_at_kill == LINES - lines_at_kill  # the second server billed the lines it ran, once
