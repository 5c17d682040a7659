"""The app's shutdown stops every part even when one part's stop never returns: it waits a bounded time,
names the part in the log and goes on, where it used to hang the process until something killed it."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.main import lifespan_of


class Part:
    def __init__(self, name: str, stopped: list[str]) -> None:
        self.name, self.stopped = name, stopped

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped.append(self.name)


class StuckPart(Part):
    async def stop(self) -> None:
        await asyncio.Event().wait()  # never set


def test_a_stop_that_never_returns_does_not_hold_the_shutdown(caplog):
    stopped: list[str] = []
    parts = [Part("gateway", stopped), StuckPart("batch runner", stopped), Part("sampler", stopped)]
    app = FastAPI()
    app.router.lifespan_context = lifespan_of(
        [(part.start, part.stop) for part in parts], app.router.lifespan_context, stop_timeout_s=0.5
    )
    began = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="tokenmill.app"), TestClient(app):
        pass
    assert time.monotonic() - began < 10
    assert stopped == ["sampler", "gateway"]  # in the reverse order, the one after the stuck one included
    assert "StuckPart.stop did not finish in 0.5s" in caplog.text


def test_an_error_in_a_stop_is_not_taken_for_its_deadline():
    class FailingPart(Part):
        async def stop(self) -> None:
            raise TimeoutError("the database did not answer")

    stopped: list[str] = []
    parts = [Part("gateway", stopped), FailingPart("pool", stopped)]
    app = FastAPI()
    app.router.lifespan_context = lifespan_of([(part.start, part.stop) for part in parts], app.router.lifespan_context)
    with pytest.raises(TimeoutError, match="did not answer"):  # the stop's own error, not swallowed
        with TestClient(app):
            pass
    assert stopped == ["gateway"]
