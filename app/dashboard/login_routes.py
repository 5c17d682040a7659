"""/admin/login and /admin/logout. The admin key (the break-glass login; single sign-on is in
sso_routes.py) buys a signed, HttpOnly, SameSite=Strict session cookie that expires; the login form
carries its own CSRF token (double submit) before a session exists."""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from app.dashboard.deps import DashboardDep, MemberPage, PageActor, SignedInForm, current_session, read_form, safe_next
from app.dashboard.rendering import render
from app.dashboard.sessions import LOGIN_COOKIE, SESSION_COOKIE, AdminSession
from app.errors import OpenAIError
from app.gateway.audit import Actor, record_alone
from app.gateway.service import client_address

if TYPE_CHECKING:
    from app.dashboard.deps import Dashboard

router = APIRouter()
log = logging.getLogger("tokenmill.dashboard")


def secure_cookies(request: Request) -> bool:
    """Secure cookies over https, and always with --secure-cookies: behind a proxy that ends TLS the app
    sees http (unless --forwarded-allow-ips trusts the proxy's X-Forwarded-Proto)."""
    return request.app.state.context.settings.secure_cookies or request.url.scheme == "https"


def login_page(
    request: Request, dashboard: Dashboard, *, next_path: str, error: str | None = None, status_code: int = 200
) -> Response:
    token, cookie = dashboard.signer.login_token()
    response = render(
        request,
        "login.html",
        None,
        status_code=status_code,
        login_token=token,
        next_path=safe_next(next_path),
        error=error,
        sso_enabled=dashboard.sso is not None,
    )
    response.set_cookie(
        LOGIN_COOKIE,
        cookie,
        max_age=3600,
        path="/admin/login",
        httponly=True,
        samesite="strict",
        secure=secure_cookies(request),
    )
    return response


def set_session_cookie(request: Request, response: Response, dashboard: Dashboard, cookie: str) -> None:
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=int(dashboard.signer.lifetime_s),
        path="/admin",
        httponly=True,
        samesite="strict",
        secure=secure_cookies(request),
    )


@router.get("/admin/login", include_in_schema=False)
def show_login(
    request: Request,
    dashboard: DashboardDep,
    session: Annotated[AdminSession | None, Depends(current_session)],
    next: str = "/admin",
) -> Response:
    if session is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return login_page(request, dashboard, next_path=next)


@router.post("/admin/login", include_in_schema=False)
async def log_in(request: Request, dashboard: DashboardDep) -> Response:
    form = await read_form(request)
    next_path = safe_next(form.get("next"))
    if not dashboard.signer.login_token_ok(request.cookies.get(LOGIN_COOKIE), form.get("csrf_token")):
        return login_page(
            request,
            dashboard,
            next_path=next_path,
            status_code=403,
            error="The form expired or was not ours. Please try again.",
        )
    admin = dashboard.gateway.admin
    presented = form.get("admin_key", "").strip()
    if admin is None or not admin.matches(presented):  # the same failure limit as the API's keys
        refused = dashboard.gateway.auth_failure(request, presented, OpenAIError(401, "That is not the admin key."))
        if refused.status == 401:  # once the limiter answers 429, a flood can't fill the audit log
            await run_in_threadpool(record_failed_login, dashboard, client_address(request))
        response = login_page(
            request, dashboard, next_path=next_path, status_code=refused.status, error=refused.message
        )
        response.headers.update(refused.headers)
        return response
    session, cookie = dashboard.signer.issue()
    await run_in_threadpool(
        partial(dashboard.session_store.open, session, actor=admin.actor, address=client_address(request))
    )
    response = RedirectResponse(next_path, status_code=303)
    set_session_cookie(request, response, dashboard, cookie)
    response.delete_cookie(
        LOGIN_COOKIE, path="/admin/login", httponly=True, samesite="strict", secure=secure_cookies(request)
    )
    return response


def record_failed_login(dashboard: Dashboard, address: str) -> None:
    """Blocking. A store that is away must not turn a refused login into a 500: it is logged instead."""
    try:
        record_alone(
            dashboard.gateway.sessions,
            actor=Actor("admin_key", "unknown", address),
            action="session.login_failed",
            target_type="session",
            target_id=None,
            after={"address": address, "reason": "not the admin key"},
        )
    except SQLAlchemyError as error:
        log.warning("could not record a failed dashboard login from %s: %s", address, type(error).__name__)


@router.post("/admin/logout", include_in_schema=False)
async def log_out(
    request: Request, dashboard: DashboardDep, session: MemberPage, form: SignedInForm, actor: PageActor
) -> Response:
    address = client_address(request)
    await run_in_threadpool(partial(dashboard.session_store.end, session, actor=actor, address=address))  # everywhere
    await run_in_threadpool(dashboard.playground.forget, session.session_id, actor)
    response = RedirectResponse("/admin/login", status_code=303)
    response.delete_cookie(
        SESSION_COOKIE, path="/admin", httponly=True, samesite="strict", secure=secure_cookies(request)
    )
    return response
