"""/admin/api/audit: the audit log for the admin key. Filtered, newest first, keyset pages (`after` = the
last id seen), or the whole filtered log as CSV (?format=csv, or Accept: text/csv)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, field_serializer

from app.api.admin import SessionDep
from app.api.deps import AdminDep, GatewayDep
from app.errors import invalid_request
from app.gateway.audit_log import AuditFilter, csv_chunks, list_entries
from app.gateway.reports import parse_when
from app.tables import AuditEntry

router = APIRouter(prefix="/admin/api", tags=["admin"], dependencies=[AdminDep])


class AuditEntryView(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    object: Literal["audit_entry"] = "audit_entry"
    id: int
    created_at: datetime
    actor_kind: str
    actor_id: str
    actor_display: str
    action: str
    target_type: str
    target_id: str | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None

    @field_serializer("created_at")
    def _utc(self, value: datetime) -> str:
        return value.isoformat() + "Z"


class AuditPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[AuditEntryView]
    has_more: bool
    first_id: int | None = None
    last_id: int | None = None


class AuditQuery:
    def __init__(
        self,
        actor: Annotated[str | None, Query(description="an actor's id or display name")] = None,
        action: Annotated[str | None, Query(description='e.g. "key.rotate", or "key." for every key action')] = None,
        target_type: str | None = None,
        target_id: str | None = None,
        since: Annotated[str | None, Query(description="inclusive; date or ISO time, UTC")] = None,
        until: Annotated[str | None, Query(description="exclusive; date or ISO time, UTC")] = None,
    ) -> None:
        try:
            self.filter = AuditFilter(actor, action, target_type, target_id, parse_when(since), parse_when(until))
        except ValueError as error:
            raise invalid_request(f"since / until: {error}") from None


CSV_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/csv": {}}, "description": "with format=csv or Accept: text/csv"}
}


def wants_csv(request: Request, format: str | None) -> bool:
    if format is not None:
        return format == "csv"
    return "text/csv" in request.headers.get("accept", "")


@router.get("/audit", response_model=AuditPage, responses=CSV_RESPONSE)
def audit(
    request: Request,
    session: SessionDep,
    gateway: GatewayDep,
    query: Annotated[AuditQuery, Depends()],
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[int | None, Query(description="the last id of the previous page")] = None,
    format: Literal["json", "csv"] | None = None,
) -> Any:
    if wants_csv(request, format):
        return StreamingResponse(
            csv_chunks(gateway.sessions, query.filter),
            media_type="text/csv",
            headers={"content-disposition": 'attachment; filename="audit.csv"'},
        )
    entries = list(list_entries(session, query.filter, limit=limit + 1, after=after))
    return page_of(entries, limit)


def page_of(entries: list[AuditEntry], limit: int) -> AuditPage:
    data = [AuditEntryView.model_validate(entry) for entry in entries[:limit]]
    return AuditPage(
        data=data,
        has_more=len(entries) > limit,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )
