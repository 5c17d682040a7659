"""x-ratelimit-* headers on every response of an admitted request: success, stream, or an error raised
after admission (context too long, queue full). `admit` drops the headers into a per-request holder
that this middleware puts in place; the middleware adds whichever the response doesn't carry yet."""

from __future__ import annotations

from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_headers: ContextVar[dict[str, str] | None] = ContextVar("tokenmill_ratelimit_headers", default=None)


def offer_headers(headers: dict[str, str]) -> None:
    """Called by the gateway during admission; a no-op outside a request that has the middleware."""
    holder = _headers.get()
    if holder is not None:
        holder.update(headers)


class RateLimitHeadersMiddleware:
    def __init__(self, app: ASGIApp, prefix: str = "/v1/") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        holder: dict[str, str] = {}
        token = _headers.set(holder)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and holder:
                present = {name.lower() for name, _ in message.get("headers", ())}
                extra = [
                    (name.encode(), value.encode()) for name, value in holder.items() if name.encode() not in present
                ]
                if extra:
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _headers.reset(token)
