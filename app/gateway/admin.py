"""What an admin does to teams and keys, for both the admin API (app.api.admin) and the dashboard's
forms (app.dashboard): one transaction each (the change and its audit row), and the gateway's key cache
told what changed. `actor` is who asks: the admin key, an SSO user, the system."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from app.errors import OpenAIError
from app.gateway import crud
from app.gateway.audit import Actor
from app.gateway.schemas import (
    KeyCreate,
    KeyCreated,
    KeyRotate,
    KeyRotated,
    KeyUpdate,
    KeyView,
    TeamCreate,
    TeamUpdate,
    TeamView,
)
from app.gateway.service import TeamGateway
from app.tables import ApiKey

if TYPE_CHECKING:
    from pydantic import BaseModel


def not_found(what: str, ident: int) -> OpenAIError:
    return OpenAIError(404, f"No {what} with id {ident}.", code="not_found")


def _commit(session: Session) -> None:
    try:
        session.commit()
    except Exception:
        session.rollback()
        raise


def _changes(body: BaseModel) -> dict[str, Any]:
    return body.model_dump(exclude_unset=True)


def _conflict(error: crud.Conflict) -> OpenAIError:
    return OpenAIError(409, str(error), code="conflict")


# teams


def _secrets_of(key: ApiKey) -> list[str]:
    """The hashes a key answers to: its secret, and the one before its last rotation."""
    return [h for h in (key.key_hash, key.previous_key_hash) if h]


def create_team(body: TeamCreate, session: Session, *, actor: Actor) -> TeamView:
    try:
        team = crud.create_team(session, actor=actor, **_changes(body))
    except crud.Conflict as error:
        raise _conflict(error) from None
    _commit(session)
    return TeamView.of(team)


def get_team(team_id: int, session: Session) -> TeamView:
    team = crud.get_team(session, team_id=team_id)
    if team is None:
        raise not_found("team", team_id)
    return TeamView.of(team)


def update_team(team_id: int, body: TeamUpdate, session: Session, gateway: TeamGateway, *, actor: Actor) -> TeamView:
    team = crud.get_team(session, team_id=team_id)
    if team is None:
        raise not_found("team", team_id)
    try:
        crud.update_team(session, actor=actor, team=team, **_changes(body))
    except crud.Conflict as error:
        raise _conflict(error) from None
    _commit(session)
    gateway.forget_keys()
    return TeamView.of(team)


def delete_team(team_id: int, session: Session, gateway: TeamGateway, *, actor: Actor) -> dict[str, Any]:
    team = crud.get_team(session, team_id=team_id)
    if team is None:
        raise not_found("team", team_id)
    revoked = crud.delete_team(session, actor=actor, team=team)
    _commit(session)
    gateway.forget_keys(revoked)
    gateway.forget_keys()
    return {"id": team_id, "object": "team", "deleted": True, "keys_revoked": len(revoked)}


# keys


def create_key(body: KeyCreate, session: Session, *, actor: Actor) -> KeyCreated:
    fields = _changes(body)
    team = crud.get_team(session, team_id=fields.pop("team_id"))
    if team is None:
        raise OpenAIError(404, f"No team with id {body.team_id}.", param="team_id", code="not_found")
    key, plaintext = crud.create_key(session, actor=actor, team=team, **fields)
    _commit(session)
    return KeyCreated(**KeyView.of(key).model_dump(), key=plaintext)


def get_key(key_id: int, session: Session) -> KeyView:
    key = crud.get_key(session, key_id=key_id)
    if key is None:
        raise not_found("key", key_id)
    return KeyView.of(key)


def update_key(key_id: int, body: KeyUpdate, session: Session, gateway: TeamGateway, *, actor: Actor) -> KeyView:
    key = crud.get_key(session, key_id=key_id)
    if key is None:
        raise not_found("key", key_id)
    crud.update_key(session, actor=actor, key=key, **_changes(body))
    _commit(session)
    gateway.forget_keys(_secrets_of(key))
    return KeyView.of(key)


def revoke_key(key_id: int, session: Session, gateway: TeamGateway, *, actor: Actor) -> KeyView:
    """Revokes the key (rows keep pointing at it; it answers 401 from now on)."""
    key = crud.get_key(session, key_id=key_id)
    if key is None:
        raise not_found("key", key_id)
    crud.revoke_key(session, actor=actor, key=key)
    _commit(session)
    gateway.forget_keys(_secrets_of(key))
    return KeyView.of(key)


def rotate_key(key_id: int, body: KeyRotate, session: Session, gateway: TeamGateway, *, actor: Actor) -> KeyRotated:
    """A new secret under the same key id; the old one works until the grace period ends (its cached
    principal is dropped here, so it comes back with the grace's end as its expiry)."""
    key = crud.get_key(session, key_id=key_id)
    if key is None:
        raise not_found("key", key_id)
    try:
        key, plaintext, stale = crud.rotate_key(session, actor=actor, key=key, grace_period_s=body.grace_period_s)
    except crud.Conflict as error:
        raise _conflict(error) from None
    _commit(session)
    gateway.forget_keys(stale)
    return KeyRotated(**KeyView.of(key).model_dump(), key=plaintext)
