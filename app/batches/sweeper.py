"""The file sweep: a background task of the app that deletes expired files (rows and bytes) every so often.
Until it comes round, an expired file is already absent to every route (files.FileStore)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.concurrency import run_in_threadpool

from app.batches.files import FileStore

log = logging.getLogger("tokenmill.batches")


class FileSweeper:
    def __init__(self, files: FileStore, every_s: float) -> None:
        self.files = files
        self.every_s = every_s
        self.task: asyncio.Task[Any] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.run_forever(), name="file-sweeper")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    async def run_forever(self) -> None:
        while True:
            try:
                swept = await run_in_threadpool(self.files.sweep_expired)
                if swept:
                    log.info("deleted %d expired files", swept)
            except asyncio.CancelledError:
                raise
            except Exception:  # a database hiccup: the next round tries again
                log.exception("file sweep failed")
            await asyncio.sleep(self.every_s)
