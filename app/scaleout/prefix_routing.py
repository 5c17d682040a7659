"""Which replica a request goes to: the one whose prefix cache holds the most of its prompt, among the
replicas a load bound still allows.

The load bound (consistent hashing with bounded loads: Mirrokni, Thorup and Zadimoghaddam, 2018). Load
is requests in flight: routed and not yet finished, as the router counts them. A replica may take a
request only while it runs fewer than ceil((1 + epsilon) * mean), the mean over all replicas with this
request counted, so after any placement the chosen replica runs at most (1 + epsilon) * mean + 1 (the
+1: rounding to whole requests). Not every replica can be at that cap (they would hold more than all
requests), so one is always allowed. With only arrivals this bounds every replica at all times;
completions can lower the mean under a replica that was placed fairly, and the bound then steers new
requests away from it until the others catch up.

Affinity, measured. Each replica reports the hashes of the blocks its prefix cache holds
(engine cached_prefix_digest(), refreshed every few seconds). The router hashes the prompt's full blocks
as the engine does: the same token ids (the served model's tokenizer and chat template), the same block
size, chained from the team's cache salt (engine.tenancy.Tenancy.cache_root). A team's prompt therefore
only ever matches blocks its own team (or its cache group) computed. Among allowed replicas the one
holding the longest run of the prompt's leading blocks wins, when that run is at least
`min_match_blocks` long: a chat template's few shared opening tokens are not worth piling every request
onto one replica. Ties go to the less loaded, then to the hash order below.

Cold prompts: those no allowed replica holds `min_match_blocks` of. Such a prompt goes to its tenant's
cold home when it has one (app.scaleout.cold_placement: where the router sent the same tenant's cold prompt
in the last TTL_S seconds, before any report could show it), else to the allowed replica with the most
free cache room: the fewest blocks reported cached plus those the router sent there that its report does
not show yet. Why not a hash of the prompt: with 10 tenants on 2 replicas a hash split them 6/4 or worse
on some seeds, the heavier replica's prefixes overflowed its KV pool and the overflow copied tenants onto
the other one (bench/scale_bench.py seed 4: 0.92x round-robin's throughput). Placing by room gives each
new tenant to the emptiest replica, so tenants of similar size spread evenly whatever their order (per
replica counts differ by at most one while caches do not evict; the unit tests check it). Once every
cache is full the reports are all the same size, and only the blocks sent since the last report, the
load, and the hash order tell replicas apart: a tenant evicted everywhere is then placed afresh, not
necessarily where it was before. Ties go to the
less loaded, then to the prompt's rendezvous hash order (`prefix_key`, which the ingress salts with the
caller's key, so another team's prompt never shares a hash order or a cold home with it).

Scaling. Warm tenants (cached somewhere) stay where their blocks are: adding a replica moves none of
them, and removing one moves only its own. Cold tenants are not pinned to any replica: after a scale-up
the new, empty replica takes new and evicted tenants until its cache is as full as the others'; a dead
replica's tenants are cold everywhere and spread by free room over the rest.

Pure functions, but for the router's cold-placement memory that place() updates when given one:
app.scaleout.ray_serve calls them; tests call them with simulated replicas.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.scaleout.cold_placement import ColdPlacements, ReplicaId, identities
from engine.block_manager import hash_block

PREFIX_CHARS = 512  # ~128 tokens, 8 KV blocks of 16: long enough to hold a system prompt's start
EPSILON = 0.25  # a replica may run up to (1 + EPSILON) x the mean requests in flight
MIN_MATCH_BLOCKS = 4  # 64 tokens of 16-token blocks: less is a chat template's opening, not a shared prompt
DIGEST_BYTES = 8  # block hashes are compared on their first 8 bytes: replicas report 8 bytes per block
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")

RoutedBy = Literal["affinity", "load"]


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


def prefix_key(text: str | None, prefix_chars: int = PREFIX_CHARS, salt: str | None = None) -> str | None:
    """The prompt's opening, hashed; `salt` (the ingress passes the caller's authorization) keeps callers'
    keys apart, so a cold home remembered for one team is never found by another's identical prompt."""
    if not text:
        return None
    key = hashlib.blake2b(text[:prefix_chars].encode(), digest_size=8)
    if salt is not None:
        key.update(b"\x00" + hashlib.blake2b(salt.encode(), digest_size=16).digest())
    return key.hexdigest()


def rendezvous_order(key: str, replica_ids: Sequence[ReplicaId]) -> list[ReplicaId]:
    """Replica ids, the key's favourite first. Same key and set: same order, in every process."""

    def score(replica_id: Hashable) -> bytes:
        return hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


