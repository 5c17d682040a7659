"""Admin dashboard sessions: a signed cookie (HMAC-SHA256) carrying a random id and an expiry, and
CSRF tokens derived from that id. Which sessions are open, and who holds them with what role, is the
database's to say (SessionStore), not a process's or the cookie's: logging out ends the session on every
replica at once. The signer also seals the short-lived state of an SSO sign-in (sealed_cookie)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.audit import Actor, record_change
from app.tables import AdminSession as AdminSessionRow

SESSION_COOKIE = "tokenmill_admin"
LOGIN_COOKIE = "tokenmill_login"  # the login form's CSRF token, before there is a session
SESSION_LIFETIME_S = 8 * 3600
ROLES = ("admin", "viewer", "team")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@dataclass(frozen=True)
class AdminSession:
    session_id: str
    expires_at: float  # unix seconds
    role: str = "admin"  # "admin" (everything), "viewer" (reads every page) or "team" (its team only)
    subject: str | None = None  # the identity provider's subject; None: the admin key (break-glass)
    email: str | None = None
    team_id: int | None = None  # the team of a "team" session

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def sees_every_team(self) -> bool:
        return self.role in ("admin", "viewer")

    def may_manage_team(self, team_id: int | None) -> bool:
        """Self-service: an admin manages any team, a member only their own."""
        return self.is_admin or (self.role == "team" and team_id is not None and team_id == self.team_id)

    def may_see_team(self, team_id: int | None) -> bool:
        return self.sees_every_team or (team_id is not None and team_id == self.team_id)

    @property
    def who(self) -> str:
        return self.email or self.subject or "admin key"


class SessionSigner:
    def __init__(
        self,
        secret: str | bytes | None = None,
        *,
        lifetime_s: float = SESSION_LIFETIME_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if secret is None:
            secret = secrets.token_bytes(32)
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self.lifetime_s = lifetime_s
        self.clock = clock

    def _sign(self, purpose: str, text: str) -> str:
        return _b64(hmac.new(self._secret, f"{purpose}:{text}".encode(), hashlib.sha256).digest())

    def _signed_ok(self, purpose: str, text: str, signature: str) -> bool:
        return hmac.compare_digest(self._sign(purpose, text).encode(), signature.encode())

    # sessions

    def issue(
        self, *, role: str = "admin", subject: str | None = None, email: str | None = None, team_id: int | None = None
    ) -> tuple[AdminSession, str]:
        """A new session and its cookie value (the cookie carries only the id and the expiry)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        session = AdminSession(
            secrets.token_urlsafe(18),
            int(self.clock() + self.lifetime_s),
            role=role,
            subject=subject,
            email=email,
            team_id=team_id,
        )
        body = f"{session.session_id}.{int(session.expires_at)}"
        return session, f"{body}.{self._sign('session', body)}"

    def read(self, cookie: str | None) -> AdminSession | None:
        """The session a cookie carries, if it is signed by us and unexpired (whether it is still open is
        SessionStore's to say)."""
        if not cookie or cookie.count(".") != 2:
            return None
        session_id, expires, signature = cookie.split(".")
        if not self._signed_ok("session", f"{session_id}.{expires}", signature) or not expires.isdigit():
            return None
        if int(expires) <= self.clock():
            return None
        return AdminSession(session_id, int(expires))

    # sealed state (an SSO sign-in between the redirect and the callback)

    def seal(self, purpose: str, data: dict[str, Any], max_age_s: float) -> str:
        """`data` as a tamper-proof (not secret: the browser holds it anyway) cookie value that expires."""
        body = _b64(json.dumps({"data": data, "until": int(self.clock() + max_age_s)}).encode())
        return f"{body}.{self._sign(purpose, body)}"

    def unseal(self, purpose: str, sealed: str | None) -> dict[str, Any] | None:
        if not sealed or sealed.count(".") != 1:
            return None
        body, signature = sealed.split(".")
        if not self._signed_ok(purpose, body, signature):
            return None
        try:
            content = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        except (ValueError, binascii.Error):
            return None
        if not isinstance(content, dict) or not content.get("until", 0) > self.clock():
            return None
        return content.get("data") if isinstance(content.get("data"), dict) else None

    # CSRF

    def csrf_token(self, session: AdminSession) -> str:
        return self._sign("csrf", session.session_id)

    def csrf_ok(self, session: AdminSession, token: str | None) -> bool:
        return bool(token and self._signed_ok("csrf", session.session_id, token))

    def login_token(self) -> tuple[str, str]:
        """For the login form (double submit): the hidden field's token and the cookie that vouches for it."""
        token = secrets.token_urlsafe(18)
        return token, f"{token}.{self._sign('login', token)}"

    def login_token_ok(self, cookie: str | None, token: str | None) -> bool:
        if not cookie or not token or cookie.count(".") != 1:
            return False
        cookie_token, signature = cookie.split(".")
        return self._signed_ok("login", cookie_token, signature) and hmac.compare_digest(cookie_token, token)


def _id_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def _naive_utc(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, UTC).replace(tzinfo=None)


class SessionStore:
    """Open sessions as rows of admin_sessions (by the id's hash). Blocking: run it off the event loop."""

    def __init__(self, sessions: sessionmaker[Session], *, clock: Callable[[], float] = time.time) -> None:
        self.sessions = sessions
        self.clock = clock

    def open(self, session: AdminSession, *, actor: Actor, address: str | None = None) -> None:
        """Opens it, and records the login (who, from where) in the same transaction."""
        now = _naive_utc(self.clock())
        expires_at = _naive_utc(session.expires_at)
        with self.sessions() as db:
            db.execute(delete(AdminSessionRow).where(AdminSessionRow.expires_at <= now))  # expired ones go here
            db.add(
                AdminSessionRow(
                    id_hash=_id_hash(session.session_id),
                    created_at=now,
                    expires_at=expires_at,
                    role=session.role,
                    subject=session.subject,
                    email=session.email,
                    team_id=session.team_id,
                )
            )
            record_change(
                db,
                actor=actor,
                action="session.login",
                target_type="session",
                target_id=None,  # the session's id is the cookie's secret
                after={"address": address, "expires_at": expires_at, "role": session.role, "team_id": session.team_id},
            )
            db.commit()

    def find(self, session: AdminSession) -> AdminSession | None:
        """The session as the database has it (who holds it, with what role), or None once it is closed."""
        with self.sessions() as db:
            row = db.get(AdminSessionRow, _id_hash(session.session_id))
            if row is None or row.expires_at <= _naive_utc(self.clock()):
                return None
            return replace(session, role=row.role, subject=row.subject, email=row.email, team_id=row.team_id)

    def is_open(self, session: AdminSession) -> bool:
        return self.find(session) is not None

    def end(self, session: AdminSession, *, actor: Actor, address: str | None = None) -> None:
        with self.sessions() as db:
            db.execute(delete(AdminSessionRow).where(AdminSessionRow.id_hash == _id_hash(session.session_id)))
            record_change(
                db,
                actor=actor,
                action="session.logout",
                target_type="session",
                target_id=None,
                after={"address": address},
            )
            db.commit()
