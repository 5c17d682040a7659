"""Every FastAPI dependency the JSON routes use. `ContextDep` (the server context on app.state.context)
and `PrincipalDep` (the caller, as the app's gateway authenticates it) for /v1; `GatewayDep`,
`TeamKeyDep` (a team's API key) and `AdminDep` / `AdminActor` (the admin key) for the TeamGateway's own routes, which
find it on app.state.gateway."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Request

from app.batches.dispatch import BATCH_PRINCIPAL
from app.batches.service import BatchService
from app.errors import OpenAIError
from app.gateway.audit import Actor
from app.gateway.auth import KeyPrincipal
from app.gateway.contract import Principal
from app.gateway.keys import bearer_token
from app.gateway.service import TeamGateway
from app.serving.context import ServerContext


# The dependencies are coroutines, though they await nothing: FastAPI runs a plain function in the
# worker-thread pool, and under a flood that pool is busy with admission work (tokenization), so every new
# request queued first come, first served for a thread just to read app.state.
async def server_context(request: Request) -> ServerContext:
    return cast(ServerContext, request.app.state.context)


async def current_principal(request: Request) -> Principal:
    batch_caller = request.scope.get(BATCH_PRINCIPAL)  # a batch line the runner sends in process
    if batch_caller is not None:
        return cast(Principal, batch_caller)
    principal = await (await server_context(request)).gateway.authenticate(request)
    # A Ray Serve replica reads it after the answer, to tell its router this key's cache salt.
    request.state.principal = principal
    return principal


async def batch_service(request: Request) -> BatchService:
    return cast(BatchService, request.app.state.batches)


ContextDep = Annotated[ServerContext, Depends(server_context)]
BatchesDep = Annotated[BatchService, Depends(batch_service)]  # the Files and Batch APIs (a TeamGateway only)
PrincipalDep = Annotated[Principal, Depends(current_principal)]


def get_gateway(request: Request) -> TeamGateway:
    return cast(TeamGateway, request.app.state.gateway)


GatewayDep = Annotated[TeamGateway, Depends(get_gateway)]


async def require_team_key(request: Request, gateway: GatewayDep) -> KeyPrincipal:
    return await gateway.authenticate(request)


async def require_admin(request: Request, gateway: GatewayDep) -> Actor:
    """The admin, as the audit log names whoever makes a change with this request."""
    token = bearer_token(request.headers.get("authorization"))
    if gateway.admin is None or not gateway.admin.matches(token):
        raise gateway.auth_failure(
            request,
            token,
            OpenAIError(
                401, "This endpoint needs the admin key: 'Authorization: Bearer <admin key>'.", code="invalid_api_key"
            ),
        )
    return gateway.admin.actor


TeamKeyDep = Annotated[KeyPrincipal, Depends(require_team_key)]
AdminDep = Depends(require_admin)
AdminActor = Annotated[Actor, Depends(require_admin)]  # the same check (run once a request), and who passed it
