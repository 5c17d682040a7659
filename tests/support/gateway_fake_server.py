"""A server process like `tokenmill serve`, with the fake engine: for the SIGTERM test and the bench.

    python -m tests.support.gateway_fake_server PORT [TOKEN_DELAY_S] [GRACEFUL_SHUTDOWN_S]

The gateway's settings from the environment (TOKENMILL_DATABASE_URL, TOKENMILL_ADMIN_KEY, ...). A test
starts one with `start`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvicorn

from app.gateway.config import GatewayConfig
from app.gateway.service import TeamGateway
from app.main import create_app
from app.settings import Settings, settings_from
from tests.support import ROOT
from tests.support.gateway import ADMIN_KEY, FakeEngine, admin_headers, free_port


def main() -> None:
    port = int(sys.argv[1])
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    grace = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    app = create_app(
        Settings(),
        FakeEngine(token_delay_s=delay),
        gateway=TeamGateway(GatewayConfig.from_settings(settings_from({}, os.environ))),
    )
    uvicorn.run(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=grace, proxy_headers=False
    )  # as `tokenmill serve` runs it


def start(database_url: str, data_dir: Path, *args: str, **environ: str) -> tuple[subprocess.Popen, str]:
    """This server in a child process on a free port, `args` after the port; the gateway on `database_url`
    with the tests' admin key, its data in `data_dir`, no Redis, `environ` more of its environment. It logs
    to data_dir/server-PORT.log. (process, URL) once it answers; if it does not start, its log is raised."""
    port = free_port()
    env = {
        **os.environ,
        "TOKENMILL_DATABASE_URL": database_url,
        "TOKENMILL_ADMIN_KEY": ADMIN_KEY,
        "TOKENMILL_DATA_DIR": str(data_dir),
        **environ,
    }
    env.pop("TOKENMILL_REDIS_URL", None)
    log_path = data_dir / f"server-{port}.log"
    with open(log_path, "w") as log:  # the child writes to it until it exits
        command = [sys.executable, "-m", "tests.support.gateway_fake_server", str(port), *args]
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/admin/api/teams", headers=admin_headers(), timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("server did not start:\n" + log_path.read_text())


if __name__ == "__main__":
    main()
