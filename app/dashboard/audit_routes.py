"""/admin/audit: the audit log, newest first, with the API's filters (who, what, which target, a range of
UTC days), pages by the last id seen, and the filtered log as a CSV download."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import date, datetime, time, timedelta
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from app.dashboard.deps import DashboardDep, PageSession
from app.dashboard.rendering import NO_STORE, render
from app.gateway.audit_log import AuditFilter, csv_chunks, list_entries

router = APIRouter()
PAGE_SIZE = 100


def _day(text: str | None) -> date | None:
    try:
        return date.fromisoformat(text) if text else None
    except ValueError:  # a hand-edited link: no bound rather than an error page
        return None


@dataclass(frozen=True)
class AuditQuery:
    """The page's form: free-text filters and a range of whole UTC days, both ends included."""

    actor: str = ""
    action: str = ""
    target_type: str = ""
    target_id: str = ""
    since: str = ""
    until: str = ""

    @classmethod
    def of(cls, **values: str | None) -> AuditQuery:
        return cls(**{f.name: (values.get(f.name) or "").strip()[:255] for f in fields(cls)})

    def filter(self) -> AuditFilter:
        first, last = _day(self.since), _day(self.until)
        return AuditFilter(
            actor=self.actor or None,
            action=self.action or None,
            target_type=self.target_type or None,
            target_id=self.target_id or None,
            since=datetime.combine(first, time()) if first else None,
            until=datetime.combine(last + timedelta(days=1), time()) if last else None,
        )

    def query(self, **extra: object) -> str:
        values = {f.name: getattr(self, f.name) for f in fields(self)} | extra
        return urlencode({name: value for name, value in values.items() if value not in (None, "")})


def audit_query(
    actor: str | None = None,
    action: str | None = None,
    target_type: str | None = None,
    target_id: str | None = None,
    since: str | None = None,
    until: str | None = None,
) -> AuditQuery:
    """The filters of the page and of its CSV, from the query string."""
    return AuditQuery.of(
        actor=actor, action=action, target_type=target_type, target_id=target_id, since=since, until=until
    )


AuditQueryDep = Annotated[AuditQuery, Depends(audit_query)]


@router.get("/admin/audit", include_in_schema=False)
def audit_page(
    request: Request, session: PageSession, dashboard: DashboardDep, query: AuditQueryDep, after: int | None = None
) -> Response:
    with dashboard.gateway.sessions() as db:
        entries = list(list_entries(db, query.filter(), limit=PAGE_SIZE + 1, after=after))
    return render(
        request,
        "audit.html",
        session,
        section="audit",
        entries=entries[:PAGE_SIZE],
        query=query,
        after=after,
        next_after=entries[PAGE_SIZE - 1].id if len(entries) > PAGE_SIZE else None,
    )


@router.get("/admin/audit.csv", include_in_schema=False)
def audit_csv(session: PageSession, dashboard: DashboardDep, query: AuditQueryDep) -> Response:
    return StreamingResponse(
        csv_chunks(dashboard.gateway.sessions, query.filter()),
        media_type="text/csv",
        headers={"content-disposition": 'attachment; filename="audit.csv"', **NO_STORE},
    )
