"""Keyword-only helpers for teams and keys. Callers own the session and the commit. Each change adds
its audit row (app.gateway.audit) to the same session, so the admin API, the dashboard and the CLI,
which all come through here, record every change once and in the change's own transaction."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from app.gateway.audit import Actor, changed, record_change, snapshot
from app.gateway.keys import generate_key, hash_key, visible_prefix
from app.tables import ApiKey, Team

BUDGET_PERIODS = ("day", "month")
LIMIT_FIELDS = ("allowed_models", "rpm_limit", "tpm_limit", "max_budget_usd", "budget_period", "expires_at")


class Conflict(Exception):
    pass


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def to_naive_utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is None:
        return value
    return value.astimezone(UTC).replace(tzinfo=None)


def _clean(fields: dict[str, Any]) -> dict[str, Any]:
    weight = fields.get("scheduling_weight")
    if weight is not None and not 0 < weight <= 1000:  # NaN fails too
        raise ValueError("scheduling_weight must be above 0 and at most 1000")
    if fields.get("budget_period") not in (None, *BUDGET_PERIODS):
        raise ValueError(f"budget_period must be one of {BUDGET_PERIODS}")
    if "allowed_models" in fields:
        fields["allowed_models"] = sorted(set(fields["allowed_models"] or ()))
    if "expires_at" in fields:
        fields["expires_at"] = to_naive_utc(fields["expires_at"])
    if fields.get("budget_period") is None:
        fields.pop("budget_period", None)
    return fields


# teams


def create_team(session: Session, *, actor: Actor, name: str, **limits: Any) -> Team:
    if get_team_by_name(session, name=name) is not None:
        raise Conflict(f"a team named {name!r} exists already")
    fields = _clean({"allowed_models": [], "budget_period": "month", **limits})
    team = Team(name=name, blocked=False, created_at=utcnow(), **fields)
    session.add(team)
    session.flush()
    _record(session, actor, "team.create", team, None, snapshot(team))
    return team


def get_team(session: Session, *, team_id: int) -> Team | None:
    team = session.get(Team, team_id)
    return team if team is not None and team.deleted_at is None else None


def get_team_by_name(session: Session, *, name: str) -> Team | None:
    return session.scalar(select(Team).where(Team.name == name, Team.deleted_at.is_(None)))


def list_teams(session: Session, *, limit: int = 100, after: int | None = None) -> Sequence[Team]:
    query = select(Team).where(Team.deleted_at.is_(None)).order_by(Team.id).limit(limit)
    if after is not None:
        query = query.where(Team.id > after)
    return session.scalars(query).all()


def update_team(session: Session, *, actor: Actor, team: Team, **fields: Any) -> Team:
    fields = _clean(fields)
    if "name" in fields and fields["name"] != team.name and get_team_by_name(session, name=fields["name"]):
        raise Conflict(f"a team named {fields['name']!r} exists already")
    before = snapshot(team)
    for name, value in fields.items():
        setattr(team, name, value)
    session.flush()
    _record(session, actor, "team.update", team, *changed(before, snapshot(team)))
    return team


def delete_team(session: Session, *, actor: Actor, team: Team) -> list[str]:
    """Soft delete (usage history keeps its team id); revokes the team's keys. Returns the hashes that
    stop working (rotated keys' previous secrets too)."""
    now = utcnow()
    before = snapshot(team)
    team.deleted_at = now
    live = list(session.scalars(select(ApiKey).where(ApiKey.team_id == team.id, ApiKey.revoked_at.is_(None))))
    hashes = [h for key in live for h in (key.key_hash, key.previous_key_hash) if h]
    session.execute(update(ApiKey).where(ApiKey.team_id == team.id, ApiKey.revoked_at.is_(None)).values(revoked_at=now))
    session.flush()
    after = {**snapshot(team), "keys_revoked": [key.id for key in live]}
    _record(session, actor, "team.delete", team, *changed(before, after))
    return hashes


# keys


def create_key(
    session: Session, *, actor: Actor, team: Team, name: str = "", plaintext: str | None = None, **limits: Any
) -> tuple[ApiKey, str]:
    """Returns the row and the plaintext key (generated unless the operator chose one, as with
    `tokenmill serve --api-key`); the plaintext exists nowhere else afterwards."""
    plaintext = plaintext or generate_key()
    fields = _clean({"allowed_models": [], "budget_period": "month", **limits})
    key = ApiKey(
        team_id=team.id,
        name=name,
        key_hash=hash_key(plaintext),
        key_prefix=visible_prefix(plaintext),
        created_at=utcnow(),
        **fields,
    )
    session.add(key)
    session.flush()
    _record(session, actor, "key.create", key, None, snapshot(key))
    return key, plaintext


def get_key(session: Session, *, key_id: int) -> ApiKey | None:
    return session.get(ApiKey, key_id)


def find_key(session: Session, *, key_hash: str) -> tuple[ApiKey, Team] | None:
    """The key whose secret hashes to `key_hash`: its current one, or the one it had before its last
    rotation (principal_of tells them apart and ends the old one's life at its grace)."""
    row = session.execute(
        select(ApiKey, Team)
        .join(Team, Team.id == ApiKey.team_id)
        .where(or_(ApiKey.key_hash == key_hash, ApiKey.previous_key_hash == key_hash))
    ).first()
    return (row[0], row[1]) if row else None


def list_keys(
    session: Session,
    *,
    team_id: int | None = None,
    include_revoked: bool = False,
    limit: int = 100,
    after: int | None = None,
) -> Sequence[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.id).limit(limit)
    if team_id is not None:
        query = query.where(ApiKey.team_id == team_id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    if after is not None:
        query = query.where(ApiKey.id > after)
    return session.scalars(query).all()


def update_key(session: Session, *, actor: Actor, key: ApiKey, **fields: Any) -> ApiKey:
    before = snapshot(key)
    for name, value in _clean(fields).items():
        setattr(key, name, value)
    session.flush()
    _record(session, actor, "key.update", key, *changed(before, snapshot(key)))
    return key


def revoke_key(session: Session, *, actor: Actor, key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        before = snapshot(key)
        key.revoked_at = utcnow()
        session.flush()
        _record(session, actor, "key.revoke", key, *changed(before, snapshot(key)))
    return key


MAX_GRACE_PERIOD_S = 30 * 86400


def rotate_key(session: Session, *, actor: Actor, key: ApiKey, grace_period_s: float) -> tuple[ApiKey, str, list[str]]:
    """A new secret for the same key (id, limits, usage); the current one keeps working for
    `grace_period_s` more seconds, and a secret from an earlier rotation stops now. Returns the key, the
    new plaintext (shown once) and the hashes whose cached principals are stale."""
    if key.revoked_at is not None:
        raise Conflict(f"key {key.id} is revoked; create a new key instead")
    if not 0 <= grace_period_s <= MAX_GRACE_PERIOD_S:  # NaN fails too
        raise ValueError(f"grace_period_s must be between 0 and {MAX_GRACE_PERIOD_S}")
    stale = [h for h in (key.key_hash, key.previous_key_hash) if h]
    before = snapshot(key)
    plaintext = generate_key()
    now = utcnow()
    key.previous_key_hash, key.previous_key_prefix = key.key_hash, key.key_prefix
    key.previous_key_expires_at = now + timedelta(seconds=grace_period_s)
    key.key_hash, key.key_prefix = hash_key(plaintext), visible_prefix(plaintext)
    key.rotated_at = now
    session.flush()
    _record(session, actor, "key.rotate", key, *changed(before, snapshot(key)))
    return key, plaintext, stale


def _record(
    session: Session,
    actor: Actor,
    action: str,
    row: Team | ApiKey,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    if before == after == {}:  # an update that changed nothing is no change to record
        return
    target_type = action.partition(".")[0]
    record_change(
        session, actor=actor, action=action, target_type=target_type, target_id=str(row.id), before=before, after=after
    )


def touch_last_used(session: Session, *, key_times: dict[int, datetime], team_times: dict[int, datetime]) -> None:
    """One batched UPDATE per table per flush, however many requests came in between."""
    if key_times:
        session.execute(update(ApiKey), [{"id": k, "last_used_at": t} for k, t in sorted(key_times.items())])
    if team_times:
        session.execute(update(Team), [{"id": k, "last_used_at": t} for k, t in sorted(team_times.items())])
