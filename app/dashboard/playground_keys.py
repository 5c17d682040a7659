"""Short-lived API keys for the playground. The playground calls the real /v1 route with a real key of
the `playground` team, so its requests are authenticated, rate-limited and metered like any other.
One key per admin session, expiring within the hour, revoked at logout; the plaintext lives only in
this process's memory and the page's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy.exc import IntegrityError

from app.errors import OpenAIError
from app.gateway import admin, crud
from app.gateway.audit import Actor
from app.gateway.schemas import KeyCreate, TeamCreate

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from app.gateway.service import TeamGateway

PLAYGROUND_TEAM = "playground"
KEY_LIFETIME_S = 3600
REUSE_MARGIN_S = 300  # mint a fresh key rather than hand out one about to expire


@dataclass(frozen=True)
class PlaygroundKey:
    key: str
    key_id: int
    team_id: int
    expires_at: float  # unix seconds


class PlaygroundKeys:
    def __init__(self, gateway: TeamGateway, *, clock: Callable[[], float] = time.time) -> None:
        self.gateway = gateway
        self.clock = clock
        self._by_session: dict[str, PlaygroundKey] = {}
        self._lock = threading.Lock()

    def key_for(self, session_id: str, actor: Actor) -> PlaygroundKey:
        """Blocking (database): run it in a thread. `actor`: the session's admin, in the audit log."""
        with self._lock:
            existing = self._by_session.get(session_id)
            if existing is not None and existing.expires_at - self.clock() > REUSE_MARGIN_S:
                return existing
            minted = self._mint(actor)
            self._by_session[session_id] = minted
            return minted

    def _mint(self, actor: Actor) -> PlaygroundKey:
        expires_at = int(self.clock() + KEY_LIFETIME_S)
        expires = datetime.fromtimestamp(expires_at, UTC)
        with self.gateway.sessions() as session:
            team_id = self._team_id(session, actor)
            created = admin.create_key(
                KeyCreate(team_id=team_id, name="dashboard playground", expires_at=expires), session, actor=actor
            )
        return PlaygroundKey(created.key, created.id, team_id, expires_at)

    @staticmethod
    def _team_id(session: Session, actor: Actor) -> int:
        team = crud.get_team_by_name(session, name=PLAYGROUND_TEAM)
        if team is not None:
            return team.id
        try:
            return admin.create_team(TeamCreate(name=PLAYGROUND_TEAM), session, actor=actor).id
        except (OpenAIError, IntegrityError):  # another replica made it first
            session.rollback()
            team = crud.get_team_by_name(session, name=PLAYGROUND_TEAM)
            assert team is not None  # the other replica's
            return team.id

    def forget(self, session_id: str, actor: Actor) -> None:
        """At logout: revoke the session's key. Blocking (database)."""
        with self._lock:
            minted = self._by_session.pop(session_id, None)
        if minted is None:
            return
        with self.gateway.sessions() as session:
            admin.revoke_key(minted.key_id, session, self.gateway, actor=actor)
