"""The dashboard's dependencies: its state on app.state.dashboard, the session a page or a data call
needs (pages redirect to the login, data calls answer 401), the role it needs, and the CSRF check on
every POST.

Roles are enforced here, server-side, so that a new route is safe by default:
- PageSession / DataSession: admin or viewer (pages over every team). A team member gets 403.
- CheckedForm / CheckedCall (every change): admin only. A viewer gets 403, whatever the page showed.
- MemberPage / MemberData / MemberForm: also team members, for the routes that scope what they show
  or change to the member's team (team self-service); those routes check the team themselves.
- SignedInForm: any signed-in role (logging out)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated
from urllib.parse import parse_qsl, quote

from fastapi import Depends, Request

from app.dashboard.live import LiveSampler
from app.dashboard.playground_keys import PlaygroundKeys
from app.dashboard.sessions import SESSION_COOKIE, AdminSession, SessionSigner, SessionStore
from app.dashboard.sso import OidcClient
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
    sso: OidcClient | None = None  # single sign-on, when the server is configured for it


class LoginRequired(Exception):
    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class CsrfRejected(Exception):
    pass


class PageRefused(Exception):
    """Answered with the error page and this status (data calls raise OpenAI-shaped errors instead)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RoleRefused(PageRefused):
    """A signed-in user whose role may not do this: 403."""

    def __init__(self, message: str) -> None:
        super().__init__(403, message)


def _refusal(session: AdminSession, *, changes: bool) -> str:
    if session.role == "team":
        return "This page is for administrators; your sign-in covers your own team's keys and usage."
    if changes:
        return f"Your role ({session.role}) can look but not change anything. Ask an administrator."
    return "Your role may not see this page."


def get_dashboard(request: Request) -> Dashboard:
    dashboard: Dashboard = request.app.state.dashboard  # app.dashboard.wiring.install_dashboard's
    return dashboard


DashboardDep = Annotated[Dashboard, Depends(get_dashboard)]


def current_session(request: Request, dashboard: DashboardDep) -> AdminSession | None:
    """Blocking (a database read), so FastAPI runs it in a thread: a logout anywhere ends it here, and
    the role is the database's, never the cookie's."""
    session = dashboard.signer.read(request.cookies.get(SESSION_COOKIE))
    return dashboard.session_store.find(session) if session is not None else None


def member_page_session(
    request: Request, session: Annotated[AdminSession | None, Depends(current_session)]
) -> AdminSession:
    if session is None:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(path)
    return session


def member_data_session(session: Annotated[AdminSession | None, Depends(current_session)]) -> AdminSession:
    if session is None:
        raise OpenAIError(401, "Log in to the dashboard at /admin/login first.", code="invalid_session")
    return session


MemberPage = Annotated[AdminSession, Depends(member_page_session)]
MemberData = Annotated[AdminSession, Depends(member_data_session)]


def page_session(session: MemberPage) -> AdminSession:
    if not session.sees_every_team:
        raise RoleRefused(_refusal(session, changes=False))
    return session


def data_session(session: MemberData) -> AdminSession:
    if not session.sees_every_team:
        raise OpenAIError(403, _refusal(session, changes=False), code="insufficient_role")
    return session


PageSession = Annotated[AdminSession, Depends(page_session)]
DataSession = Annotated[AdminSession, Depends(data_session)]


def actor_of(session: AdminSession, dashboard: Dashboard) -> Actor:
    """Who the audit log says made a change through this dashboard session: an SSO session's subject
    (shown as its email), else the admin credential the session was opened with."""
    if session.subject is not None:
        return sso_actor(session.subject, session.email)
    admin = dashboard.gateway.admin
    return admin.actor if admin is not None else SYSTEM


def sso_actor(subject: str, email: str | None) -> Actor:
    return Actor("sso", subject, email or subject)


def page_actor(session: MemberPage, dashboard: DashboardDep) -> Actor:
    """Any signed-in role: the route's own session dependency says who may come this far."""
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


async def _csrf_checked_form(request: Request, session: AdminSession, dashboard: Dashboard) -> dict[str, str]:
    form = await read_form(request)
    if not dashboard.signer.csrf_ok(session, form.get("csrf_token")):
        raise CsrfRejected()
    return form


async def checked_form(request: Request, session: PageSession, dashboard: DashboardDep) -> dict[str, str]:
    """Every dashboard change: admin only (checked before the body is even read)."""
    if not session.is_admin:
        raise RoleRefused(_refusal(session, changes=True))
    return await _csrf_checked_form(request, session, dashboard)


def checked_header(request: Request, session: DataSession, dashboard: DashboardDep) -> AdminSession:
    if not session.is_admin:
        raise OpenAIError(403, _refusal(session, changes=True), code="insufficient_role")
    if not dashboard.signer.csrf_ok(session, request.headers.get(CSRF_HEADER)):
        raise OpenAIError(403, "Missing or wrong CSRF token.", code="csrf_failed")
    return session


CheckedForm = Annotated[dict[str, str], Depends(checked_form)]
CheckedCall = Annotated[AdminSession, Depends(checked_header)]


@dataclass(frozen=True)
class TeamChange:
    """A team self-service change: the form (CSRF-checked) and who sends it, an admin or a team member.
    The route must check `session.may_manage_team(...)` for the team it touches, and answer another
    team's target with the same 404 as a missing one."""

    session: AdminSession
    form: dict[str, str]


async def member_form(request: Request, session: MemberPage, dashboard: DashboardDep) -> TeamChange:
    if not (session.is_admin or session.role == "team"):
        raise RoleRefused(_refusal(session, changes=True))
    return TeamChange(session, await _csrf_checked_form(request, session, dashboard))


async def signed_in_form(request: Request, session: MemberPage, dashboard: DashboardDep) -> dict[str, str]:
    return await _csrf_checked_form(request, session, dashboard)


MemberForm = Annotated[TeamChange, Depends(member_form)]
SignedInForm = Annotated[dict[str, str], Depends(signed_in_form)]


def login_url(next_path: str | None = None) -> str:
    return "/admin/login" + (f"?next={quote(next_path, safe='')}" if next_path else "")


def safe_next(next_path: str | None) -> str:
    """Only our own pages: never another host ('//evil', 'https://...') and never the login itself."""
    if not next_path or not next_path.startswith("/admin") or next_path.startswith("//") or "\\" in next_path:
        return "/admin"
    if next_path.startswith(("/admin/login", "/admin/logout", "/admin/sso/")):  # no loop back into a login
        return "/admin"
    return next_path
