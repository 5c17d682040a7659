"""Cache refreshes off the request path: a blocking round (one query for everything due) runs on the
event loop's executor, at most one at a time. A round that fails changes nothing: the cache's own
expiry rule decides what happens next (read on use, or the last known value while the store is away)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tokenmill.gateway.refresh")


class RefreshRounds:
    def __init__(self, refresh_due: Callable[[], int], what: str) -> None:
        self.refresh_due = refresh_due
        self.what = what
        self.running = False
        self.rounds = 0

    def soon(self) -> None:
        """Start a round unless one is running; outside an event loop, do nothing."""
        if self.running:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.running = True
        loop.run_in_executor(None, self._round).add_done_callback(self._done)

    def _round(self) -> None:
        try:
            if self.refresh_due():
                self.rounds += 1
        except Exception as error:  # the store is away: entries expire by their own rule
            log.debug("%s refresh failed: %s", self.what, type(error).__name__)

    def _done(self, _future: asyncio.Future[Any]) -> None:
        self.running = False
