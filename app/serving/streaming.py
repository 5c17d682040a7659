"""Server-sent events: chunk encoding, the [DONE] terminator, errors after the headers went out, and
several engine streams merged into one."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi.responses import StreamingResponse

from app.errors import server_error
from app.serving.tracker import EngineFailure, RequestTracker, rejection_error
from engine.async_engine import EngineRejected

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("tokenmill.streaming")

SSE_DONE = "data: [DONE]\n\n"
Item = TypeVar("Item")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class TrackedStreamingResponse(StreamingResponse):
    """A stream that ends its request exactly once, however the response ends. The events' own finally
    reports the request when they run; but when the client is gone before the first byte, the events
    never start and their finally never runs, so the response finishes the tracker itself (a no-op
    when the events did) and closes the events, which aborts whatever they began in the engine."""

    def __init__(self, events: AsyncIterator[str], tracker: RequestTracker, **options: Any) -> None:
        super().__init__(events, **options)
        self.tracker = tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()
            finally:
                self.tracker.finish("aborted")


def sse_response(events: AsyncIterator[str], headers: dict[str, str], tracker: RequestTracker) -> StreamingResponse:
    return TrackedStreamingResponse(
        events,
        tracker,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
    )


async def finished_stream(
    tracker: RequestTracker, events: AsyncIterator[str], *, prompt_param: str, max_tokens_param: str
) -> AsyncIterator[str]:
    """Ends every stream with [DONE], turns late failures into an error event (the status line is already
    sent), and reports the request once. A client that goes away cancels us: that is an abort."""
    status = "aborted"
    try:
        try:
            async for event in events:
                yield event
            status = tracker.final_status()
        except EngineRejected as error:
            status = "rejected"
            yield sse(rejection_error(error, prompt_param=prompt_param, max_tokens_param=max_tokens_param).body())
        except EngineFailure as error:
            status = "error"
            yield sse(server_error(f"The engine failed this request: {error}").body())
        except Exception:
            status = "error"
            log.exception("stream %s failed", tracker.request_id)
            yield sse(server_error().body())
        yield SSE_DONE
    finally:
        tracker.finish(status)


async def merge(streams: list[AsyncIterator[Item]]) -> AsyncIterator[tuple[int, Item]]:
    """Items of several streams as they arrive, tagged with the stream's index; the first error wins."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncIterator[Item]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
            await queue.put((index, end, None))
        except Exception as error:
            await queue.put((index, end, error))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
