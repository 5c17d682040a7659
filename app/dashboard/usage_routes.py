"""/admin/usage: usage by team / key / model / day over a date range, as a table (pages of 100), a
daily chart (JSON for the page's script) and a CSV download. The gateway's reports do the SQL. A team
member (SSO) gets their own team's usage whatever the query asks for."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from app.dashboard.deps import DashboardDep, MemberData, MemberPage
from app.dashboard.rendering import NO_STORE, render
from app.dashboard.sessions import AdminSession
from app.gateway import crud
from app.gateway.reports import GROUPS, report_columns, to_csv, usage_report

router = APIRouter()
PAGE_SIZE = 100
DEFAULT_DAYS = 30
TEAM_CHOICES = 500  # the filter's drop-down; more teams than this are picked by id


def _day(text: str | None, default: date) -> date:
    try:
        return date.fromisoformat(text) if text else default
    except ValueError:
        return default


@dataclass(frozen=True)
class UsageFilter:
    """The page's query: a range of whole UTC days (both ends included), groups and filters."""

    first_day: date
    last_day: date
    group_by: tuple[str, ...]
    team_id: int | None
    key_id: int | None
    model: str | None
    offset: int

    @classmethod
    def of(
        cls,
        *,
        since: str | None,
        until: str | None,
        group: list[str],
        team_id: str | None,
        key_id: str | None,
        model: str | None,
        offset: int = 0,
    ) -> UsageFilter:
        today = datetime.now(UTC).date()
        last = _day(until, today)
        first = min(_day(since, last - timedelta(days=DEFAULT_DAYS - 1)), last)
        groups = tuple(g for g in GROUPS if g in group) or ("day",)
        return cls(
            first,
            last,
            groups,
            int(team_id) if team_id and team_id.isdigit() else None,
            int(key_id) if key_id and key_id.isdigit() else None,
            model or None,
            max(offset, 0),
        )

    def report_args(self) -> dict[str, Any]:
        return {
            "since": datetime.combine(self.first_day, time()),
            "until": datetime.combine(self.last_day + timedelta(days=1), time()),
            "team_id": self.team_id,
            "key_id": self.key_id,
            "model": self.model,
        }

    def query(self, **changes: object) -> str:
        values = {
            "since": self.first_day.isoformat(),
            "until": self.last_day.isoformat(),
            "group": list(self.group_by),
            "team_id": self.team_id,
            "key_id": self.key_id,
            "model": self.model,
            "offset": self.offset,
            **changes,
        }
        groups = values["group"]
        assert isinstance(groups, Iterable)  # a list, or what a change put there instead
        return urlencode(
            [(k, v) for k, v in values.items() if v not in (None, "", 0) and k != "group"]
            + [("group", g) for g in groups]
        )


def scoped_team(session: AdminSession, team_id: str | None) -> str | None:
    """The team filter a session may use: any for admins and viewers, always its own for a member."""
    return team_id if session.sees_every_team else str(session.team_id)


@router.get("/admin/usage", include_in_schema=False)
def usage_page(
    request: Request,
    session: MemberPage,
    dashboard: DashboardDep,
    since: str | None = None,
    until: str | None = None,
    group: Annotated[list[str], Query()] = [],  # noqa: B006 - FastAPI copies the default per request
    team_id: str | None = None,
    key_id: str | None = None,
    model: str | None = None,
    offset: int = 0,
) -> Response:
    team_id = scoped_team(session, team_id)
    query = UsageFilter.of(
        since=since, until=until, group=group, team_id=team_id, key_id=key_id, model=model, offset=offset
    )
    with dashboard.gateway.sessions() as db:
        rows = usage_report(
            db, group_by=query.group_by, limit=PAGE_SIZE + 1, offset=query.offset, **query.report_args()
        )
        [totals] = usage_report(db, group_by=(), **query.report_args())
        if session.sees_every_team:
            teams = list(crud.list_teams(db, limit=TEAM_CHOICES))
        else:
            own = crud.get_team(db, team_id=session.team_id) if session.team_id is not None else None
            teams = [own] if own is not None else []
    return render(
        request,
        "usage.html",
        session,
        section="usage",
        rows=rows[:PAGE_SIZE],
        totals=totals,
        columns=report_columns(query.group_by),
        query=query,
        groups=GROUPS,
        teams=teams,
        has_more=len(rows) > PAGE_SIZE,
        page_size=PAGE_SIZE,
    )


@router.get("/admin/usage.csv", include_in_schema=False)
def usage_csv(
    session: MemberPage,
    dashboard: DashboardDep,
    since: str | None = None,
    until: str | None = None,
    group: Annotated[list[str], Query()] = [],  # noqa: B006 - FastAPI copies the default per request
    team_id: str | None = None,
    key_id: str | None = None,
    model: str | None = None,
) -> Response:
    query = UsageFilter.of(
        since=since, until=until, group=group, team_id=scoped_team(session, team_id), key_id=key_id, model=model
    )
    with dashboard.gateway.sessions() as db:
        rows = usage_report(db, group_by=query.group_by, **query.report_args())
    name = f"usage-{query.first_day}-{query.last_day}.csv"
    return Response(
        to_csv(rows, query.group_by),
        media_type="text/csv",
        headers={"content-disposition": f'attachment; filename="{name}"', **NO_STORE},
    )


@router.get("/admin/data/usage", include_in_schema=False)
def usage_chart_data(
    session: MemberData,
    dashboard: DashboardDep,
    since: str | None = None,
    until: str | None = None,
    team_id: str | None = None,
    key_id: str | None = None,
    model: str | None = None,
) -> Response:
    """Tokens and cost per day over the range (every day present, zeros included), for the chart."""
    query = UsageFilter.of(
        since=since, until=until, group=["day"], team_id=scoped_team(session, team_id), key_id=key_id, model=model
    )
    with dashboard.gateway.sessions() as db:
        rows = {row["day"]: row for row in usage_report(db, group_by=("day",), **query.report_args())}
    days = [
        (query.first_day + timedelta(days=i)).isoformat() for i in range((query.last_day - query.first_day).days + 1)
    ]
    fields = ("requests", "prompt_tokens", "completion_tokens", "cost_usd")
    return JSONResponse(
        {"day": days, **{f: [rows[d][f] if d in rows else 0 for d in days] for f in fields}}, headers=NO_STORE
    )
