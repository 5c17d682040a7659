"""The seam between the OpenAI routes and the gateway (teams, keys, rate limits, usage metering).

The routes call a `Gateway` at three points: `authenticate` (every /v1 request), `admit` (once the
model and token counts are known) and `request_finished` (once per request that reached the engine).
`SingleKeyGateway` is the stand-in until the real gateway is passed to `create_app(..., gateway=...)`.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fastapi import Request

from app.errors import invalid_api_key
from app.settings import Settings

if TYPE_CHECKING:
    from app.gateway.config import ModelPrice


@dataclass(frozen=True)
class Principal:
    """Who is calling. The gateway may subclass it to carry the key's limits and allowed models."""
    team_id: str | None = None
    key_id: str | None = None
    team_weight: float = 1.0  # the team's share of the engine (fair scheduling)
    cache_group: str | None = None  # teams in one group reuse each other's cached prefixes
    priority_floor: int = 0  # the most urgent `priority` (lower runs first) its requests may ask for

    def allows(self, model: str) -> bool:
        """Whether this caller may use `model` (the gateway's keys and teams may have a list)."""
        return True


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    team_id: str | None
    key_id: str | None
    model: str
    endpoint: str  # "chat.completions" | "completions" | "responses" | "embeddings"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    latency_seconds: float
    time_to_first_token_seconds: float | None  # None when no token came out
    status: str  # "ok" | "aborted" (client went away) | "error" | "rejected" (context length, queue full)
    finished_at: float  # unix time
    price: ModelPrice | None = None  # the model's price sheet in the registry, if it has one


class Gateway(Protocol):
    async def authenticate(self, request: Request) -> Principal:
        """Raise OpenAIError (401) to refuse."""

    async def admit(self, principal: Principal, *, model: str, prompt_tokens: int, max_tokens: int | None
                    ) -> dict[str, str]:
        """Model access, rate limits, budget: raise OpenAIError (403, 429) to refuse. Returns headers for
        the response (x-ratelimit-*)."""

    def request_finished(self, record: UsageRecord) -> None:
        """Runs on the event loop: queue the row, never block."""


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class SingleKeyGateway:
    """One shared key from TOKENMILL_API_KEY; no key configured means no auth. Meters nothing."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key

    async def authenticate(self, request: Request) -> Principal:
        if self.api_key is None:
            return Principal()
        token = bearer_token(request)
        if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise invalid_api_key()
        return Principal()

    async def admit(self, principal: Principal, *, model: str, prompt_tokens: int, max_tokens: int | None
                    ) -> dict[str, str]:
        return {}

    def request_finished(self, record: UsageRecord) -> None:
        pass


def provision_admin_key(settings: Settings) -> str | None:
    """Gateway hook for `tokenmill serve`: create the admin key on first start and return it (printed
    once); return None when it already exists."""
    from app.gateway.wiring import provision_admin_key as provision

    return provision(settings)
