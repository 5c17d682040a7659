"""Start and stop a part of the app around the app's lifespan: what is wrapped last starts first."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI


def around_lifespan(app: FastAPI, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: FastAPI):
        await start()
        try:
            async with inner(app_) as state:
                yield state
        finally:
            await stop()

    app.router.lifespan_context = lifespan
