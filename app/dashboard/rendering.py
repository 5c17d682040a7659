"""Jinja2 pages from web/templates (autoescaped), with the CSRF token and a few number filters."""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from starlette.templating import Jinja2Templates

from app.dashboard.sessions import AdminSession

WEB_DIR = Path(__file__).resolve().parents[2] / "web"
NO_STORE = {"cache-control": "no-store"}


def _number(value: float | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}"
    return f"{int(value):,}"


def _usd(value: float | None) -> str:
    if value is None:
        return "—"
    return f"${value:,.6f}".rstrip("0").rstrip(".") if value < 1 else f"${value:,.2f}"


def _when(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value.strftime("%Y-%m-%d %H:%M")
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def _field_value(value: object) -> str:
    """A value as a form field shows it: empty for None, lists comma-separated, times without seconds."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(value)
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%dT%H:%M")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


templates = Jinja2Templates(directory=WEB_DIR / "templates")
templates.env.filters.update(number=_number, usd=_usd, when=_when, field=_field_value)


def render(
    request: Request, name: str, session: AdminSession | None, *, status_code: int = 200, **context: Any
) -> HTMLResponse:
    signer = request.app.state.dashboard.signer
    context = {
        "csrf_token": signer.csrf_token(session) if session is not None else "",
        "logged_in": session is not None,
        # What the page offers (the server refuses the rest anyway: see deps.py).
        "role": session.role if session is not None else None,
        "can_change": session is not None and session.is_admin,
        "signed_in_as": session.who if session is not None else None,
        "member_team_id": session.team_id if session is not None and session.role == "team" else None,
        **context,
    }
    return templates.TemplateResponse(request, name, context, status_code=status_code, headers=NO_STORE)
