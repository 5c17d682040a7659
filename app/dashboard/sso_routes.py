"""/admin/sso/login and /admin/sso/callback: sign in through the company's identity provider (OpenID
Connect). The sign-in's state (state, nonce, PKCE verifier) waits in a sealed, HttpOnly cookie scoped to
/admin/sso; the callback checks it all (Authlib), maps the claims to a role and opens a dashboard
session like the admin key's, carrying the subject, email, role and team."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from app.dashboard.deps import Dashboard, DashboardDep, PageRefused, safe_next, sso_actor
from app.dashboard.login_routes import login_page, secure_cookies, set_session_cookie
from app.dashboard.rendering import render
from app.dashboard.sso import OidcClient, ProviderUnreachable, SsoRefused
from app.dashboard.sso_config import SsoDenied, SsoIdentity, identity_from_claims
from app.gateway import crud
from app.gateway.audit import record_alone
from app.gateway.service import client_address

router = APIRouter()
SSO_COOKIE = "tokenmill_sso"
SSO_COOKIE_PATH = "/admin/sso"
SIGN_IN_MAX_AGE_S = 600  # from the redirect to the provider until its callback


def _sso(dashboard: Dashboard) -> OidcClient:
    if dashboard.sso is None:
        raise PageRefused(404, "Single sign-on is not configured on this server.")
    return dashboard.sso


@router.get("/admin/sso/login", include_in_schema=False)
async def start_sign_in(request: Request, dashboard: DashboardDep, next: str = "/admin") -> Response:
    """A GET (a link, not a form): the page's CSP (form-action 'self') would stop a form's redirect to
    the provider. Login CSRF is still covered: the callback needs this browser's sealed state."""
    sso = _sso(dashboard)
    redirect_uri = sso.config.redirect_url or str(request.url_for("sso_callback"))
    try:
        response, kept = await sso.start(request, redirect_uri)
    except ProviderUnreachable as error:
        return login_page(request, dashboard, next_path=next, error=str(error), status_code=502)
    sealed = dashboard.signer.seal("sso", {"authlib": kept, "next": safe_next(next)}, SIGN_IN_MAX_AGE_S)
    # Lax, not Strict: the provider's redirect back to us is a cross-site navigation.
    response.set_cookie(
        SSO_COOKIE,
        sealed,
        max_age=SIGN_IN_MAX_AGE_S,
        path=SSO_COOKIE_PATH,
        httponly=True,
        samesite="lax",
        secure=secure_cookies(request),
    )
    return response


def _team_id(dashboard: Dashboard, name: str) -> int | None:
    with dashboard.gateway.sessions() as db:
        team = crud.get_team_by_name(db, name=name)
        return team.id if team is not None else None


async def _role_of(dashboard: Dashboard, claims: dict[str, Any]) -> tuple[SsoIdentity, int | None]:
    """The identity the verified claims earn, and its team's id; SsoDenied when they earn none."""
    identity = identity_from_claims(claims, _sso(dashboard).config)
    if identity.team_name is None:
        return identity, None
    team_id = await run_in_threadpool(_team_id, dashboard, identity.team_name)
    if team_id is None:
        raise SsoDenied(f"Your role is team {identity.team_name!r}, and there is no such team. Ask an administrator.")
    return identity, team_id


@router.get("/admin/sso/callback", name="sso_callback", include_in_schema=False)
async def finish_sign_in(request: Request, dashboard: DashboardDep) -> Response:
    flow = dashboard.signer.unseal("sso", request.cookies.get(SSO_COOKIE))
    if flow is None:  # not recorded: anyone can call this URL, and the audit log is not for floods
        return _refused(request, dashboard, "/admin", 400, "This sign-in expired or did not start here. Try again.")
    next_path = safe_next(flow.get("next"))
    claims: dict[str, Any] = {}
    try:
        claims = await _sso(dashboard).finish(request, flow.get("authlib") or {})
        identity, team_id = await _role_of(dashboard, claims)
    except (SsoRefused, SsoDenied, ProviderUnreachable) as error:
        status = 401 if isinstance(error, SsoRefused) else 403 if isinstance(error, SsoDenied) else 502
        await run_in_threadpool(_record_refusal, request, dashboard, claims, str(error))
        return _refused(request, dashboard, next_path, status, str(error))
    session, cookie = dashboard.signer.issue(
        role=identity.role, subject=identity.subject, email=identity.email, team_id=team_id
    )
    actor = sso_actor(identity.subject, identity.email)
    await run_in_threadpool(
        partial(dashboard.session_store.open, session, actor=actor, address=client_address(request))
    )
    # A page, not a redirect: the session cookie is SameSite=Strict, and a browser withholds it from the
    # rest of a redirect chain that began at the provider's site. The page's own refresh is same-site.
    if session.role == "team":
        next_path = next_path if next_path != "/admin" else f"/admin/teams/{team_id}"
    response = render(
        request, "signed_in.html", None, next_path=next_path, who=session.who, signed_in_role=session.role
    )
    set_session_cookie(request, response, dashboard, cookie)
    _forget_sign_in(request, response)
    return response


def _record_refusal(request: Request, dashboard: Dashboard, claims: dict[str, Any], reason: str) -> None:
    """A failed SSO sign-in in the audit log: who, when the provider got as far as saying so."""
    subject = str(claims.get("sub") or "unknown")
    record_alone(
        dashboard.gateway.sessions,
        actor=sso_actor(subject, str(claims.get("email") or "") or client_address(request)),
        action="session.login_failed",
        target_type="session",
        target_id=None,
        after={"address": client_address(request), "reason": reason, "via": "sso"},
    )


def _forget_sign_in(request: Request, response: Response) -> None:
    response.delete_cookie(
        SSO_COOKIE, path=SSO_COOKIE_PATH, httponly=True, samesite="lax", secure=secure_cookies(request)
    )


def _refused(request: Request, dashboard: Dashboard, next_path: str, status: int, message: str) -> Response:
    response = login_page(request, dashboard, next_path=next_path, error=message, status_code=status)
    _forget_sign_in(request, response)
    return response
