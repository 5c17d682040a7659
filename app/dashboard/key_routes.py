"""/admin/keys: every key (keyset pages, by team), create (the key is shown once), edit limits, rotate
(the new secret is shown once; the old one works for the grace chosen), revoke. A team member (SSO)
sees, creates, rotates and revokes their own team's keys only; limits are the admin's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import select

from app.dashboard.deps import CheckedForm, DashboardDep, MemberForm, MemberPage, PageActor, PageRefused, safe_next
from app.dashboard.limit_forms import FormError, body_from
from app.dashboard.rendering import render
from app.dashboard.team_routes import PAGE_SIZE, team_page
from app.errors import OpenAIError
from app.gateway import admin, crud
from app.gateway.reports import parse_duration
from app.gateway.schemas import KeyCreate, KeyRotate, KeyUpdate
from app.tables import Team

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

router = APIRouter()


def team_names(session: Session, team_ids: set[int]) -> dict[int, str]:
    if not team_ids:
        return {}
    return dict(session.execute(select(Team.id, Team.name).where(Team.id.in_(team_ids))).all())


@router.get("/admin/keys", include_in_schema=False)
def list_keys(
    request: Request,
    session: MemberPage,
    dashboard: DashboardDep,
    after: int | None = None,
    team_id: int | None = None,
    revoked: bool = False,
) -> Response:
    if not session.sees_every_team:
        team_id = session.team_id
    with dashboard.gateway.sessions() as db:
        keys = list(crud.list_keys(db, team_id=team_id, include_revoked=revoked, limit=PAGE_SIZE + 1, after=after))
        names = team_names(db, {key.team_id for key in keys})
    return render(
        request,
        "keys.html",
        session,
        section="keys",
        keys=keys[:PAGE_SIZE],
        team_names=names,
        next_after=keys[PAGE_SIZE - 1].id if len(keys) > PAGE_SIZE else None,
        after=after,
        team_id=team_id,
        revoked=revoked,
        back=str(request.url.path),
    )


@router.post("/admin/keys", include_in_schema=False)
def create_key(
    request: Request, session: MemberPage, dashboard: DashboardDep, change: MemberForm, actor: PageActor
) -> Response:
    """Answers with the page that shows the key: once, never cached, never in a URL. A team member's key
    is bounded by the team's limits like any other (they apply on top of a key's own)."""
    form = change.form
    team_id = int(form["team_id"]) if form.get("team_id", "").isdigit() else 0
    if not change.session.may_manage_team(team_id):
        raise PageRefused(404, f"No team with id {team_id}.")
    try:
        body = body_from(form, KeyCreate, team_id=team_id, name=form.get("name", "").strip())
        with dashboard.gateway.sessions() as db:
            created = admin.create_key(body, db, actor=actor)
    except (FormError, OpenAIError) as error:
        message = error.message if isinstance(error, OpenAIError) else str(error)
        return team_page(request, session, dashboard, team_id, error=message, status_code=400)
    return render(request, "key_created.html", session, section="keys", key=created)


@router.get("/admin/keys/{key_id}", include_in_schema=False)
def show_key(
    request: Request,
    key_id: int,
    session: MemberPage,
    dashboard: DashboardDep,
    done: str | None = None,
    error: str | None = None,
    status_code: int = 200,
) -> Response:
    with dashboard.gateway.sessions() as db:
        key = crud.get_key(db, key_id=key_id)
        key = key if key is not None and session.may_see_team(key.team_id) else None
        team = crud.get_team(db, team_id=key.team_id) if key is not None else None
    if key is None:
        return render(request, "error.html", session, status_code=404, message=f"No key with id {key_id}.")
    return render(
        request,
        "key.html",
        session,
        section="keys",
        key=key,
        team=team,
        error=error,
        notice="Key saved." if done == "saved" else None,
        status_code=status_code,
    )


@router.post("/admin/keys/{key_id}", include_in_schema=False)
def update_key(
    request: Request, key_id: int, session: MemberPage, dashboard: DashboardDep, form: CheckedForm, actor: PageActor
) -> Response:
    try:
        body = body_from(form, KeyUpdate, name=form.get("name", "").strip())
        with dashboard.gateway.sessions() as db:
            admin.update_key(key_id, body, db, dashboard.gateway, actor=actor)
    except (FormError, OpenAIError) as error:
        message = error.message if isinstance(error, OpenAIError) else str(error)
        return show_key(request, key_id, session, dashboard, error=message, status_code=400)
    return RedirectResponse(f"/admin/keys/{key_id}?done=saved", status_code=303)


@router.post("/admin/keys/{key_id}/rotate", include_in_schema=False)
def rotate_key(
    request: Request, key_id: int, session: MemberPage, dashboard: DashboardDep, change: MemberForm, actor: PageActor
) -> Response:
    """Answers with the page that shows the new secret: once, never cached, never in a URL. A team member
    rotates their own team's keys (self-service, like revoking); another team's key is as absent."""
    form = change.form
    try:
        body = KeyRotate.model_validate({"grace_period_s": parse_duration(form.get("grace") or "24h")})
        with dashboard.gateway.sessions() as db:
            found = crud.get_key(db, key_id=key_id)
            if found is None or not change.session.may_manage_team(found.team_id):
                raise PageRefused(404, f"No key with id {key_id}.")
            rotated = admin.rotate_key(key_id, body, db, dashboard.gateway, actor=actor)
    except ValueError:  # a pydantic ValidationError is one too
        message = "The grace period must be a duration from 0 to 30d, e.g. 90s, 15m, 1h or 7d."
        return show_key(request, key_id, session, dashboard, error=message, status_code=400)
    except OpenAIError as error:
        if error.status == 404:
            return show_key(request, key_id, session, dashboard)
        return show_key(request, key_id, session, dashboard, error=error.message, status_code=error.status)
    return render(request, "key_created.html", session, section="keys", key=rotated, rotated=True)


@router.post("/admin/keys/{key_id}/revoke", include_in_schema=False)
def revoke_key(
    key_id: int, session: MemberPage, dashboard: DashboardDep, change: MemberForm, actor: PageActor
) -> Response:
    form = change.form
    with dashboard.gateway.sessions() as db:
        found = crud.get_key(db, key_id=key_id)
        if found is None or not change.session.may_manage_team(found.team_id):  # another team's: as absent
            raise PageRefused(404, f"No key with id {key_id}.")
        key = admin.revoke_key(key_id, db, dashboard.gateway, actor=actor)
    back = safe_next(form.get("back") or f"/admin/teams/{key.team_id}")
    return RedirectResponse(back + ("&" if "?" in back else "?") + "done=revoked", status_code=303)
