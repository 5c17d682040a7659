"""/admin: the live overview (the page polls /admin/data/live every second)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from app.dashboard.deps import DashboardDep, DataSession, MemberPage
from app.dashboard.rendering import NO_STORE, render

router = APIRouter()


@router.get("/admin", include_in_schema=False)
def overview(request: Request, session: MemberPage, dashboard: DashboardDep) -> Response:
    if not session.sees_every_team:  # the machine's numbers are every team's: a member starts on their team
        return RedirectResponse(f"/admin/teams/{session.team_id}", status_code=303)
    return render(
        request,
        "overview.html",
        session,
        section="overview",
        hardware_cost_per_hour=request.app.state.context.models.server_hardware_cost,
        interval_ms=int(dashboard.sampler.interval_s * 1000),
    )


@router.get("/admin/data/live", include_in_schema=False)
async def live_data(session: DataSession, dashboard: DashboardDep, after: float | None = None) -> Response:
    """The latest numbers per model, and the chart points newer than `after` (all 15 minutes without it)."""
    return JSONResponse(dashboard.sampler.live(after=after), headers=NO_STORE)
