"""Single sign-on's settings and the one rule that turns an identity provider's claims into a dashboard
role. Pure: no HTTP, no database (the protocol is Authlib's, in sso.py; a team's id is looked up there).

Roles: "admin" (everything), "viewer" (every page, no change) and "team:<name>" (that team's keys and
usage only). A user gets the strongest role that their email domain or their groups map to; a user whose
domain is not allowed, or who maps to no role, is refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

ROLE_RANK = {"admin": 0, "viewer": 1, "team": 2}  # lower is stronger
DEFAULT_SCOPES = "openid email profile"


def parse_role(text: str) -> str:
    """'admin', 'viewer' or 'team:<name>' (the name as it is on the Teams page)."""
    role = text.strip()
    if role in ("admin", "viewer") or (role.startswith("team:") and role[5:].strip()):
        return role if not role.startswith("team:") else "team:" + role[5:].strip()
    raise ValueError(f"{text.strip()!r} is not a role: use admin, viewer or team:<name>")


def _pairs(text: str, what: str) -> list[tuple[str, str | None]]:
    """'a, b=admin, c=team:ml' as [('a', None), ('b', 'admin'), ('c', 'team:ml')]."""
    pairs: list[tuple[str, str | None]] = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, role = entry.partition("=")
        if not name.strip():
            raise ValueError(f"{what}: {entry!r} has no name before '='")
        pairs.append((name.strip(), parse_role(role) if sep else None))
    return pairs


@dataclass(frozen=True)
class SsoConfig:
    issuer: str
    client_id: str
    client_secret: str | None
    # Email domain -> the role it grants (None: the domain may sign in, its role comes from groups).
    # Empty: any domain may sign in.
    domains: Mapping[str, str | None]
    group_claim: str | None
    group_roles: Mapping[str, str]
    scopes: str = DEFAULT_SCOPES
    redirect_url: str | None = None  # the callback as the provider knows it; None: from the request

    @classmethod
    def parse(
        cls,
        *,
        issuer: str,
        client_id: str,
        client_secret: str | None,
        allowed_domains: str,
        group_claim: str,
        group_roles: str,
        scopes: str,
        redirect_url: str,
    ) -> SsoConfig:
        """Raises ValueError naming what is wrong (Settings turns it into a SettingsError)."""
        if urlparse(issuer).scheme not in ("http", "https") or not urlparse(issuer).netloc:
            raise ValueError(f"oidc_issuer must be an http(s) URL, got {issuer!r}")
        if not client_id:
            raise ValueError("oidc_client_id is required with oidc_issuer")
        domains = {name.lower().lstrip("@"): role for name, role in _pairs(allowed_domains, "oidc_allowed_domains")}
        roles: dict[str, str] = {}
        for group, role in _pairs(group_roles, "oidc_group_roles"):
            if role is None:
                raise ValueError(f"oidc_group_roles: {group!r} needs a role (group=admin, group=team:<name>)")
            roles[group] = role
        if roles and not group_claim:
            raise ValueError("oidc_group_roles needs oidc_group_claim (the claim that lists a user's groups)")
        if not roles and not any(domains.values()):
            raise ValueError(
                "SSO grants no role: map a domain (oidc_allowed_domains=example.com=viewer) or groups "
                "(oidc_group_claim and oidc_group_roles)"
            )
        if "openid" not in scopes.split():
            raise ValueError("oidc_scopes must include openid")
        return cls(
            issuer=issuer.rstrip("/"),
            client_id=client_id,
            client_secret=client_secret or None,
            domains=domains,
            group_claim=group_claim or None,
            group_roles=roles,
            scopes=scopes,
            redirect_url=redirect_url or None,
        )

    @property
    def discovery_url(self) -> str:
        return self.issuer + "/.well-known/openid-configuration"


@dataclass(frozen=True)
class SsoIdentity:
    subject: str
    email: str
    role: str  # "admin", "viewer" or "team"
    team_name: str | None = None


class SsoDenied(Exception):
    """The provider vouched for the user, but our settings give them no way in; the message says why."""


def _groups(claims: Mapping[str, Any], claim: str | None) -> list[str]:
    if not claim:
        return []
    value = claims.get(claim)
    if isinstance(value, str):
        return [value]
    return [str(group) for group in value] if isinstance(value, list) else []


def identity_from_claims(claims: Mapping[str, Any], config: SsoConfig) -> SsoIdentity:
    """The role the ID token's claims earn, or SsoDenied. The claims are already verified (signature,
    issuer, audience, expiry, nonce): this only reads them."""
    subject = str(claims.get("sub") or "")
    email = str(claims.get("email") or "").strip()
    if not subject:
        raise SsoDenied("The identity provider sent no subject.")
    if claims.get("email_verified") is False:  # absent is fine: many providers only send verified emails
        raise SsoDenied(f"The identity provider has not verified {email or 'your email'}.")
    domain = email.rpartition("@")[2].lower() if "@" in email else ""
    if config.domains and domain not in config.domains:
        raise SsoDenied(f"{email or 'An account without an email'} may not sign in here (domain not allowed).")
    granted = [role for role in (config.domains.get(domain),) if role]
    granted += [
        config.group_roles[group] for group in _groups(claims, config.group_claim) if group in config.group_roles
    ]
    if not granted:
        raise SsoDenied(f"{email or subject} has no role on this dashboard. Ask an administrator.")
    strongest = min(granted, key=lambda role: ROLE_RANK[role.partition(":")[0]])
    kind, _, team = strongest.partition(":")
    return SsoIdentity(subject=subject, email=email, role=kind, team_name=team or None)
