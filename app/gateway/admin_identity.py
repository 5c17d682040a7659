"""Who is admin: the key in TOKENMILL_ADMIN_KEY, else one generated on first start, written once to a
file only this user can read, and stored hashed. Only the hash is kept in memory either way."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.audit import SYSTEM, Actor
from app.gateway.crud import create_key, create_team, find_key, get_team_by_name, utcnow
from app.gateway.keys import ADMIN_KEY_PREFIX, generate_key, hash_key, hashes_match, visible_prefix
from app.tables import AdminCredential


class AdminIdentity:
    def __init__(self, key_hash: str, actor: Actor):
        self._key_hash = key_hash
        self.actor = actor  # how the audit log names changes made with this key

    def matches(self, key: str | None) -> bool:
        return bool(key and hashes_match(key, self._key_hash))


def ensure_admin_identity(
    sessions: sessionmaker[Session], *, configured_key: str | None
) -> tuple[AdminIdentity, str | None]:
    """The admin identity, and the plaintext key when this call generated it (to show once)."""
    if configured_key:
        return AdminIdentity(hash_key(configured_key), admin_actor("env", visible_prefix(configured_key))), None
    with sessions() as session:
        stored = session.scalar(select(AdminCredential).order_by(AdminCredential.id).limit(1))
        if stored is not None:
            return _stored_identity(stored), None
        plaintext = generate_key(ADMIN_KEY_PREFIX)
        credential = AdminCredential(
            id=1, key_hash=hash_key(plaintext), key_prefix=visible_prefix(plaintext), created_at=utcnow()
        )
        session.add(credential)
        try:
            session.commit()
        except IntegrityError:  # another replica won the race; its key is the admin key
            session.rollback()
            stored = session.scalar(select(AdminCredential).order_by(AdminCredential.id).limit(1))
            assert stored is not None  # the winner's row: admin credentials are never deleted
            return _stored_identity(stored), None
    return _stored_identity(credential), plaintext


def admin_actor(credential_id: str, key_prefix: str) -> Actor:
    """The admin key as the audit log names it: its credential's id ("env": TOKENMILL_ADMIN_KEY) and
    visible prefix, never more of the key."""
    return Actor("admin_key", credential_id, key_prefix)


def _stored_identity(stored: AdminCredential) -> AdminIdentity:
    return AdminIdentity(stored.key_hash, admin_actor(str(stored.id), stored.key_prefix))


CONFIGURED_KEY_TEAM = "default"
CONFIGURED_KEY_NAME = "--api-key"
MIN_CONFIGURED_KEY_CHARS = 16


def check_configured_key(key: str) -> None:
    """A --api-key that is short or looks like an admin key is refused (ValueError) before anything runs."""
    if len(key) < MIN_CONFIGURED_KEY_CHARS or key.startswith(ADMIN_KEY_PREFIX):
        raise ValueError(
            f"--api-key must be at least {MIN_CONFIGURED_KEY_CHARS} characters and not an admin key "
            f"({ADMIN_KEY_PREFIX}...); `tokenmill keys create` makes a strong one"
        )


def ensure_configured_key(sessions: sessionmaker[Session], key: str) -> str:
    """`tokenmill serve --api-key KEY`: KEY becomes a key of team "default" (both made on first start,
    stored hashed like every other key), so clients configured with it work and are metered. A key an
    admin revoked stays revoked. Returns what happened, for the start-up line."""
    check_configured_key(key)
    with sessions() as session:
        found = find_key(session, key_hash=hash_key(key))
        if found is not None:
            row, team = found
            return f"--api-key is a key of team {team.name!r}" + (
                ", revoked: requests with it are refused" if row.revoked_at is not None else ""
            )
        team = get_team_by_name(session, name=CONFIGURED_KEY_TEAM) or create_team(
            session, actor=SYSTEM, name=CONFIGURED_KEY_TEAM
        )
        create_key(session, actor=SYSTEM, team=team, name=CONFIGURED_KEY_NAME, plaintext=key)
        try:
            session.commit()
        except IntegrityError:  # another replica stored it first
            session.rollback()
    return f"--api-key added as a key of team {CONFIGURED_KEY_TEAM!r}"


ADMIN_KEY_FILE = "admin-key"


def deliver_admin_key(plaintext: str, data_dir: str | Path, stream: TextIO | None = None) -> Path:
    """A generated admin key goes to DATA_DIR/admin-key (mode 0600: this user and root only), never to
    the output, which nohup files and `docker logs` keep forever; the output says where it is. Only an
    interactive terminal is shown the key itself. Returns the file's path."""
    stream = stream or sys.stdout
    path = Path(data_dir) / ADMIN_KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(descriptor, 0o600)  # a file left from before keeps its mode otherwise
        file.write(plaintext + "\n")
    stream.write(
        f"tokenmill: generated the admin key; it is in {path.resolve()} (readable by this user only). "
        "Keep it somewhere safe, then delete the file.\n"
    )
    if stream.isatty():
        stream.write(f"  {plaintext}\n")
    stream.flush()
    return path
