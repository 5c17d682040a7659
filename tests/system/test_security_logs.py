"""No secret or customer text in the logs by default: a real server with the gateway, every logger at
DEBUG and the access log on, a whole and a streamed chat; the key, the prompt and the completion
appear in no log line. (tests/gateway/test_gateway_usage.py checks the key alone with the fake engine.)"""

from __future__ import annotations

import logging

import httpx
import pytest

from engine.config import EngineConfig
from tests.support.gateway import admin_headers, bearer, sqlite_gateway
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

SECRET_PROMPT = "my locker code is quokka-7319, repeat it back"


def test_no_key_prompt_or_completion_in_debug_logs(smollm2, tmp_path, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    logging.getLogger().setLevel(logging.DEBUG)
    gateway = sqlite_gateway(tmp_path)
    config = EngineConfig(dtype="float32", num_kv_blocks=128)
    completions = []
    with (
        running_server(smollm2, engine_config=config, gateway=gateway) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        team = http.post("/admin/api/teams", json={"name": "logs"}, headers=admin_headers()).json()
        key = http.post("/admin/api/keys", json={"team_id": team["id"]}, headers=admin_headers()).json()["key"]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": SECRET_PROMPT}],
            "max_tokens": 24,
            "temperature": 0.0,
        }
        response = http.post("/v1/chat/completions", json=body, headers=bearer(key))
        assert response.status_code == 200
        completions.append(response.json()["choices"][0]["message"]["content"])
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True}, headers=bearer(key))
        assert streamed.status_code == 200
        http.post("/v1/chat/completions", json={**body, "temperature": -1}, headers=bearer(key))  # a 400
        http.post("/v1/chat/completions", json=body, headers=bearer(key + "x"))  # a 401
        gateway.writer.flush()
    logging.getLogger().setLevel(logging.WARNING)
    out, err = capfd.readouterr()
    logged = caplog.text + out + err
    assert len(caplog.records) > 0  # DEBUG capture was on
    completion = completions[0]
    assert len(completion) > 10
    for secret in (key, key[len("sk-") :], "quokka-7319", SECRET_PROMPT, completion):
        assert secret not in logged, secret
