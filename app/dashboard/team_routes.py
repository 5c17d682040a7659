"""/admin/teams: list (keyset pages), create, edit limits, delete; a team's page lists its keys.
Changes go through the admin API's functions, so the key cache is invalidated exactly as there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import func, select

from app.dashboard.deps import CheckedForm, DashboardDep, MemberPage, PageActor, PageSession
from app.dashboard.limit_forms import FormError, body_from, share_from
from app.dashboard.rendering import render
from app.errors import OpenAIError
from app.gateway import admin, crud
from app.gateway.schemas import TeamCreate, TeamUpdate
from app.tables import ApiKey

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from app.dashboard.deps import Dashboard
    from app.dashboard.sessions import AdminSession

router = APIRouter()
PAGE_SIZE = 50
NOTICES = {
    "created": "Team created.",
    "saved": "Limits saved.",
    "revoked": "Key revoked.",
    "deleted": "Team deleted; its keys are revoked.",
    "key_saved": "Key saved.",
}


def live_key_counts(session: Session, team_ids: list[int]) -> dict[int, int]:
    if not team_ids:
        return {}
    query = (
        select(ApiKey.team_id, func.count())
        .where(ApiKey.team_id.in_(team_ids), ApiKey.revoked_at.is_(None))
        .group_by(ApiKey.team_id)
    )
    return dict(session.execute(query).all())


def teams_page(
    request: Request,
    session_: AdminSession | None,
    dashboard: Dashboard,
    *,
    after: int | None,
    error: str | None = None,
    form: dict[str, Any] | None = None,
    status_code: int = 200,
) -> Response:
    with dashboard.gateway.sessions() as session:
        teams = list(crud.list_teams(session, limit=PAGE_SIZE + 1, after=after))
        counts = live_key_counts(session, [team.id for team in teams[:PAGE_SIZE]])
    return render(
        request,
        "teams.html",
        session_,
        section="teams",
        teams=teams[:PAGE_SIZE],
        key_counts=counts,
        next_after=teams[PAGE_SIZE - 1].id if len(teams) > PAGE_SIZE else None,
        after=after,
        error=error,
        form=form or {},
        status_code=status_code,
    )


@router.get("/admin/teams", include_in_schema=False)
def list_teams(request: Request, session: PageSession, dashboard: DashboardDep, after: int | None = None) -> Response:
    return teams_page(request, session, dashboard, after=after)


@router.post("/admin/teams", include_in_schema=False)
def create_team(
    request: Request, session: PageSession, dashboard: DashboardDep, form: CheckedForm, actor: PageActor
) -> Response:
    try:
        body = body_from(form, TeamCreate, name=form.get("name", "").strip(), **share_from(form))
        with dashboard.gateway.sessions() as db:
            team = admin.create_team(body, db, actor=actor)
    except (FormError, OpenAIError) as error:
        message = error.message if isinstance(error, OpenAIError) else str(error)
        return teams_page(request, session, dashboard, after=None, error=message, form=form, status_code=400)
    return RedirectResponse(f"/admin/teams/{team.id}?done=created", status_code=303)


def engine_share(request: Request, team_id: int) -> dict[str, int]:
    """The team's sequences running and waiting now, and tokens served in the last minute, over the
    models loaded in this process (the engine knows the team as 'team:<id>')."""
    share = {"running": 0, "waiting": 0, "tokens_last_minute": 0}
    for served in list(request.app.state.context.models.served.values()):
        # an embedding model (an encoder, no engine), one being unloaded, or an adapter (its base counts it)
        if served.engine is None or served.spec.adapter_of is not None:
            continue
        stats = served.engine.stats().teams.get(f"team:{team_id}")
        if stats is not None:
            share["running"] += stats.running
            share["waiting"] += stats.waiting
            share["tokens_last_minute"] += stats.tokens_last_minute()
    return share


def file_storage(request: Request, team_id: int) -> dict[str, int]:
    """The team's Files API storage: bytes stored, its quota, and the server's default quota."""
    batches = getattr(request.app.state, "batches", None)
    if batches is None:
        return {"stored": 0, "quota": 0, "default_quota": 0}
    files = batches.files
    return {
        "stored": files.stored_bytes(team_id),
        "quota": files.quota_of(team_id),
        "default_quota": files.default_quota_bytes,
    }


def team_page(
    request: Request,
    session_: AdminSession,
    dashboard: Dashboard,
    team_id: int,
    *,
    after: int | None = None,
    revoked: bool = False,
    done: str | None = None,
    error: str | None = None,
    status_code: int = 200,
) -> Response:
    with dashboard.gateway.sessions() as session:
        team = crud.get_team(session, team_id=team_id) if session_.may_see_team(team_id) else None
        if team is None:  # another team's page is as absent as a missing one: its name stays unknown
            return render(request, "error.html", session_, status_code=404, message=f"No team with id {team_id}.")
        keys = list(crud.list_keys(session, team_id=team_id, include_revoked=revoked, limit=PAGE_SIZE + 1, after=after))
    return render(
        request,
        "team.html",
        session_,
        section="teams",
        team=team,
        keys=keys[:PAGE_SIZE],
        engine_share=engine_share(request, team_id),
        file_storage=file_storage(request, team_id),
        next_after=keys[PAGE_SIZE - 1].id if len(keys) > PAGE_SIZE else None,
        after=after,
        revoked=revoked,
        notice=NOTICES.get(done or ""),
        error=error,
        status_code=status_code,
        back=str(request.url.path),
    )


@router.get("/admin/teams/{team_id}", include_in_schema=False)
def show_team(
    request: Request,
    team_id: int,
    session: MemberPage,
    dashboard: DashboardDep,
    after: int | None = None,
    revoked: bool = False,
    done: str | None = None,
) -> Response:
    return team_page(request, session, dashboard, team_id, after=after, revoked=revoked, done=done)


@router.post("/admin/teams/{team_id}", include_in_schema=False)
def update_team(
    request: Request, team_id: int, session: PageSession, dashboard: DashboardDep, form: CheckedForm, actor: PageActor
) -> Response:
    try:
        name = form.get("name", "").strip()
        body = body_from(
            form,
            TeamUpdate,
            blocked=form.get("blocked") == "on",
            **({"name": name} if name else {}),
            **share_from(form),
        )
        with dashboard.gateway.sessions() as db:
            admin.update_team(team_id, body, db, dashboard.gateway, actor=actor)
    except (FormError, OpenAIError) as error:
        message = error.message if isinstance(error, OpenAIError) else str(error)
        return team_page(request, session, dashboard, team_id, error=message, status_code=400)
    return RedirectResponse(f"/admin/teams/{team_id}?done=saved", status_code=303)


@router.post("/admin/teams/{team_id}/delete", include_in_schema=False)
def delete_team(
    team_id: int, session: PageSession, dashboard: DashboardDep, form: CheckedForm, actor: PageActor
) -> Response:
    with dashboard.gateway.sessions() as db:
        admin.delete_team(team_id, db, dashboard.gateway, actor=actor)
    return RedirectResponse("/admin/teams", status_code=303)