def prompt_blocks(token_ids: Sequence[int], block_size: int, cache_root: bytes | None) -> tuple[bytes, ...]:
    """The engine's hash of each full block of the prompt that a prefix-cache hit could cover (never the
    last token: the engine computes it for its logits), cut to DIGEST_BYTES."""
    hashes = []
    parent = cache_root
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = hash_block(parent, list(token_ids[start : start + block_size]))
        hashes.append(parent[:DIGEST_BYTES])
    return tuple(hashes)


def digest(block_hashes: Iterable[bytes]) -> frozenset[bytes]:
    """What a replica reports of its prefix cache: each block hash cut to DIGEST_BYTES."""
    return frozenset(block_hash[:DIGEST_BYTES] for block_hash in block_hashes)


def matched_blocks(blocks: Sequence[bytes], held: frozenset[bytes]) -> int:
    """How many of the prompt's leading blocks a replica holds, in a row (a hit needs every block before it)."""
    count = 0
    for block in blocks:
        if block not in held:
            break
        count += 1
    return count


def allowed_load(loads: Mapping[ReplicaId, int], epsilon: float) -> int:
    """A replica takes the request only while it runs fewer than this many: ceil((1 + epsilon) * mean),
    the mean with this request counted."""
    return math.ceil((1 + epsilon) * (sum(loads.values()) + 1) / len(loads))


@dataclass(frozen=True)
class Placement:
    ranks: list[list[Any]]  # replica ids, most preferred first (Ray Serve's choose_replicas shape)
    by: RoutedBy  # "affinity": it holds the prompt's prefix; "load": no allowed replica held enough of it
    # (then its tenant's cold home, or the most free room)


def place(
    key: str | None,
    blocks: Sequence[bytes],
    loads: Mapping[ReplicaId, int],
    held: Mapping[ReplicaId, frozenset[bytes]],
    *,
    epsilon: float = EPSILON,
    min_match_blocks: int = MIN_MATCH_BLOCKS,
    cold: ColdPlacements[ReplicaId] | None = None,
) -> Placement:
    """Where a request goes. `key`: prefix_key of its prompt (None: no prompt); `blocks`: prompt_blocks
    (empty when its team's cache salt is not known yet); `loads`: requests in flight per replica;
    `held`: each replica's reported digest (missing: nothing known); `cold`: the router's memory of its
    cold placements, which this updates (None: every cold prompt is judged by the reports alone)."""
    if not loads:
        return Placement([], "load")
    if key is None:
        order = sorted(loads, key=lambda replica_id: (loads[replica_id], str(replica_id)))
    else:
        order = rendezvous_order(key, list(loads))
    cap = allowed_load(loads, epsilon)
    allowed = [replica_id for replica_id in order if loads[replica_id] < cap]
    matched = {replica_id: matched_blocks(blocks, held.get(replica_id, frozenset())) for replica_id in allowed}
    best = max(matched.values(), default=0)
    if best >= max(min_match_blocks, 1):
        position = {replica_id: index for index, replica_id in enumerate(order)}
        holders = [replica_id for replica_id in allowed if matched[replica_id] == best]
        chosen = min(holders, key=lambda replica_id: (loads[replica_id], position[replica_id]))
        by: RoutedBy = "affinity"
    elif key is None and not blocks:
        chosen = allowed[0]  # no prompt: the least loaded
        by = "load"
    else:
        chosen = _cold_choice(key, blocks, loads, held, allowed, cold)
        by = "load"
    rest = [replica_id for replica_id in allowed if replica_id != chosen]
    rest.sort(key=lambda replica_id: -matched[replica_id])  # stable: hash order among equals
    over = sorted((r for r in order if r not in matched), key=lambda replica_id: loads[replica_id])
    return Placement([[chosen], rest + over] if rest or over else [[chosen]], by)


def _cold_choice(
    key: str | None,
    blocks: Sequence[bytes],
    loads: Mapping[ReplicaId, int],
    held: Mapping[ReplicaId, frozenset[bytes]],
    allowed: list[ReplicaId],
    cold: ColdPlacements[ReplicaId] | None,
) -> ReplicaId:
    """A prompt no allowed replica holds: its tenant's cold home if allowed, else the most free room."""
    names = identities(key, blocks)
    home = cold.home(names) if cold is not None else None
    if home in allowed:
        chosen = home
    else:
        position = {replica_id: index for index, replica_id in enumerate(allowed)}  # hash order
        if cold is not None:
            taken = cold.blocks_taken(allowed, held)
        else:
            taken = {replica_id: len(held.get(replica_id, frozenset())) for replica_id in allowed}
        chosen = min(allowed, key=lambda replica_id: (taken[replica_id], loads[replica_id], position[replica_id]))
    if cold is not None:
        cold.placed(names, chosen, blocks)
    return chosen
