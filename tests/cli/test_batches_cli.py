"""`tokenmill batches list|show|cancel` against the database a running server uses."""

from __future__ import annotations

import json

from app.cli.main import main
from tests.support.batches import line, serving, submit, team_client, wait_for
from tests.support.gateway import FakeEngine


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_an_operator_lists_shows_and_cancels_a_running_batch(database_url, make_gateway, tmp_path, capsys):
    db = ("--database-url", database_url)
    with serving(make_gateway(), tmp_path, FakeEngine(token_delay_s=0.02), batch_max_in_flight=1) as http:
        client = team_client(http, "research")
        created = submit(client, [line(f"r{i}", max_tokens=5) for i in range(20)])
        wait_for(client, created.id, until=lambda b: b.request_counts.completed >= 1)
        code, out, _ = run(capsys, "batches", "list", "--team", "research", *db)
        assert code == 0 and created.id in out and "research" in out and "/20" in out
        code, out, _ = run(capsys, "batches", "cancel", created.id, *db)
        assert code == 0 and "cancelling" in out
        batch = wait_for(client, created.id)  # the server sees a cancel made elsewhere
        assert batch.status == "cancelled" and batch.request_counts.completed < 20
    code, out, _ = run(capsys, "batches", "show", created.id, *db)
    assert code == 0 and json.loads(out)["status"] == "cancelled"
    code, _, err = run(capsys, "batches", "cancel", created.id, *db)
    assert code == 0
    code, _, err = run(capsys, "batches", "show", "batch_nope", *db)
    assert code == 1 and "no batch" in err
