"""A real OpenID Connect provider for the SSO tests: oidc-provider-mock (Authlib's server side, signing
real RS256 ID tokens) in a thread on localhost, with clients registered the standard way (RFC 7591) and
users whose claims the test sets. Its authorization page is a form: `authorize` submits it as the user
would, and returns where the provider sends the browser back to."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx
import pytest

from tests.support.dashboard import page_csrf

ADMIN_GROUP = "tm-admins"
VIEWER_GROUP = "tm-viewers"
ML_GROUP = "ml-team"


@dataclass
class Provider:
    issuer: str
    http: httpx.Client

    def register_client(self, redirect_uri: str) -> tuple[str, str]:
        response = self.http.post("/oauth2/clients", json={"redirect_uris": [redirect_uri]})
        assert response.status_code == 201, response.text
        return response.json()["client_id"], response.json()["client_secret"]

    def set_user(self, sub: str, **claims) -> None:
        """Claims go into the ID token as given: `aud` or `exp` among them override the provider's own,
        which is how a test gets a real, signed token for another audience or one already expired."""
        assert self.http.put(f"/users/{sub}", json=claims).status_code == 204

    def authorize(self, authorization_url: str, sub: str) -> str:
        """Sign in as `sub` on the provider's page; the URL it redirects the browser to (our callback)."""
        assert authorization_url.startswith(self.issuer + "/"), authorization_url
        response = self.http.post(authorization_url, data={"sub": sub})
        assert response.status_code == 302, response.text
        return response.headers["location"]


@contextmanager
def running_provider() -> Iterator[Provider]:
    try:
        from oidc_provider_mock import run_server_in_thread
    except ImportError:
        pytest.skip("oidc-provider-mock is not installed (pip install -e '.[test]')")
    with run_server_in_thread(require_client_registration=True, require_nonce=True) as server:
        issuer = f"http://localhost:{server.server_port}"
        with httpx.Client(base_url=issuer, timeout=10) as http:
            yield Provider(issuer, http)


def sso_settings(provider: Provider, redirect_uri: str, **overrides) -> dict:
    """Settings for a dashboard whose users come from `provider`: example.com people are viewers,
    ops.example.com people admins; groups map to admin, viewer and team ml."""
    client_id, client_secret = provider.register_client(redirect_uri)
    return {
        "oidc_issuer": provider.issuer,
        "oidc_client_id": client_id,
        "oidc_client_secret": client_secret,
        "oidc_allowed_domains": "example.com=viewer, ops.example.com=admin, partner.test",
        "oidc_group_claim": "groups",
        "oidc_group_roles": f"{ADMIN_GROUP}=admin, {VIEWER_GROUP}=viewer, {ML_GROUP}=team:ml",
        **overrides,
    }


def path_of(url: str) -> str:
    parts = urlparse(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


def sso_log_in(dashboard, provider: Provider, sub: str, *, next_path: str = "/admin") -> httpx.Response:
    """The whole sign-in through the dashboard's TestClient: start, the provider's page, the callback."""
    start = dashboard.client.get("/admin/sso/login", params={"next": next_path}, follow_redirects=False)
    assert start.status_code == 302, start.text
    callback = provider.authorize(start.headers["location"], sub)
    response = dashboard.client.get(path_of(callback), follow_redirects=False)
    if response.status_code == 200:
        landing = re.search(r'http-equiv="refresh" content="0;url=([^"]+)"', response.text).group(1)
        dashboard.csrf = page_csrf(dashboard.client.get(landing).text)
    return response
