"""Single sign-on's protocol: OpenID Connect's authorization-code flow with PKCE, done by Authlib's
Starlette client (discovery, state, nonce, PKCE, the token exchange, the ID token's signature, issuer,
audience and expiry). We add only where its per-sign-in state lives between the redirect and the
callback: Authlib keeps it in `request.session`, which we fill from, and save to, a sealed cookie
(sso_routes.py) instead of installing a session middleware for the whole app."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import Response

from app.dashboard.sso_config import SsoConfig

# Authlib and joserfc (and the cryptography they pull in) are imported by the client, not by this module: every
# server imports the dashboard's routes, few sign in through a provider, and at the top they held 9-14 MiB of
# every server's memory from its start (a 1B GGUF server's restart, A/B, 2-core EPYC Zen 3).

LEEWAY_S = 60  # clock skew allowed between us and the provider on the ID token's exp / iat
PROVIDER_TIMEOUT_S = 10.0


def provider_errors() -> tuple[type[Exception], ...]:
    """What a provider that is down or talks nonsense raises on the way (discovery, keys, token exchange)."""
    import httpx

    try:  # Authlib's client speaks httpx2 where it is installed (huggingface_hub brings it), else httpx
        import httpx2

        http: tuple[type[Exception], ...] = (httpx.HTTPError, httpx2.HTTPError)
    except ImportError:  # pragma: no cover - depends on what else is installed
        http = (httpx.HTTPError,)
    return (*http, ValueError, KeyError, RuntimeError)


class SsoRefused(Exception):
    """The sign-in failed its checks (state, code, ID token) or the provider said no: 401."""


class ProviderUnreachable(Exception):
    """The provider did not answer, or answered nonsense (discovery, token, keys): 502."""


class OidcClient:
    def __init__(self, config: SsoConfig) -> None:
        from authlib.integrations.starlette_client import OAuth

        self.config = config
        self.provider_errors = provider_errors()
        oauth = OAuth()
        self.client: Any = oauth.register(
            "tokenmill",
            client_id=config.client_id,
            client_secret=config.client_secret,
            server_metadata_url=config.discovery_url,
            client_kwargs={
                "scope": config.scopes,
                "code_challenge_method": "S256",
                "token_endpoint_auth_method": "client_secret_basic" if config.client_secret else "none",
                "timeout": PROVIDER_TIMEOUT_S,
            },
        )

    async def _issuer(self) -> str:
        """The issuer as discovery names it, which must be the one we were configured with: a provider
        that answers for another issuer is refused before any token of it is believed."""
        metadata = await self.client.load_server_metadata()
        issuer = str(metadata.get("issuer", ""))
        if issuer.rstrip("/") != self.config.issuer:
            raise ProviderUnreachable(f"Discovery at {self.config.discovery_url} names issuer {issuer!r}.")
        return issuer

    def _claims_options(self, issuer: str) -> dict[str, Any]:
        """What Authlib checks the ID token's claims against. `aud` is spelled out: Authlib's own ID token
        check (1.9.6) accepts an audience that lacks our client id as long as `azp` names it, and OpenID
        Connect Core 3.1.3.7 says the audience must contain it."""
        return {
            "iss": {"essential": True, "values": [issuer]},
            "aud": {"essential": True, "value": self.config.client_id},
        }

    async def start(self, request: Request, redirect_uri: str) -> tuple[Response, dict[str, Any]]:
        """The redirect to the provider's login, and the state to keep until its callback (state,
        nonce, PKCE verifier, redirect URI)."""
        request.scope["session"] = {}
        try:
            await self._issuer()
            response = await self.client.authorize_redirect(request, redirect_uri)
        except self.provider_errors as error:
            raise ProviderUnreachable(
                f"The identity provider at {self.config.issuer} did not answer ({error})."
            ) from None
        return response, dict(request.scope["session"])

    async def finish(self, request: Request, kept: dict[str, Any]) -> dict[str, Any]:
        """The ID token's verified claims for the callback `request`, given what `start` kept."""
        from authlib.common.errors import AuthlibBaseError
        from joserfc.errors import JoseError

        request.scope["session"] = dict(kept)
        try:
            issuer = await self._issuer()
            token = await self.client.authorize_access_token(
                request, leeway=LEEWAY_S, claims_options=self._claims_options(issuer)
            )
            if "userinfo" not in token:
                raise SsoRefused("The identity provider sent no ID token.")
            claims = dict(token["userinfo"])
            group_claim = self.config.group_claim
            if group_claim and group_claim not in claims:  # some providers list groups in userinfo only
                info = await self.client.userinfo(token=token)
                if group_claim in info:
                    claims[group_claim] = info[group_claim]
        except (AuthlibBaseError, JoseError) as error:  # before provider_errors: some are ValueErrors too
            description = getattr(error, "description", None) or getattr(error, "error", None) or str(error)
            raise SsoRefused(f"Sign-in refused: {description}") from None
        except self.provider_errors as error:
            raise ProviderUnreachable(
                f"The identity provider at {self.config.issuer} did not answer ({error})."
            ) from None
        return claims
