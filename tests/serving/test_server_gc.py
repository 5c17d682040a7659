"""The start-up heap (modules, models, tokenizers) is frozen while the app serves, so a full garbage
collection doesn't walk it with every request in flight waiting."""

from __future__ import annotations

import gc
import time

from fastapi.testclient import TestClient

from tests.support.gateway import FakeEngine, chat_body


def test_the_startup_heap_is_out_of_the_collectors_way_while_serving():
    from app.main import create_app
    from app.settings import Settings

    gc.unfreeze()
    with TestClient(create_app(Settings(), FakeEngine())) as client:
        assert gc.get_freeze_count() > 10_000
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        started = time.perf_counter()
        gc.collect()
        full_collection_s = time.perf_counter() - started
    assert gc.get_freeze_count() == 0  # thawed with the app
    started = time.perf_counter()
    gc.collect()
    assert full_collection_s < time.perf_counter() - started
