"""What the engine reports about itself: queue sizes, batch occupancy, KV use, prefix hits, tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from engine.fair_share import WINDOW_S


@dataclass(frozen=True)
class TeamStats:
    """One team's share of the engine: its sequences now, and the tokens it has been served."""

    running: int = 0  # running or swapped out
    waiting: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    service: float = 0.0  # the fair-share virtual counter (weighted tokens / weight)
    # (monotonic second, prompt and generated tokens served in it) over the last minute, oldest first
    recent_tokens: tuple[tuple[int, int], ...] = ()

    def tokens_last_minute(self, now: float | None = None) -> int:
        """Counted when asked, so that an idle engine's figure still falls to 0 as the minute passes."""
        now_s = int(time.monotonic() if now is None else now)
        return sum(tokens for second, tokens in self.recent_tokens if second > now_s - WINDOW_S)


@dataclass
class EngineStats:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_blocks_total: int
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up, cumulative
    prefix_cache_hits: int = 0  # of those, served from the cache
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    prompt_tokens_total: int = 0  # prompt tokens of admitted requests
    generation_tokens_total: int = 0
    steps_total: int = 0
    scheduled_seqs_last_step: int = 0
    scheduled_tokens_last_step: int = 0
    step_time_seconds_total: float = 0.0
    step_token_budget: int = 0  # the next step's budget: max_num_batched_tokens or less (engine/step_budget.py)
    # Sums over steps, so that callers can take means over any window from two snapshots.
    scheduled_seqs_total: int = 0
    scheduled_tokens_total: int = 0
    kv_blocks_used_step_sum: int = 0
    num_preemptions_fair: int = 0  # of the preemptions, those that gave another team its turn
    # Background work (Batch API lines): its seats now, its sequences summed over steps, its output tokens.
    num_running_background: int = 0
    scheduled_background_seqs_total: int = 0
    generation_tokens_background_total: int = 0
    # Speculative decoding (engine/speculation.py): steps of a sequence that carried drafts, drafted tokens,
    # and of those the ones the model accepted.
    spec_num_drafts: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    # Per team; rebuilt (not mutated) on every refresh, so a snapshot's dict stays as it was.
    teams: dict[str, TeamStats] = field(default_factory=dict)
    # LoRA adapters (engine/lora_stats.py), per adapter name, rebuilt likewise; and the resident pool's
    # loads, evictions, load time and bytes.
    adapters: dict[str, Any] = field(default_factory=dict)
    lora_loads_total: int = 0
    lora_evictions_total: int = 0
    lora_load_seconds_total: float = 0.0
    lora_resident_bytes: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def batch_occupancy(self) -> float:
        """Scheduled sequences over the sequence cap, last step."""
        return self.scheduled_seqs_last_step / self.max_num_seqs

    @property
    def token_occupancy(self) -> float:
        return self.scheduled_tokens_last_step / self.max_num_batched_tokens

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafted tokens over drafted tokens, since the start (0 before any draft)."""
        return self.spec_accepted_tokens_total / self.spec_draft_tokens_total if self.spec_draft_tokens_total else 0.0

    def record_drafts(self, drafted: int, accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_draft_tokens_total += drafted
        self.spec_accepted_tokens_total += accepted

    def snapshot(self) -> EngineStats:
        return replace(self)

    def record_step(self, batch, seconds: float, scheduler, blocks) -> None:
        self.steps_total += 1
        self.step_time_seconds_total += seconds
        self.scheduled_seqs_last_step = len(batch.requests)
        self.scheduled_tokens_last_step = batch.num_tokens
        self.scheduled_seqs_total += len(batch.requests)
        self.scheduled_tokens_total += batch.num_tokens
        background = [request for request in batch.requests if request.tenancy.background]
        self.scheduled_background_seqs_total += len(background)
        # A request that sampled this step is one token ahead of what it has computed; a prompt chunk is more.
        self.generation_tokens_background_total += sum(
            1 for request in background if request.num_tokens - request.num_computed_tokens == 1
        )
        self.refresh(scheduler, blocks)
        self.kv_blocks_used_step_sum += self.kv_blocks_used

    def refresh(self, scheduler, blocks) -> None:
        self.num_running = len(scheduler.running)
        self.num_running_background = sum(1 for request in scheduler.running if request.tenancy.background)
        self.num_waiting = len(scheduler.waiting)
        self.num_swapped = len(scheduler.swapped)
        self.step_token_budget = scheduler.step_budget.tokens
        self.kv_blocks_used = blocks.num_used_blocks
        counters = scheduler.counters
        self.prefix_cache_queries = counters.prefix_cache_queries
        self.prefix_cache_hits = counters.prefix_cache_hits
        self.num_preemptions_recompute = counters.preemptions_recompute
        self.num_preemptions_swap = counters.preemptions_swap
        self.num_preemptions_fair = counters.preemptions_fair
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for queue, counts in ((scheduler.running, running), (scheduler.swapped, running), (scheduler.waiting, waiting)):
            for request in queue:
                counts[request.team] = counts.get(request.team, 0) + 1
        self.teams = {
            team: TeamStats(
                running.get(team, 0),
                waiting.get(team, 0),
                counts.prompt_tokens,
                counts.output_tokens,
                counts.service,
                tuple(counts.recent),
            )
            for team, counts in scheduler.ledger.teams.items()
        }
