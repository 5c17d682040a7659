"""/admin/playground: a chat with a loaded model. The page's script streams from the real
/v1/chat/completions with a short-lived key of the `playground` team (see playground_keys)."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from app.dashboard.deps import CheckedCall, DashboardDep, PageSession, actor_of
from app.dashboard.rendering import NO_STORE, render
from app.dashboard.sources import model_cards

router = APIRouter()


@router.get("/admin/playground", include_in_schema=False)
def playground(request: Request, session: PageSession) -> Response:
    cards = model_cards(request.app)
    return render(request, "playground.html", session, section="playground", models=cards)


@router.post("/admin/playground/key", include_in_schema=False)
async def playground_key(session: CheckedCall, dashboard: DashboardDep) -> Response:
    minted = await run_in_threadpool(dashboard.playground.key_for, session.session_id, actor_of(session, dashboard))
    expires = datetime.fromtimestamp(minted.expires_at, UTC).isoformat()
    return JSONResponse(
        {"key": minted.key, "key_id": minted.key_id, "team_id": minted.team_id, "expires_at": expires}, headers=NO_STORE
    )
