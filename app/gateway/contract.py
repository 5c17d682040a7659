"""The seam between the rest of app/ and the gateway (teams, keys, rate limits, usage metering): the
only gateway module the /v1 routes and the serving code import.

The routes call a `Gateway` at three points: `authenticate` (every /v1 request), `admit` (once the
model and token counts are known) and `request_finished` (once per request that reached the engine).
The app starts and stops it with its lifespan. Two implementations: `SingleKeyGateway` below (one key
from settings, or none; no database) and app.gateway.service.TeamGateway (teams, keys and usage in a
database, where the model registry lives too).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request

from app.errors import invalid_api_key
from app.gateway.keys import bearer_token

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from app.gateway.config import ModelPrice


@dataclass(frozen=True)
class Principal:
    """Who is calling. The gateway may subclass it to carry the key's limits and allowed models."""

    team_id: int | None = None
    key_id: int | None = None
    team_weight: float = 1.0  # the team's share of the engine (fair scheduling)
    cache_group: str | None = None  # teams in one group reuse each other's cached prefixes
    priority_floor: int = 0  # the most urgent `priority` (lower runs first) its requests may ask for
    batch: bool = False  # a line of a batch (Batch API): metered at the batch price, outside the rpm / tpm limits

    def allows(self, model: str) -> bool:
        """Whether this caller may use `model` (the gateway's keys and teams may have a list)."""
        return True


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    team_id: int | None
    key_id: int | None
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
    batch: bool = False  # a line of a batch: charged by price.for_batch()


class Gateway(Protocol):
    @property
    def sessions(self) -> sessionmaker[Session] | None:
        """The gateway's database, where the model registry lives too; None: a gateway without one."""

    async def astart(self) -> None:
        """Runs before the app serves its first request."""

    async def astop(self) -> None:
        """Runs once the app has stopped serving: flush what is queued."""

    async def authenticate(self, request: Request) -> Principal:
        """Raise OpenAIError (401) to refuse."""

    async def admit(
        self,
        principal: Principal,
        *,
        model: str,
        prompt_tokens: int,
        max_tokens: int | None,
        sequences: int = 1,
        request_id: str | None = None,
        price: ModelPrice | None = None,
    ) -> dict[str, str]:
        """Model access, rate limits, budget: raise OpenAIError (403, 429) to refuse. Returns headers for
        the response (x-ratelimit-*). With `request_id`, what the request can cost (prompt_tokens +
        max_tokens x sequences, and its price) is reserved until request_finished() reports that id."""

    def request_finished(self, record: UsageRecord) -> None:
        """Runs on the event loop: queue the row, never block."""


class SingleKeyGateway:
    """One shared key from TOKENMILL_API_KEY; no key configured means no auth. Meters nothing."""

    sessions = None

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key

    async def astart(self) -> None:
        pass

    async def astop(self) -> None:
        pass

    async def authenticate(self, request: Request) -> Principal:
        if self.api_key is None:
            return Principal()
        token = bearer_token(request.headers.get("authorization"))
        if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise invalid_api_key()
        return Principal()

    async def admit(self, principal: Principal, **admission: Any) -> dict[str, str]:
        """Admits everything: Gateway.admit's keywords are accepted whatever they are (so a new one needs
        no change here) and none of them is limited."""
        return {}

    def request_finished(self, record: UsageRecord) -> None:
        pass
