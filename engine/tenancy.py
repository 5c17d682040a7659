"""Who a request belongs to, as far as the engine cares: whose share it draws from, how urgent it is,
and which cached prefixes it may reuse.

The gateway fills it in from the API key; the engine trusts it and never sees a key.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property

from engine.sampling_params import InvalidParameter

DEFAULT_TEAM = "default"


@dataclass(frozen=True)
class Tenancy:
    team: str = DEFAULT_TEAM
    weight: float = 1.0  # the team's share relative to other teams (fair scheduling)
    priority: int = 0  # lower runs first (vLLM's convention); classes are served strictly in order
    # Background work (a Batch API line) sits out each step in which a foreground request computes its
    # first token (engine/scheduler.py), so it adds nothing to interactive time to first token.
    background: bool = False
    # Requests reuse each other's cached prefix blocks only when their salts are equal. None: the team's
    # own cache; "": the global cache everyone shares. Cross-team sharing lets one team learn by timing
    # what another team's prompts begin with (vLLM's CVE-2025-46570), so it is an explicit choice.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.team, str) or not self.team:
            raise InvalidParameter("team", "team must be a non-empty string")
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight) or self.weight <= 0:
            raise InvalidParameter("weight", "a team's weight must be a positive number")
        if not isinstance(self.priority, int) or not -(2**31) <= self.priority < 2**31:
            raise InvalidParameter("priority", "priority must be a 32-bit integer")

    @property
    def effective_cache_salt(self) -> str:
        return self.team if self.cache_salt is None else self.cache_salt

    @cached_property
    def cache_root(self) -> bytes | None:
        """The parent hash of a request's first block: None (unsalted) for the global cache."""
        salt = self.effective_cache_salt
        if not salt:
            return None
        return hashlib.blake2b(b"tokenmill-cache-salt\0" + salt.encode(), digest_size=16).digest()


DEFAULT_TENANCY = Tenancy()
