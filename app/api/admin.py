"""/admin/api: teams, keys and usage, for the admin key only. JSON, keyset-paginated lists; what a change
does is app.gateway.admin, which the dashboard's forms call too."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from sqlalchemy.orm import Session

from app.api.deps import AdminActor, AdminDep, GatewayDep
from app.errors import invalid_request
from app.gateway import admin, crud
from app.gateway.reports import list_requests, parse_group_by, parse_when, to_csv, usage_report
from app.gateway.schemas import (
    KeyCreate,
    KeyCreated,
    KeyRotate,
    KeyRotated,
    KeyUpdate,
    KeyView,
    Page,
    TeamCreate,
    TeamUpdate,
    TeamView,
    UsageReport,
    UsageRequestView,
)
from app.tables import NANO

router = APIRouter(prefix="/admin/api", tags=["admin"], dependencies=[AdminDep])


def get_session(gateway: GatewayDep) -> Iterator[Session]:
    with gateway.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
Limit = Annotated[int, Query(ge=1, le=1000)]


def _page(items: list[Any], limit: int, view: type[TeamView] | type[KeyView]) -> dict[str, Any]:
    data = [view.of(item) for item in items[:limit]]
    return {
        "data": data,
        "has_more": len(items) > limit,
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
    }


# teams


@router.post("/teams", status_code=201, response_model=TeamView)
def create_team(body: TeamCreate, session: SessionDep, actor: AdminActor) -> TeamView:
    return admin.create_team(body, session, actor=actor)


@router.get("/teams", response_model=Page[TeamView])
def list_teams(session: SessionDep, limit: Limit = 100, after: int | None = None) -> dict[str, Any]:
    return _page(list(crud.list_teams(session, limit=limit + 1, after=after)), limit, TeamView)


@router.get("/teams/{team_id}", response_model=TeamView)
def get_team(team_id: int, session: SessionDep) -> TeamView:
    return admin.get_team(team_id, session)


@router.patch("/teams/{team_id}", response_model=TeamView)
def update_team(
    team_id: int, body: TeamUpdate, session: SessionDep, gateway: GatewayDep, actor: AdminActor
) -> TeamView:
    return admin.update_team(team_id, body, session, gateway, actor=actor)


@router.delete("/teams/{team_id}")
def delete_team(team_id: int, session: SessionDep, gateway: GatewayDep, actor: AdminActor) -> dict[str, Any]:
    return admin.delete_team(team_id, session, gateway, actor=actor)


# keys


@router.post("/keys", status_code=201, response_model=KeyCreated)
def create_key(body: KeyCreate, session: SessionDep, actor: AdminActor) -> KeyCreated:
    return admin.create_key(body, session, actor=actor)


@router.get("/keys", response_model=Page[KeyView])
def list_keys(
    session: SessionDep,
    limit: Limit = 100,
    after: int | None = None,
    team_id: int | None = None,
    include_revoked: bool = False,
) -> dict[str, Any]:
    keys = crud.list_keys(session, team_id=team_id, include_revoked=include_revoked, limit=limit + 1, after=after)
    return _page(list(keys), limit, KeyView)


@router.get("/keys/{key_id}", response_model=KeyView)
def get_key(key_id: int, session: SessionDep) -> KeyView:
    return admin.get_key(key_id, session)


@router.patch("/keys/{key_id}", response_model=KeyView)
def update_key(key_id: int, body: KeyUpdate, session: SessionDep, gateway: GatewayDep, actor: AdminActor) -> KeyView:
    return admin.update_key(key_id, body, session, gateway, actor=actor)


@router.delete("/keys/{key_id}", response_model=KeyView)
def revoke_key(key_id: int, session: SessionDep, gateway: GatewayDep, actor: AdminActor) -> KeyView:
    """Revokes the key (rows keep pointing at it; it answers 401 from now on)."""
    return admin.revoke_key(key_id, session, gateway, actor=actor)


@router.post("/keys/{key_id}/rotate", response_model=KeyRotated)
def rotate_key(
    key_id: int, session: SessionDep, gateway: GatewayDep, actor: AdminActor, body: KeyRotate | None = None
) -> KeyRotated:
    """A new secret for the key (shown this once), same id, limits and usage; the old secret keeps
    working for grace_period_s (default 24 h), then answers 401 invalid_api_key."""
    return admin.rotate_key(key_id, body or KeyRotate.model_validate({}), session, gateway, actor=actor)


# usage


class UsageQuery:
    def __init__(
        self,
        team_id: int | None = None,
        key_id: int | None = None,
        model: str | None = None,
        since: Annotated[str | None, Query(description="inclusive; date or ISO time, UTC")] = None,
        until: Annotated[str | None, Query(description="exclusive; date or ISO time, UTC")] = None,
        group_by: Annotated[str, Query(description="comma-separated: day, team, key, model, replica")] = "day",
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
        offset: Annotated[int, Query(ge=0)] = 0,
        format: Literal["json", "csv"] = "json",
    ) -> None:
        try:
            self.since = parse_when(since)
            self.until = parse_when(until)
            self.group_by = parse_group_by(group_by)
        except ValueError as error:
            raise invalid_request(str(error)) from None
        self.team_id, self.key_id, self.model = team_id, key_id, model
        self.limit, self.offset, self.format = limit, offset, format

    def filters(self) -> dict[str, Any]:
        return {
            "team_id": self.team_id,
            "key_id": self.key_id,
            "model": self.model,
            "since": self.since,
            "until": self.until,
        }


def usage_response(session: Session, query: UsageQuery, *, csv: bool = False) -> Response | dict[str, Any]:
    if csv or query.format == "csv":
        rows = usage_report(session, group_by=query.group_by, **query.filters())
        return Response(
            to_csv(rows, query.group_by),
            media_type="text/csv",
            headers={"content-disposition": 'attachment; filename="usage.csv"'},
        )
    rows = usage_report(session, group_by=query.group_by, limit=query.limit + 1, offset=query.offset, **query.filters())
    return {
        "group_by": list(query.group_by),
        "since": _iso(query.since),
        "until": _iso(query.until),
        "data": rows[: query.limit],
        "has_more": len(rows) > query.limit,
    }


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat() + "Z"


CSV_RESPONSE: dict[int | str, dict[str, Any]] = {200: {"content": {"text/csv": {}}, "description": "with format=csv"}}


@router.get("/usage", response_model=UsageReport, responses=CSV_RESPONSE)
def usage(session: SessionDep, query: Annotated[UsageQuery, Depends()]) -> Response | dict[str, Any]:
    return usage_response(session, query)


@router.get("/usage.csv", response_class=Response, responses=CSV_RESPONSE)
def usage_csv(session: SessionDep, query: Annotated[UsageQuery, Depends()]) -> Response:
    response = usage_response(session, query, csv=True)
    assert isinstance(response, Response)  # csv=True always answers CSV
    return response


@router.get("/usage/requests", response_model=Page[UsageRequestView])
def usage_requests(
    session: SessionDep, query: Annotated[UsageQuery, Depends()], before: int | None = None
) -> dict[str, Any]:
    """Request rows, newest first; page with `before` = the last id seen."""
    rows = list(list_requests(session, limit=query.limit + 1, before=before, **query.filters()))
    data = [
        UsageRequestView.model_validate(
            {
                **{c: getattr(r, c) for c in UsageRequestView.model_fields if hasattr(r, c)},
                "cost_usd": r.cost_nano_usd / NANO,
            }
        )
        for r in rows[: query.limit]
    ]
    return {
        "data": data,
        "has_more": len(rows) > query.limit,
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
    }
