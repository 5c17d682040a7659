"""Every dashboard page, detail pages included, answers on a server started as the README starts it:
`tokenmill serve` with no flags but the data folder, so the embedded chat model and the embedded
embedding model (which has no engine) are both loaded, and the admin key is the one written on first start."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from app.cli.main import main
from tests.support import MODEL_CACHE
from tests.support.dashboard import login_token, page_csrf, shown_key
from tests.support.gateway import uvicorn_in_thread

pytestmark = pytest.mark.real_model


def open_every_page(url: str, admin_key: str) -> dict[str, int]:
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=60) as http:
        login = http.get("/admin/login")
        signed_in = http.post(
            "/admin/login", data={"admin_key": admin_key, "csrf_token": login_token(login.text), "next": "/admin"}
        )
        assert signed_in.status_code in (200, 303), signed_in.text
        csrf = page_csrf(http.get("/admin/teams").text)
        created = http.post("/admin/teams", data={"csrf_token": csrf, "name": "alpha", "budget_period": "month"})
        team_id = re.search(r"/admin/teams/(\d+)", created.headers["location"]).group(1)
        key_page = http.post(
            "/admin/keys", data={"csrf_token": csrf, "team_id": team_id, "name": "k", "budget_period": "month"}
        )
        key = shown_key(key_page.text)
        chat = http.post(
            "/v1/chat/completions",
            json={"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert chat.status_code == 200, chat.text
        key_id = re.search(r'href="/admin/keys/(\d+)"', http.get(f"/admin/teams/{team_id}").text).group(1)
        pages = [
            "/admin",
            "/admin/teams",
            f"/admin/teams/{team_id}",
            f"/admin/teams/{team_id}?revoked=true",
            "/admin/keys",
            f"/admin/keys/{key_id}",
            "/admin/models",
            "/admin/usage",
            "/admin/usage.csv",
            "/admin/data/usage",
            "/admin/data/live",
            "/admin/batches",
            "/admin/audit",
            "/admin/audit.csv",
            "/admin/playground",
        ]
        for page in pages:
            statuses[page] = http.get(page).status_code
    return statuses


def test_every_dashboard_page_opens_on_a_server_with_the_readme_defaults(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (MODEL_CACHE / "models").mkdir(parents=True, exist_ok=True)
    (data_dir / "models").symlink_to(MODEL_CACHE / "models")  # converted weights: the first start's work, shared
    for variable in ("TOKENMILL_ADMIN_KEY", "TOKENMILL_DATABASE_URL", "TOKENMILL_REDIS_URL"):
        monkeypatch.delenv(variable, raising=False)

    def probe(url: str) -> dict[str, int]:
        admin_key = (Path(data_dir) / "admin-key").read_text().strip()
        return open_every_page(url, admin_key)

    results = uvicorn_in_thread(monkeypatch, probe)
    assert main(["serve", "--data-dir", str(data_dir), "--log-level", "warning"]) == 0
    assert results and all(status == 200 for status in results[0].values()), results
