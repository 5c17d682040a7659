"""One sequence being generated, with a single progress counter.

`num_computed_tokens` counts the tokens whose KV is in the cache. Prefill, chunked prefill, prefix-cache
hits and recompute after preemption are all the same move: catch it up with `num_tokens`.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field

from engine.lora import AdapterRef
from engine.sampling_params import SamplingParams
from engine.tenancy import DEFAULT_TENANCY, Tenancy


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    request_id: str  # the caller's id; shared by the n sequences of one request
    index: int  # which of the n sequences
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)  # the block table, in token order
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of known tokens
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    cpu_block_ids: list[int] = field(default_factory=list)  # where the KV is while swapped out
    # Speculated tokens after the last one (engine/speculation.py), computed in this step's forward pass
    # behind the decode token and kept only as far as the model agrees; never part of num_tokens.
    draft_token_ids: list[int] = field(default_factory=list)
    guide: object | None = None  # engine.guide.Guide, when the output is constrained
    # A sibling of an n > 1 request waits for its parent's prompt instead of prefilling it again.
    fork_parent: Request | None = None
    siblings: list[Request] = field(default_factory=list)
    tenancy: Tenancy = DEFAULT_TENANCY
    adapter: AdapterRef | None = None  # the LoRA adapter it runs under (engine/lora.py); None: the base model
    # Scheduler bookkeeping: arrival order (kept across preemption), the step it last started running,
    # and whether its prompt has been charged to its team (once, however often it is recomputed).
    arrival_seq: int = 0
    running_since_step: int = 0
    prompt_charged: bool = False
    first_scheduled_time: float | None = None  # time.monotonic() when it was first scheduled

    def __post_init__(self) -> None:
        if self.params.guide_factory is not None and self.guide is None:
            self.guide = self.params.guide_factory.new_guide()

    @property
    def sample_seed(self) -> int | None:
        """The seed this sequence samples with: the request's, offset by its index so n > 1 choices differ."""
        return None if self.params.seed is None else self.params.seed + self.index

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def team(self) -> str:
        return self.tenancy.team

    @property
    def cache_root(self) -> bytes | None:
        """The parent hash of its first block: the team's cache salt (Tenancy.cache_root), and under an adapter
        the adapter's name and weights too, since the same tokens leave other KV under other weights."""
        root = self.tenancy.cache_root
        if self.adapter is None:
            return root
        adapter = f"{self.adapter.name}\0{self.adapter.fingerprint}".encode()
        return hashlib.blake2b(b"tokenmill-lora\0" + adapter + b"\0" + (root or b""), digest_size=16).digest()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def token_ids_with_drafts(self, start: int, end: int) -> list[int]:
        """Like token_ids_between, where positions from num_tokens on are the drafts'."""
        known = self.num_tokens
        if end <= known:
            return self.token_ids_between(start, end)
        return self.token_ids_between(start, known) + self.draft_token_ids[max(start - known, 0) : end - known]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
