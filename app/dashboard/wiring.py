"""Puts the dashboard into the app: its routers under /admin, static files, security headers, the
login redirect, and the live sampler (app.main starts and stops it with the app's lifespan). The
dashboard needs the TeamGateway (the admin key, teams, keys, usage); an app without one gets none."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from app.dashboard import (
    audit_routes,
    batch_routes,
    key_routes,
    login_routes,
    model_routes,
    overview_routes,
    playground_routes,
    sso_routes,
    team_routes,
    usage_routes,
)
from app.dashboard.deps import CsrfRejected, Dashboard, LoginRequired, PageRefused, login_url
from app.dashboard.headers import DashboardHeadersMiddleware
from app.dashboard.live import LiveSampler
from app.dashboard.playground_keys import PlaygroundKeys
from app.dashboard.rendering import WEB_DIR, render
from app.dashboard.sessions import SessionSigner, SessionStore
from app.dashboard.sources import model_sources
from app.dashboard.sso import OidcClient
from app.errors import add_error_handler
from app.gateway.service import TeamGateway

ROUTERS = (
    login_routes,
    sso_routes,
    overview_routes,
    team_routes,
    key_routes,
    usage_routes,
    batch_routes,
    playground_routes,
    model_routes,
    audit_routes,
)


async def _to_login(request: Request, error: LoginRequired) -> Response:
    return RedirectResponse(login_url(error.next_path), status_code=303)


async def _csrf_rejected(request: Request, error: CsrfRejected) -> Response:
    return render(
        request,
        "error.html",
        None,
        status_code=403,
        message="This form is stale or did not come from this dashboard (CSRF check). Reload the page.",
    )


async def _page_refused(request: Request, error: PageRefused) -> Response:
    return render(request, "error.html", None, status_code=error.status, message=error.message)


def known_team_names(gateway: TeamGateway) -> dict[str, str]:
    """The engine's "team:<id>" to names, from the keys the gateway has loaded (a team with requests in
    the engine has one there): no database read on the overview's every poll."""
    return {f"team:{p.team_id}": p.team_name for p in list(gateway.keys.by_key_id.values())}


def install_dashboard(app: FastAPI, gateway: TeamGateway, *, sample_interval_s: float = 1.0) -> Dashboard:
    """Routers, static files, headers and handlers; the caller starts and stops `dashboard.sampler` with
    the app's lifespan."""
    settings = app.state.context.settings
    pool = app.state.context.models
    sampler = LiveSampler(
        lambda: model_sources(app),
        hardware_cost_per_hour=lambda: pool.server_hardware_cost,  # the Models page may change it
        interval_s=sample_interval_s,
        team_names=lambda: known_team_names(gateway),
    )
    dashboard = Dashboard(
        settings=settings,
        gateway=gateway,
        signer=SessionSigner(settings.session_secret),
        session_store=SessionStore(gateway.sessions),
        sampler=sampler,
        playground=PlaygroundKeys(gateway),
        sso=OidcClient(settings.sso) if settings.sso is not None else None,
    )
    app.state.dashboard = dashboard
    for module in ROUTERS:
        app.include_router(module.router)
    app.mount("/admin/static", StaticFiles(directory=WEB_DIR / "static"), name="dashboard-static")
    app.add_middleware(DashboardHeadersMiddleware)
    add_error_handler(app, LoginRequired, _to_login)
    add_error_handler(app, CsrfRejected, _csrf_rejected)
    add_error_handler(app, PageRefused, _page_refused)
    return dashboard
