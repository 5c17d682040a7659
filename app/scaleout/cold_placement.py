"""The router's short memory of where it sent prompts that no replica held yet (cold prompts).

Replicas report their caches every second or so, and a prompt's blocks are only cached once its
prefill ran, so for a while after a cold prompt is placed, the reports say nothing of it. Two things
are remembered for that while (TTL_S):

- where each cold prompt went, keyed by its team-salted identity (the hash of its first
  IDENTITY_BLOCKS blocks, chained from the team's cache salt, and its prefix key, salted with the
  caller's key by the ingress; the prompt's
  blocks are not known until the ingress has learnt the team's salt): a tenant's next cold requests follow the first one instead of being
  spread as new tenants. Keys never match across teams, as both are salted.
- how many blocks each replica was sent that its report does not show yet: a placement counts as
  room taken on that replica until the blocks appear in its digest (or TTL_S passes), so a burst of
  new tenants between two reports spreads out instead of all seeing the same emptiest replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

# Long enough to cover a cold prompt's wait in a busy replica's queue plus its prefill and the next
# report (the bench's p99 latency under load is ~25 s); short enough that a tenant whose blocks were
# evicted everywhere is soon placed afresh by free room.
TTL_S = 30.0
# A cold prompt is known by its first this many blocks (128 tokens, like prefix_routing.PREFIX_CHARS):
# enough to get past a shared chat-template opening into the tenant's own system prompt.
IDENTITY_BLOCKS = 8
# A prompt whose blocks are not known yet (its team's salt not learned): assumed this many blocks, about
# a system prompt's worth. Only orders replicas between reports; the reports correct it.
UNKNOWN_PROMPT_BLOCKS = 16

ReplicaId = TypeVar("ReplicaId", bound=Hashable)  # whatever the router names replicas by


@dataclass(frozen=True)
class _Sent:
    replica: Hashable
    blocks: tuple[bytes, ...]
    identities: tuple[Hashable, ...]
    at: float


def identities(prefix_key: str | None, blocks: Sequence[bytes]) -> tuple[Hashable, ...]:
    """What a cold prompt is remembered by: its leading blocks' chained (team-salted) hash, and its
    prefix key (salted by the ingress with the caller's key): either matches the same tenant later."""
    keys: list[Hashable] = []
    if len(blocks) >= IDENTITY_BLOCKS:  # fewer: the blocks may be only a shared template's opening
        keys.append(("blocks", blocks[IDENTITY_BLOCKS - 1]))
    if prefix_key is not None:
        keys.append(("key", prefix_key))
    return tuple(keys)


class ColdPlacements(Generic[ReplicaId]):
    def __init__(self, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._homes: dict[Hashable, tuple[ReplicaId, float]] = {}  # identity -> (replica, placed at)
        self._sent: list[_Sent] = []

    def _forget_expired(self, now: float) -> None:
        oldest = now - self.ttl_s
        self._homes = {key: home for key, home in self._homes.items() if home[1] > oldest}
        self._sent = [sent for sent in self._sent if sent.at > oldest]

    def home(self, identities: Sequence[Hashable]) -> ReplicaId | None:
        """Where the first of these identities was placed within TTL_S; None if none was."""
        self._forget_expired(self.clock())
        for identity in identities:
            if identity in self._homes:
                return self._homes[identity][0]
        return None

    def pending_blocks(self, replica: ReplicaId, held: frozenset[bytes]) -> int:
        """Blocks sent to the replica that its last report does not show yet, each counted once (a
        tenant's second request before the report adds nothing: it hits the first one's blocks)."""
        unreported: set[bytes] = set()
        unknown: set[Hashable] = set()  # prompts sent before their blocks were known, by identity
        for sent in self._sent:
            if sent.replica != replica:
                continue
            if sent.blocks:
                unreported.update(block for block in sent.blocks if block not in held)
            else:
                unknown.add(sent.identities[:1])
        return len(unreported) + UNKNOWN_PROMPT_BLOCKS * len(unknown)

    def placed(self, identities: Sequence[Hashable], replica: ReplicaId, blocks: Sequence[bytes]) -> None:
        """A cold prompt went to the replica: its identities point there unless they already pointed
        somewhere (a request the load bound turned away does not move its tenant's home)."""
        now = self.clock()
        self._forget_expired(now)
        for identity in identities:
            self._homes.setdefault(identity, (replica, now))
        self._sent.append(_Sent(replica, tuple(blocks), tuple(identities), now))

    def blocks_taken(
        self, replicas: Sequence[ReplicaId], held: Mapping[ReplicaId, frozenset[bytes]]
    ) -> dict[ReplicaId, int]:
        """Blocks each replica holds or is about to: reported plus pending."""
        self._forget_expired(self.clock())
        return {
            replica: len(held.get(replica, frozenset())) + self.pending_blocks(replica, held.get(replica, frozenset()))
            for replica in replicas
        }
