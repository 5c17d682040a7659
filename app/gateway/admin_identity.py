"""Who is admin: the key in TOKENMILL_ADMIN_KEY, else one generated on first start, printed once
and stored hashed. Only the hash is kept in memory either way."""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.crud import utcnow
from app.gateway.keys import ADMIN_KEY_PREFIX, generate_key, hash_key, hashes_match, visible_prefix
from app.gateway.models import AdminCredential


class AdminIdentity:
    def __init__(self, key_hash: str):
        self._key_hash = key_hash

    def matches(self, key: str | None) -> bool:
        return bool(key) and hashes_match(key, self._key_hash)


def ensure_admin_identity(sessions: sessionmaker[Session], *, configured_key: str | None
                          ) -> tuple[AdminIdentity, str | None]:
    """The admin identity, and the plaintext key when this call generated it (to show once)."""
    if configured_key:
        return AdminIdentity(hash_key(configured_key)), None
    with sessions() as session:
        stored = session.scalar(select(AdminCredential).order_by(AdminCredential.id).limit(1))
        if stored is not None:
            return AdminIdentity(stored.key_hash), None
        plaintext = generate_key(ADMIN_KEY_PREFIX)
        session.add(AdminCredential(id=1, key_hash=hash_key(plaintext), key_prefix=visible_prefix(plaintext),
                                    created_at=utcnow()))
        try:
            session.commit()
        except IntegrityError:  # another replica won the race; its key is the admin key
            session.rollback()
            stored = session.scalar(select(AdminCredential).order_by(AdminCredential.id).limit(1))
            return AdminIdentity(stored.key_hash), None
    return AdminIdentity(hash_key(plaintext)), plaintext
