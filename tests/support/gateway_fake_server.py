"""A server process like `tokenmill serve`, with the fake engine: for the SIGTERM test and the bench.

    python -m tests.support.gateway_fake_server PORT [TOKEN_DELAY_S] [GRACEFUL_SHUTDOWN_S]

The gateway's settings from the environment (TOKENMILL_DATABASE_URL, TOKENMILL_ADMIN_KEY, ...).
"""

from __future__ import annotations

import os
import sys

import uvicorn

from app.gateway.config import GatewayConfig
from app.gateway.service import TeamGateway
from app.main import create_app
from app.settings import Settings, settings_from
from tests.support.gateway import FakeEngine


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


if __name__ == "__main__":
    main()
