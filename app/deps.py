"""What a route needs, as FastAPI dependencies: the server context and the caller."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from app.gateway_hooks import Gateway, Principal
from app.metrics import ServerMetrics
from app.sampling import TokenBudget
from app.settings import Settings
from app.token_text import TokenTexts


@dataclass(frozen=True)
class ServerContext:
    settings: Settings
    engine: object  # engine.async_engine.AsyncEngine
    gateway: Gateway
    metrics: ServerMetrics
    token_texts: TokenTexts

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def token_budget(self) -> TokenBudget:
        """A default max_tokens must fit the context and the KV pool, or the engine refuses it."""
        pool_tokens = self.engine.stats().kv_blocks_total * self.engine.config.block_size
        return TokenBudget(min(self.engine.max_model_len, pool_tokens), self.settings.max_tokens_cap)


def server_context(request: Request) -> ServerContext:
    return request.app.state.context


async def current_principal(request: Request) -> Principal:
    return await server_context(request).gateway.authenticate(request)


ContextDep = Annotated[ServerContext, Depends(server_context)]
PrincipalDep = Annotated[Principal, Depends(current_principal)]
