"""/admin/models: the registry on a page. Register a model, change its aliases, prices, hardware cost
and engine settings, enable / disable / load / unload / remove it, and set the server's hardware cost.
Every change goes through app.registry.operations, the functions behind /admin/api/models and
/admin/api/costs, so the page checks what the API checks and refuses with the API's message (and
status: 400, 404, or 409 for a taken name or a load that would not fit in memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from app.dashboard.deps import CheckedForm, PageActor, PageSession
from app.dashboard.model_forms import (
    SETTING_PREFIX,
    change_body,
    form_values,
    register_body,
    server_cost_body,
    setting_choices,
)
from app.dashboard.rendering import render
from app.dashboard.sources import ENGINE_SETTING_NOTES, model_cards
from app.errors import OpenAIError
from app.registry import operations
from app.registry.schemas import ModelChanges, ModelCreate, ServerCostChange
from app.registry.spec import ENGINE_SETTINGS

if TYPE_CHECKING:
    from app.dashboard.sessions import AdminSession

router = APIRouter()
NOTICES = {
    "registered": "Model registered.",
    "saved": "Model saved. Aliases and prices apply now; engine settings and a new path at its next load.",
    "load": "Model loaded.",
    "unload": "Model unloading: requests in flight finish first.",
    "enable": "Model enabled.",
    "disable": "Model disabled: it is unloaded and answers 503 until enabled.",
    "remove": "Model removed; its usage rows stay.",
    "cost": "Hardware cost saved: the real cost per token uses it from now on.",
}
ACTIONS = ("save", "load", "unload", "enable", "disable", "remove")


def models_page(
    request: Request,
    session: AdminSession | None,
    *,
    done: str | None = None,
    error: OpenAIError | None = None,
    form: dict[str, Any] | None = None,
    failed: str | None = None,
) -> Response:
    """The page; after a refused change, with the API's message, its status, and what was typed."""
    pool = request.app.state.context.models
    cards = model_cards(request.app)
    for card in cards:  # the edit form shows the registry's values, or what was typed where it was refused
        card["form"] = dict(form or {}) if card["name"] == failed else form_values(pool.specs[card["name"]])
    return render(
        request,
        "models.html",
        session,
        section="models",
        models=cards,
        hardware_cost_per_hour=pool.server_hardware_cost,
        engine_settings=[(name, ENGINE_SETTING_NOTES.get(name, ""), setting_choices(name)) for name in ENGINE_SETTINGS],
        setting_prefix=SETTING_PREFIX,
        notice=NOTICES.get(done or ""),
        error=None if error is None else error.message,
        error_param=None if error is None else error.param,
        form=form or {},
        failed=failed,  # the form the error belongs to: "register", "cost", or a model's name
        status_code=200 if error is None else error.status,
    )


@router.get("/admin/models", include_in_schema=False)
def models(request: Request, session: PageSession, done: str | None = None) -> Response:
    return models_page(request, session, done=done)


@router.post("/admin/models", include_in_schema=False)
async def register_model(request: Request, session: PageSession, form: CheckedForm, actor: PageActor) -> Response:
    pool = request.app.state.context.models
    try:
        body = operations.checked(ModelCreate, register_body(form))
        view = await operations.register_model(pool, body, actor=actor)
    except OpenAIError as error:
        return models_page(request, session, error=error, form=form, failed="register")
    return RedirectResponse(f"/admin/models?done=registered#{quote(view.name)}", status_code=303)


@router.post("/admin/hardware-cost", include_in_schema=False)
async def set_hardware_cost(request: Request, session: PageSession, form: CheckedForm, actor: PageActor) -> Response:
    pool = request.app.state.context.models
    try:
        await operations.set_server_hardware_cost(
            pool, operations.checked(ServerCostChange, server_cost_body(form)), actor=actor
        )
    except OpenAIError as error:
        return models_page(request, session, error=error, form=form, failed="cost")
    return RedirectResponse("/admin/models?done=cost#hardware-cost", status_code=303)


@router.post("/admin/models/{name:path}/{action}", include_in_schema=False)
async def model_action(
    request: Request, name: str, action: str, session: PageSession, form: CheckedForm, actor: PageActor
) -> Response:
    pool = request.app.state.context.models
    if action not in ACTIONS or name not in pool.specs:
        return render(request, "error.html", session, status_code=404, message=f"No model {name!r} to {action}.")
    try:
        if action == "save":
            await operations.change_model(
                pool, name, operations.checked(ModelChanges, change_body(form, pool.specs[name])), actor=actor
            )
        elif action in ("enable", "disable"):
            await operations.change_model(
                pool, name, operations.checked(ModelChanges, {"enabled": action == "enable"}), actor=actor
            )
        elif action == "load":
            await operations.load_model(pool, name, actor=actor)
        elif action == "unload":
            await operations.unload_model(pool, name, actor=actor)
        else:
            await operations.remove_model(pool, name, actor=actor)
    except OpenAIError as error:
        return models_page(request, session, error=error, form=form, failed=name)
    anchor = "" if action == "remove" else f"#{quote(name)}"
    return RedirectResponse(f"/admin/models?done={quote(action)}{anchor}", status_code=303)
