"""Decides, every step, which requests run and how many of their tokens: continuous batching.

Running requests first (a decode is one token, a prefill chunk what the budget allows), then swapped
ones, then waiting ones in arrival order. When blocks run out the newest running request is preempted,
by recompute (drop its KV, requeue it) or by swap (park its KV in the CPU pool).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockCopy, BlockManager
from engine.config import EngineConfig
from engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    swap_out: list[BlockCopy] = field(default_factory=list)  # device -> cpu, done before anything else
    swap_in: list[BlockCopy] = field(default_factory=list)  # cpu -> device
    copies: list[BlockCopy] = field(default_factory=list)  # device -> device, copy-on-write

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class SchedulerCounters:
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of those, found in the cache
    copy_on_write_blocks: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.counters = SchedulerCounters()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A forked sibling joins the batch with its parent's (shared) blocks."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of whichever queue holds it and give its blocks back."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.blocks.free_swapped(request)
        self.blocks.free(request)
        request.status = status

    # ---- the step decision ---------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        scheduled: dict[Request, int] = {}
        budget = self.config.max_num_batched_tokens
        preempted_any = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            copies = None
            while request.status is RequestStatus.RUNNING:
                copies = self.blocks.allocate_slots(request, num_new)
                if copies is not None:
                    break
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim, batch)
                preempted_any = True
            if copies is None:  # the request preempted itself: it was the newest
                break
            batch.copies.extend(copies)
            self.counters.copy_on_write_blocks += len(copies)
            scheduled[request] = num_new
            budget -= num_new
            index += 1

        while self.swapped and not preempted_any and budget > 0 and self._seats_taken() < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.blocks.can_swap_in(request, num_new):
                break
            self.swapped.popleft()
            batch.swap_in.extend(self.blocks.swap_in(request))
            batch.copies.extend(self.blocks.allocate_slots(request, num_new))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request] = num_new
            budget -= num_new

        while self.waiting and not self.swapped and not preempted_any and budget > 0:
            request = self.waiting[0]
            if self._seats_taken() + 1 + self._unforked(request) > self.config.max_num_seqs:
                break
            first_admission = request.num_computed_tokens == 0 and not request.output_token_ids
            cached = self.blocks.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.blocks.block_size
            num_new = min(request.num_tokens - num_cached_tokens, budget)
            copies = self.blocks.allocate_slots(request, num_new, cached)
            if copies is None:
                break
            self.waiting.popleft()
            batch.copies.extend(copies)
            request.num_computed_tokens = num_cached_tokens
            if first_admission:
                request.num_cached_tokens = num_cached_tokens
                self.counters.prefix_cache_queries += request.num_prompt_tokens
                self.counters.prefix_cache_hits += num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request] = num_new
            budget -= num_new

        batch.requests = list(scheduled)
        batch.num_new_tokens = list(scheduled.values())
        return batch

    @staticmethod
    def _unforked(request: Request) -> int:
        return sum(1 for sibling in request.siblings if sibling.fork_parent is request)

    def _seats_taken(self) -> int:
        """Running sequences plus the siblings that will fork off them."""
        return len(self.running) + sum(self._unforked(request) for request in self.running)

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        self.running.remove(victim)
        # A copy-on-write planned for the victim this step hasn't happened yet: its private block
        # still lacks the shared block's content, which is what must be swapped out.
        own_blocks = set(victim.block_ids)
        pending = {dst: src for src, dst in batch.copies if dst in own_blocks}
        batch.copies[:] = [(src, dst) for src, dst in batch.copies if dst not in pending]
        if self.config.preemption_mode == "swap":
            pairs = self.blocks.swap_out(victim)
            if pairs is not None:
                pairs = [(pending.get(device, device), cpu) for device, cpu in pairs]
                batch.swap_out.extend(pairs)
                victim.status = RequestStatus.SWAPPED
                self.swapped.append(victim)
                self.counters.preemptions_swap += 1
                return
        self.blocks.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.counters.preemptions_recompute += 1
