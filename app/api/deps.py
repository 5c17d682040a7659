"""Every FastAPI dependency the JSON routes use. `ContextDep` (the server context on app.state.context)
and `PrincipalDep` (the caller, as the configured gateway authenticates it) for /v1; `TeamKeyDep` (a
team's API key) and `AdminDep` (the admin key) for the gateway's own routes, which find the Gateway on
app.state.gateway."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.errors import OpenAIError
from app.gateway import contract
from app.gateway.auth import Principal
from app.gateway.keys import bearer_token
from app.gateway.service import Gateway
from app.serving.context import ServerContext


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


async def require_team_key(request: Request, gateway: GatewayDep) -> Principal:
    return await gateway.authenticate(request)


async def require_admin(request: Request, gateway: GatewayDep) -> None:
    token = bearer_token(request.headers.get("authorization"))
    if gateway.admin is None or not gateway.admin.matches(token):
        raise gateway.auth_failure(request, token, OpenAIError(
            401, "This endpoint needs the admin key: 'Authorization: Bearer <admin key>'.", code="invalid_api_key"))


TeamKeyDep = Annotated[Principal, Depends(require_team_key)]
AdminDep = Depends(require_admin)


def server_context(request: Request) -> ServerContext:
    return request.app.state.context


async def current_principal(request: Request) -> contract.Principal:
    return await server_context(request).gateway.authenticate(request)


ContextDep = Annotated[ServerContext, Depends(server_context)]
PrincipalDep = Annotated[contract.Principal, Depends(current_principal)]
