"""Which replica a request should go to: the one that has probably cached its prompt's first blocks.

Requests whose prompts begin alike (a shared system prompt, the same conversation) get the same
routing key: a hash of the first `prefix_chars` characters of the prompt as the engine will see it.
A key picks its replica by rendezvous hashing (highest hash of key + replica id), so keys stay put when
other replicas come and go. The preferred replica is skipped when it is overloaded: busier than the
least-loaded replica by more than `imbalance` requests; then the least-loaded one wins.
Pure functions: app.scaleout.ray_serve calls them from its Ray Serve request router; tests call them directly.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Mapping, Sequence

PREFIX_CHARS = 512  # ~128 tokens, 8 KV blocks of 16: long enough to hold a system prompt's start
IMBALANCE = 4  # requests the preferred replica may run beyond the least-loaded before it is passed over
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")


def routing_text(path: str, body: bytes) -> str | None:
    """The start of the prompt, in the order the engine sees it; None for requests without one (or bodies
    that are not JSON: the replica answers those with its own error)."""
    if path not in ROUTED_PATHS or not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if path == "/v1/chat/completions":
        return _messages_text(data.get("messages"))
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]  # a batch: its first prompt stands for it
    return prompt if isinstance(prompt, str) else None


def _messages_text(messages: object) -> str | None:
    if not isinstance(messages, list):
        return None
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text, in order
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        parts.append(f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def prefix_key(text: str | None, prefix_chars: int = PREFIX_CHARS) -> str | None:
    if not text:
        return None
    return hashlib.blake2b(text[:prefix_chars].encode(), digest_size=8).hexdigest()


def rendezvous_order(key: str, replica_ids: Sequence[Hashable]) -> list:
    """Replica ids, the key's favourite first. Same key and set: same order, in every process."""

    def score(replica_id: Hashable) -> bytes:
        return hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


def rank_replicas(key: str | None, loads: Mapping[Hashable, int | None], imbalance: int = IMBALANCE) -> list[list]:
    """Ranks of replica ids, most preferred first (Ray Serve's choose_replicas shape). `loads`: requests
    running or queued on each replica, None where unknown (counted as idle)."""
    if not loads:
        return []
    load = {replica_id: count or 0 for replica_id, count in loads.items()}
    by_load = sorted(load, key=lambda replica_id: (load[replica_id], str(replica_id)))
    if key is None:
        return [by_load]
    preferred = rendezvous_order(key, list(load))[0]
    if load[preferred] - load[by_load[0]] > imbalance:
        return [by_load]
    return [[preferred], [replica_id for replica_id in by_load if replica_id != preferred]]
