"""Admin dashboard sessions: a signed cookie (HMAC-SHA256) carrying a random id and an expiry, and
CSRF tokens derived from that id. Which sessions are open is the database's to say (SessionStore), not
a process's: logging out ends the session on every replica at once."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.audit import Actor, record_change
from app.tables import AdminSession as AdminSessionRow

SESSION_COOKIE = "tokenmill_admin"
LOGIN_COOKIE = "tokenmill_login"  # the login form's CSRF token, before there is a session
SESSION_LIFETIME_S = 8 * 3600


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@dataclass(frozen=True)
class AdminSession:
    session_id: str
    expires_at: float  # unix seconds


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

    def issue(self) -> tuple[AdminSession, str]:
        """A new session and its cookie value."""
        session = AdminSession(secrets.token_urlsafe(18), int(self.clock() + self.lifetime_s))
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

    # CSRF

    def csrf_token(self, session: AdminSession) -> str:
        return self._sign("csrf", session.session_id)

    def csrf_ok(self, session: AdminSession, token: str | None) -> bool:
        return bool(token) and self._signed_ok("csrf", session.session_id, token)

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
            db.add(AdminSessionRow(id_hash=_id_hash(session.session_id), created_at=now, expires_at=expires_at))
            record_change(
                db,
                actor=actor,
                action="session.login",
                target_type="session",
                target_id=None,  # the session's id is the cookie's secret
                after={"address": address, "expires_at": expires_at},
            )
            db.commit()

    def is_open(self, session: AdminSession) -> bool:
        with self.sessions() as db:
            expires_at = db.scalar(
                select(AdminSessionRow.expires_at).where(AdminSessionRow.id_hash == _id_hash(session.session_id))
            )
        return expires_at is not None and expires_at > _naive_utc(self.clock())

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
