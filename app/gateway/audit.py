"""The audit log: who changed what, when, with the values before and after. One row per admin change,
added to the caller's session so it commits (or rolls back) with the change itself. It never holds a
secret: fields named like one (DENIED_FIELDS, or ending in _hash / _secret / _password / _token) are
replaced by REDACTED before the row is built.

Actions are "<target_type>.<verb>": team.create, key.rotate, model.update, settings.update,
session.login, batch.cancel ... (the target_type is the part before the dot)."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Literal

from sqlalchemy import inspect
from sqlalchemy.orm import Session, sessionmaker

from app.tables import AuditEntry

ActorKind = Literal["admin_key", "sso", "cli", "system"]


@dataclass(frozen=True)
class Actor:
    """Who made a change. id: the admin credential's id ("env" for TOKENMILL_ADMIN_KEY), the SSO
    subject, the OS user for the CLI; display: what a person reads (an email, a key prefix)."""

    kind: ActorKind
    id: str
    display: str = ""


SYSTEM = Actor("system", "tokenmill", "the server itself")

REDACTED = "[redacted]"
DENIED_FIELDS = frozenset(
    {"key", "key_hash", "previous_key_hash", "plaintext", "api_key", "admin_key", "secret", "client_secret"}
    | {"password", "token", "id_hash", "session_secret", "cookie", "authorization"}
)
DENIED_SUFFIXES = ("_hash", "_secret", "_password", "_token", "_key")
# Row columns that change without anyone deciding it: not worth a diff line.
NOISE_FIELDS = frozenset({"last_used_at", "updated_at"})


def is_secret_field(name: str) -> bool:
    lowered = name.lower()
    return lowered in DENIED_FIELDS or lowered.endswith(DENIED_SUFFIXES)


def scrubbed(values: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """JSON-safe copy with every secret-named field (at any depth) replaced by REDACTED."""
    if values is None:
        return None
    return {str(name): REDACTED if is_secret_field(str(name)) else _jsonable(value) for name, value in values.items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return scrubbed(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(item) for item in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def snapshot(row: Any) -> dict[str, Any]:
    """A mapped row's columns by attribute name (secrets are scrubbed later, by record_change)."""
    mapper = inspect(type(row))
    return {attr.key: getattr(row, attr.key) for attr in mapper.column_attrs if attr.key not in NOISE_FIELDS}


def changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Only the fields whose value differs, as (before, after)."""
    names = [name for name in after if before.get(name) != after[name]]
    names += [name for name in before if name not in after]
    return {n: before.get(n) for n in names}, {n: after.get(n) for n in names}


def record_change(
    session: Session,
    *,
    actor: Actor,
    action: str,
    target_type: str,
    target_id: str | None,
    before: Mapping[str, Any] | None = None,
    after: Mapping[str, Any] | None = None,
) -> None:
    """Adds one audit row to `session`: it is written by the caller's commit, with the change."""
    session.add(
        AuditEntry(
            created_at=datetime.now(UTC).replace(tzinfo=None),
            actor_kind=actor.kind,
            actor_id=actor.id[:255],
            actor_display=actor.display[:255],
            action=action[:64],
            target_type=target_type[:32],
            target_id=None if target_id is None else str(target_id)[:255],
            before=scrubbed(before),
            after=scrubbed(after),
        )
    )


def record_alone(sessions: sessionmaker[Session], **change: Any) -> None:
    """record_change in a transaction of its own, for changes that are not rows (a model loaded into
    memory, a login refused)."""
    with sessions() as session:
        record_change(session, **change)
        session.commit()
