"""/admin/models/{name}/load and /unload: the Models page's buttons, through the same pool calls as
the admin API (unload drains: requests in flight finish first)."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from app.dashboard.deps import CheckedForm, PageActor, PageSession
from app.dashboard.rendering import render
from app.errors import OpenAIError
from app.registry.spec import RegistryError

router = APIRouter()


@router.post("/admin/models/{name:path}/{action}", include_in_schema=False)
async def model_action(
    request: Request, name: str, action: str, session: PageSession, form: CheckedForm, actor: PageActor
) -> Response:
    pool = request.app.state.context.models
    if action not in ("load", "unload") or name not in pool.specs:
        return render(request, "error.html", session, status_code=404, message=f"No model {name!r} to {action}.")
    try:
        await (pool.load(name, actor=actor) if action == "load" else pool.unload(name, actor=actor))
    except (RegistryError, OpenAIError) as error:
        return render(request, "error.html", session, status_code=400, message=str(error))
    return RedirectResponse(f"/admin/models?done={quote(action)}#{quote(name)}", status_code=303)
