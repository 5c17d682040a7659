"""The API tests' server: the real engine over the embedded model behind the real routes, one per module,
and the openai client on it. A module that needs other settings defines its own `server`; `client` then
follows it."""

from __future__ import annotations

import pytest

from tests.support.server import running_server


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.client()
