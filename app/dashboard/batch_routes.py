"""/admin/batches: every team's batches (Batch API), newest first, with their progress; cancel one
(admins). A team member sees their own team's batches."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import select, tuple_

from app.batches.jobs import BatchStore
from app.dashboard.deps import CheckedForm, DashboardDep, MemberPage, PageActor, PageSession
from app.dashboard.rendering import render
from app.errors import OpenAIError
from app.tables import BatchJob, Team

router = APIRouter()
PAGE_SIZE = 50
CANCELLABLE = ("validating", "in_progress")
# Errors by code in the redirect, so a crafted link can't put words on the page.
ERRORS = {"not_found": "No such batch.", "not_cancellable": "That batch has already ended; there is nothing to cancel."}


@router.get("/admin/batches", include_in_schema=False)
def list_batches(
    request: Request,
    session: MemberPage,
    dashboard: DashboardDep,
    team: int | None = None,
    after: str | None = None,
    error: str | None = None,
) -> Response:
    if not session.sees_every_team:  # a team member sees their team's batches only
        team = session.team_id
    query = select(BatchJob, Team.name).outerjoin(Team, Team.id == BatchJob.team_id)
    if team is not None:
        query = query.where(BatchJob.team_id == team)
    with dashboard.gateway.sessions() as db:
        cursor = db.get(BatchJob, after) if after else None
        if cursor is not None:
            query = query.where(tuple_(BatchJob.created_at, BatchJob.id) < tuple_(cursor.created_at, cursor.id))
        rows = db.execute(query.order_by(BatchJob.created_at.desc(), BatchJob.id.desc()).limit(PAGE_SIZE + 1)).all()
    batches = [{"job": job, "team": name, "done": job.completed + job.failed} for job, name in rows[:PAGE_SIZE]]
    return render(
        request,
        "batches.html",
        session,
        section="batches",
        batches=batches,
        team=team,
        after=after,
        next_after=rows[PAGE_SIZE - 1][0].id if len(rows) > PAGE_SIZE else None,
        cancellable=CANCELLABLE,
        error=ERRORS.get(error or ""),
    )


@router.post("/admin/batches/{batch_id}/cancel", include_in_schema=False)
def cancel_batch(
    batch_id: str, session: PageSession, dashboard: DashboardDep, form: CheckedForm, actor: PageActor
) -> Response:
    """The runner sees the new status within a second, stops feeding and writes the partial output."""
    jobs = BatchStore(dashboard.gateway.sessions)
    with dashboard.gateway.sessions() as db:
        job = db.get(BatchJob, batch_id)
    if job is None:
        return RedirectResponse("/admin/batches?error=not_found", status_code=303)
    try:
        jobs.cancel(team_id=job.team_id, batch_id=batch_id, actor=actor)
    except OpenAIError:
        return RedirectResponse("/admin/batches?error=not_cancellable", status_code=303)
    return RedirectResponse("/admin/batches", status_code=303)
