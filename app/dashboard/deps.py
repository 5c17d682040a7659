"""The dashboard's dependencies: its state on app.state.dashboard, the admin session a page or a data
call needs (pages redirect to the login, data calls answer 401) and the CSRF check on every POST."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated
from urllib.parse import parse_qsl, quote

from fastapi import Depends, Request

from app.dashboard.live import LiveSampler
from app.dashboard.playground_keys import PlaygroundKeys
from app.dashboard.sessions import SESSION_COOKIE, AdminSession, SessionSigner, SessionStore
from app.errors import OpenAIError
from app.gateway.audit import SYSTEM, Actor
from app.gateway.service import TeamGateway
from app.settings import Settings

MAX_FORM_BYTES = 64 * 1024
CSRF_HEADER = "x-csrf-token"


@dataclass
class Dashboard:
    settings: Settings
    gateway: TeamGateway
    signer: SessionSigner
    session_store: SessionStore
    sampler: LiveSampler
    playground: PlaygroundKeys


class LoginRequired(Exception):
    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class CsrfRejected(Exception):
    pass


def get_dashboard(request: Request) -> Dashboard:
    return request.app.state.dashboard


DashboardDep = Annotated[Dashboard, Depends(get_dashboard)]


def current_session(request: Request, dashboard: DashboardDep) -> AdminSession | None:
    """Blocking (a database read), so FastAPI runs it in a thread: a logout anywhere ends it here."""
    session = dashboard.signer.read(request.cookies.get(SESSION_COOKIE))
    return session if session is not None and dashboard.session_store.is_open(session) else None


def page_session(request: Request, session: Annotated[AdminSession | None, Depends(current_session)]) -> AdminSession:
    if session is None:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(path)
    return session


def data_session(session: Annotated[AdminSession | None, Depends(current_session)]) -> AdminSession:
    if session is None:
        raise OpenAIError(401, "Log in to the dashboard at /admin/login first.", code="invalid_session")
    return session


PageSession = Annotated[AdminSession, Depends(page_session)]
DataSession = Annotated[AdminSession, Depends(data_session)]


def actor_of(session: AdminSession, dashboard: Dashboard) -> Actor:
    """Who the audit log says made a change through this dashboard session: so far every session is
    opened with the admin key."""
    admin = dashboard.gateway.admin
    return admin.actor if admin is not None else SYSTEM


def page_actor(session: PageSession, dashboard: DashboardDep) -> Actor:
    return actor_of(session, dashboard)


PageActor = Annotated[Actor, Depends(page_actor)]


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form body (the only kind our pages post), first value per field. Read up to the
    form cap and no further: the login form is posted before anyone is authenticated."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != "application/x-www-form-urlencoded":
        raise OpenAIError(415, "Expected a form (application/x-www-form-urlencoded).")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            raise OpenAIError(413, "The form is too large.", code="request_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    form: dict[str, str] = {}
    for name, value in parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True):
        form.setdefault(name, value)
    return form


async def checked_form(request: Request, session: PageSession, dashboard: DashboardDep) -> dict[str, str]:
    form = await read_form(request)
    if not dashboard.signer.csrf_ok(session, form.get("csrf_token")):
        raise CsrfRejected()
    return form


def checked_header(request: Request, session: DataSession, dashboard: DashboardDep) -> AdminSession:
    if not dashboard.signer.csrf_ok(session, request.headers.get(CSRF_HEADER)):
        raise OpenAIError(403, "Missing or wrong CSRF token.", code="csrf_failed")
    return session


CheckedForm = Annotated[dict[str, str], Depends(checked_form)]
CheckedCall = Annotated[AdminSession, Depends(checked_header)]


def login_url(next_path: str | None = None) -> str:
    return "/admin/login" + (f"?next={quote(next_path, safe='')}" if next_path else "")


def safe_next(next_path: str | None) -> str:
    """Only our own pages: never another host ('//evil', 'https://...') and never the login itself."""
    if not next_path or not next_path.startswith("/admin") or next_path.startswith("//") or "\\" in next_path:
        return "/admin"
    if next_path.startswith("/admin/login") or next_path.startswith("/admin/logout"):
        return "/admin"
    return next_path
