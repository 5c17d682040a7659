"""API key material: made by a CSPRNG, shown once, stored as SHA-256 with a visible prefix."""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "sk-"
ADMIN_KEY_PREFIX = "sk-admin-"
VISIBLE_CHARS = 8  # after "sk-": enough to tell keys apart in a list, far too little to guess from


def generate_key(prefix: str = KEY_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(32)  # 256 bits


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def visible_prefix(key: str) -> str:
    head = ADMIN_KEY_PREFIX if key.startswith(ADMIN_KEY_PREFIX) else KEY_PREFIX
    return key[: len(head) + VISIBLE_CHARS] if key.startswith(head) else key[:VISIBLE_CHARS]


def hashes_match(key: str, key_hash: str) -> bool:
    """Constant-time: compares digests, so timing says nothing about the stored hash or the key."""
    return hmac.compare_digest(hash_key(key).encode(), key_hash.encode())


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
