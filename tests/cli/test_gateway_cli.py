"""`tokenmill teams|keys|usage` against the same database the server uses, on both back ends."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from app.cli.main import main
from tests.support.gateway import bearer, build_app, chat_body, usage_rows


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_teams_keys_and_usage_from_the_command_line(database_url, make_gateway, capsys):
    db = ("--database-url", database_url)
    assert run(capsys, "teams", "create", "research", "--rpm", "100", "--models", "fake-model", *db)[0] == 0
    code, _, err = run(capsys, "teams", "create", "research", *db)
    assert code == 1 and "exists" in err
    code, out, _ = run(capsys, "teams", "list", *db)
    assert "research" in out and "fake-model" in out and "100" in out

    code, out, err = run(capsys, "keys", "create", "--team", "research", "--name", "notebook", *db)
    key = out.strip()
    assert code == 0 and key.startswith("sk-") and "shown once" in err and key not in err
    code, out, _ = run(capsys, "keys", "list", "--team", "research", *db)
    assert key[:11] in out and key not in out

    gateway = make_gateway(key_cache_ttl_s=0.2)
    with TestClient(build_app(gateway)) as client:
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=4), headers=bearer(key)).status_code == 200
        gateway.writer.flush()
        today = time.strftime("%Y-%m-%d", time.gmtime())
        code, out, _ = run(capsys, "usage", "--team", "research", "--since", today, "--csv", *db)
        assert code == 0
        header, row = out.strip().splitlines()
        assert header.startswith("day,requests") and row.startswith(f"{today},1,0,")
        code, out, _ = run(capsys, "usage", "--since", today, "--group-by", "team,model", *db)
        assert "research" in out and "fake-model" in out

        code, out, _ = run(capsys, "keys", "revoke", key[:11], *db)
        assert code == 0 and "revoked" in out
        time.sleep(0.3)  # a CLI revoke reaches a running server within its key-cache TTL
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key)).status_code == 401
    code, out, _ = run(capsys, "keys", "list", *db)
    assert key[:11] not in out
    assert key[:11] in run(capsys, "keys", "list", "--all", *db)[1]


def test_unknown_team_is_an_error_not_a_traceback(database_url, capsys):
    code, _, err = run(capsys, "keys", "create", "--team", "nobody", "--database-url", database_url)
    assert code == 1 and "no team named 'nobody'" in err


def test_keys_rotate_prints_the_new_secret_once_and_the_old_stops_after_its_grace(database_url, make_gateway, capsys):
    db = ("--database-url", database_url)
    run(capsys, "teams", "create", "research", *db)
    old = run(capsys, "keys", "create", "--team", "research", *db)[1].strip()
    key_id = next(line.split()[0] for line in run(capsys, "keys", "list", *db)[1].splitlines() if old[:11] in line)
    gateway = make_gateway(key_cache_ttl_s=0.2)
    with TestClient(build_app(gateway)) as client:
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(old)).status_code == 200
        code, out, err = run(capsys, "keys", "rotate", key_id, "--grace", "1h", *db)
        new = out.strip()
        assert code == 0 and new.startswith("sk-") and new != old and "shown once" in err and new not in err
        assert old[:11] in err and "works until" in err
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(old)).status_code == 200
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(new)).status_code == 200

        newest = run(capsys, "keys", "rotate", new[:11], "--grace", "0", *db)[1].strip()
        time.sleep(0.3)  # a CLI change reaches a running server within its key-cache TTL
        for ended in (old, new):
            refused = client.post("/v1/chat/completions", json=chat_body(), headers=bearer(ended))
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(newest)).status_code == 200
    assert {row.key_id for row in usage_rows(gateway)} == {int(key_id)}

    for bad in ("soon", "-1h", "31d"):
        code, _, err = run(capsys, "keys", "rotate", key_id, f"--grace={bad}", *db)
        assert code == 1 and ("grace" in err or "duration" in err), err
    code, _, err = run(capsys, "keys", "rotate", "999", *db)
    assert code == 1 and "no key matches" in err


def test_cli_changes_are_audited_as_the_cli_user(database_url, make_gateway, capsys):
    import getpass

    from sqlalchemy import select

    from app.tables import AuditEntry

    db = ("--database-url", database_url)
    run(capsys, "teams", "create", "research", *db)
    key = run(capsys, "keys", "create", "--team", "research", *db)[1].strip()
    run(capsys, "keys", "rotate", key[:11], *db)
    run(capsys, "keys", "revoke", "1", *db)
    gateway = make_gateway()
    with gateway.sessions() as session:
        rows = list(session.scalars(select(AuditEntry).where(AuditEntry.actor_kind == "cli").order_by(AuditEntry.id)))
    assert [r.action for r in rows] == ["team.create", "key.create", "key.rotate", "key.revoke"]
    assert {r.actor_id for r in rows} == {getpass.getuser()}
    assert key not in repr([(r.before, r.after) for r in rows])
