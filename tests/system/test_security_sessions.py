"""Secrets and sessions: a generated admin key goes to a file only the service user can read, never to
the output that logs keep; dashboard cookies can be forced Secure; a logout ends the session on every
replica, because open sessions live in the database."""

from __future__ import annotations

import io
import re
import stat

import httpx
import pytest
from fastapi.testclient import TestClient

from app.tables import AdminCredential
from tests.support.dashboard import login_token
from tests.support.gateway import ADMIN_KEY, build_app, serve_and_probe

SESSION_COOKIE = "tokenmill_admin"


@pytest.fixture
def database_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


def test_serve_writes_a_generated_admin_key_to_a_private_file_not_the_output(tmp_path, monkeypatch, capsys):
    data_dir = tmp_path / "data"
    (data_dir).mkdir()
    monkeypatch.chdir(tmp_path)

    def probe(url: str) -> int:
        key = (data_dir / "admin-key").read_text().strip()
        return httpx.get(url + "/admin/api/teams", headers={"Authorization": f"Bearer {key}"}).status_code

    def serve_here(*flags: str) -> int:
        return serve_and_probe(data_dir, monkeypatch, probe, *flags, admin_key=None)

    assert serve_here() == 200  # the key in the file is the admin key
    output = capsys.readouterr()
    key = (data_dir / "admin-key").read_text().strip()
    assert key.startswith("sk-admin-")
    assert key not in output.out and key not in output.err and "sk-admin-" not in output.out + output.err
    assert str((data_dir / "admin-key").resolve()) in output.out  # it says where
    assert stat.S_IMODE((data_dir / "admin-key").stat().st_mode) == 0o600


def test_only_a_terminal_is_shown_the_key_itself(tmp_path):
    from app.gateway.admin_identity import deliver_admin_key

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    log, terminal = io.StringIO(), Terminal()
    deliver_admin_key("sk-admin-to-a-log", tmp_path / "a", log)
    deliver_admin_key("sk-admin-to-a-tty", tmp_path / "b", terminal)
    assert "sk-admin-to-a-log" not in log.getvalue()
    assert "sk-admin-to-a-tty" in terminal.getvalue()


def test_a_key_file_left_readable_is_made_private_again(tmp_path):
    from app.gateway.admin_identity import deliver_admin_key

    (tmp_path / "admin-key").write_text("old")
    (tmp_path / "admin-key").chmod(0o644)
    deliver_admin_key("sk-admin-new", tmp_path, io.StringIO())
    assert stat.S_IMODE((tmp_path / "admin-key").stat().st_mode) == 0o600
    assert (tmp_path / "admin-key").read_text().strip() == "sk-admin-new"


def test_a_gateway_that_generates_the_key_writes_it_to_its_data_folder(make_gateway, tmp_path):
    said = io.StringIO()
    gateway = make_gateway(admin_key=None, start=False)
    gateway.announce = said
    gateway.start()
    key = (tmp_path / "spill" / "admin-key").read_text().strip()
    assert gateway.admin.matches(key) and key not in said.getvalue()
    with gateway.sessions() as session:
        assert session.query(AdminCredential).count() == 1


def log_in(client: TestClient):
    page = client.get("/admin/login")
    return client.post(
        "/admin/login",
        data={"admin_key": ADMIN_KEY, "csrf_token": login_token(page.text), "next": "/admin"},
        follow_redirects=False,
    )


def test_secure_cookies_are_forced_behind_a_tls_proxy(make_gateway):
    """The proxy speaks https to the browser and http to us: the cookies must say Secure all the same."""
    with TestClient(build_app(make_gateway(), secure_cookies=True), base_url="http://127.0.0.1") as client:
        page = client.get("/admin/login")
        assert "secure" in page.headers["set-cookie"].lower()
        login_cookie = re.match(r"tokenmill_login=([^;]+)", page.headers["set-cookie"]).group(1)
        client.cookies.clear()  # the browser sends it (over https); httpx would not over http
        login = client.post(
            "/admin/login",
            data={"admin_key": ADMIN_KEY, "csrf_token": login_token(page.text)},
            headers={"cookie": f"tokenmill_login={login_cookie}"},
            follow_redirects=False,
        )
        assert login.status_code == 303
        assert re.search(r"tokenmill_admin=[^;]+;.*[Ss]ecure", login.headers["set-cookie"])


def test_without_the_setting_plain_http_gets_no_secure_flag(make_gateway):
    with TestClient(build_app(make_gateway()), base_url="http://127.0.0.1") as client:
        login = log_in(client)
        assert "secure" not in login.headers["set-cookie"].lower()


def test_logout_on_one_replica_ends_the_session_on_every_replica(make_gateway):
    """Two replicas on one database (and one session secret, as replicas are run): a session opened on
    one works on the other, and a logout on either ends it on both."""
    replica_a = build_app(make_gateway(), session_secret="shared-secret")
    replica_b = build_app(make_gateway(), session_secret="shared-secret")
    with (
        TestClient(replica_a, base_url="http://127.0.0.1") as on_a,
        TestClient(replica_b, base_url="http://127.0.0.1") as on_b,
    ):
        assert log_in(on_a).status_code == 303
        cookie = on_a.cookies.get(SESSION_COOKIE)
        on_b.cookies.set(SESSION_COOKIE, cookie, path="/admin")
        assert on_b.get("/admin", follow_redirects=False).status_code == 200
        csrf = re.search(r'<meta name="csrf-token" content="([^"]*)"', on_a.get("/admin").text).group(1)
        assert on_a.post("/admin/logout", data={"csrf_token": csrf}, follow_redirects=False).status_code == 303
        ended = on_b.get("/admin", follow_redirects=False)
        assert ended.status_code == 303 and ended.headers["location"].startswith("/admin/login")
