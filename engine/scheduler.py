"""Decides, every step, which requests run and how many of their tokens: continuous batching.

Running requests first (a decode is one token, plus its speculated drafts while they fit, a prefill chunk
what the budget allows), then queued ones.
`scheduling="fcfs"`: swapped requests resume first, then waiting ones in arrival order. `"fair"` (the
default): the next request is the queued one of the least-served team (engine/fair_share.py), in arrival
order within a team, lower `priority` classes strictly first; when it finds no seat or no blocks, the newest
running request of the most over-served team that has run `fair_min_run_steps` steps gives way to it.
When blocks run out for a running request the newest running request (fair: of the most over-served team)
is preempted, by recompute (drop its KV, requeue it) or by swap (park its KV in the CPU pool).

Fair share covers the prefill phase too. Under `"fair"` a running request that is still prefilling (more than
one known token left to compute) gets no budget ahead of the queue: it contends with the queued requests in the
same fair order, so a waiting request of a less-served team gets its prompt (or its first chunk) into the next
step however many partial prefills hold seats and budget. At equal service the team with fewer sequences under
way goes first (a team that just joined starts level with one charged already for prompts it is still
prefilling). For a newcomer's first chunk, the newest partial prefill of a team ranked after it yields its
seat at once, without `fair_min_run_steps`: it goes back to the queue holding its computed blocks, and resumes
where it stopped (nothing is computed twice); held blocks are given back first when the pool runs short (their
full blocks stay in the prefix cache). And a step that computes the first token of a team with nothing
decoding carries at most FIRST_TOKEN_STEP_PREFILL prefill tokens of teams served more (never two such steps
running): on a CPU a step's time is its token count, and that step is the newcomer's time to first token.
One team alone never meets either rule.

A new request whose next uncached prompt block is one that a request scheduled this step fills (the same cache
and the same tokens up to it: its own team's, unless a cache salt is shared) waits a step, and then finds it in
the prefix cache: a burst of requests that begin alike (a system prompt, a batch's instructions) computes that
start once. Under `"fair"` it keeps its place while it waits: nothing queued after it is admitted in that step.

The bound fair share keeps (equal priorities). Let m = fair_min_run_steps, S = max_num_seqs, P = the longest
prompt, and for teams f, g with weights w_f, w_g:
    U_fg = prompt_weight * P / w_f + (prompt_weight * P + (m + 1) * output_weight * S) / w_g.
While f and g both have requests queued, c_g - c_f <= U_fg, where c is the virtual counter. Why: take the
last moment c_g <= c_f + prompt_weight * P / w_f held. After it g admits nothing new (f's request ranks
first and the queue is never skipped), so g's counter grows only by the admission that crossed (at most
prompt_weight * P / w_g) and by its running sequences' outputs (at most output_weight * S / w_g a step),
and each of those is preempted for f's waiting request once it has run m steps (a victim's team must lead
by more than the candidate's prompt, which keeps two teams from trading places on every admission). Over
any interval in which both stay queued, their weighted service therefore differs by at most
U_fg + U_gf (VTC's 2x bound, with preemption's m). tests/engine/test_fair_share.py holds the engine to it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from engine.block_manager import BlockCopy, BlockManager
from engine.config import EngineConfig
from engine.fair_share import TeamLedger
from engine.request import Request, RequestStatus
from engine.step_budget import StepBudget

# The most prefill tokens of more-served teams in a step that computes a newcomer team's first token. On a
# 2-core CPU a 2048-token prefill step of SmolLM2 takes seconds; 256 tokens keep that step near a solo
# request's (see _newcomer_steps_short).
FIRST_TOKEN_STEP_PREFILL = 256


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
    preemptions_fair: int = 0  # of the preemptions, those that gave another team its turn


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Per team, its unfinished sequences that have started running (the tie-break of fair order)
        self.started: set[Request] = set()
        self.started_by_team: Counter[str] = Counter()
        self.swapped: deque[Request] = deque()
        self.counters = SchedulerCounters()
        self.step_budget = StepBudget(config.max_num_batched_tokens, config.max_step_seconds)
        self.fair = config.scheduling == "fair"
        self.ledger = TeamLedger(config.fair_prompt_weight, config.fair_output_weight)
        self.num_steps = 0
        self._next_arrival_seq = 0
        self.background_sat_out = False  # the last step left background requests out
        self.newcomer_step_was_short = False  # the last step cut others' prefill for a newcomer's first token

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add(self, request: Request) -> None:
        request.arrival_seq = self._next_arrival_seq
        self._next_arrival_seq += 1
        self.ledger.set_weight(request.team, request.tenancy.weight)
        self.ledger.join(request.team)
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A forked sibling joins the batch with its parent's (shared) blocks."""
        self.ledger.join(request.team)
        self._start_running(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of whichever queue holds it and give its blocks back."""
        if not request.is_finished:
            self.ledger.leave(request.team)
        if request in self.started:
            self.started.remove(request)
            self.started_by_team[request.team] -= 1
            if not self.started_by_team[request.team]:
                del self.started_by_team[request.team]
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
        self.num_steps += 1
        batch = ScheduledBatch()
        scheduled: dict[Request, int] = {}
        preempted: set[Request] = set()
        budget = self._schedule_running(batch, scheduled, preempted)
        if self.fair:
            self._admit_fairly(batch, scheduled, preempted, budget)
        else:
            self._admit_in_arrival_order(batch, scheduled, bool(preempted), budget)
        self.blocks.release_held_cpu_blocks()
        if self.fair:
            self._newcomer_steps_short(scheduled)
        self._background_sits_out(scheduled)
        for request in self.running:
            if request not in scheduled:  # drafts are for this step only
                request.draft_token_ids = []
        batch.requests = list(scheduled)
        batch.num_new_tokens = list(scheduled.values())
        return batch

    def _schedule_running(self, batch: ScheduledBatch, scheduled: dict[Request, int], preempted: set[Request]) -> int:
        """Give running requests their next tokens, preempting when blocks run out; returns the budget left."""
        budget = self.step_budget.tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self.fair and self._in_prefill(request):  # contends with the queue (_admit_fairly)
                index += 1
                continue
            num_known = request.num_tokens - request.num_computed_tokens
            # Drafts ride along behind the decode token while the budget lasts.
            del request.draft_token_ids[max(budget - num_known, 0) :]
            num_new = min(num_known + len(request.draft_token_ids), budget)
            copies = None
            while request.status is RequestStatus.RUNNING:
                copies = self.blocks.allocate_slots(request, num_new)
                if copies is not None:
                    break
                if request.draft_token_ids:  # drop the drafts before anyone is preempted for their slots
                    num_new -= len(request.draft_token_ids)
                    request.draft_token_ids = []
                    continue
                if self._release_held_blocks(request):
                    continue
                victim = self._victim_for_blocks()
                if self.running.index(victim) < index:
                    index -= 1
                budget += scheduled.pop(victim, 0)
                self._preempt(victim, batch)
                preempted.add(victim)
            if copies is None:  # the request preempted itself; the next one moved up to `index`
                continue
            batch.copies.extend(copies)
            self.counters.copy_on_write_blocks += len(copies)
            scheduled[request] = num_new
            budget -= num_new
            index += 1
        return budget

    def _background_sits_out(self, scheduled: dict[Request, int]) -> None:
        """A step that computes a foreground request's first token carries no background work (Batch API
        lines): on a CPU every token of a step costs time, and that step is the request's time to first
        token. The background requests keep their seats and blocks and go on next step (num_computed_tokens
        moves only for what is scheduled). Never two steps running, so that foreground requests starting
        on every step still leave the background half the steps. SmolLM2, 8 background lines, a chat request
        every 5 steps (bench/background_ttft.py): TTFT p99 2.97x -> 0.80x of the no-batch value in CPU
        time, for 20% fewer background tokens over the same steps."""
        sat_out_last_step, self.background_sat_out = self.background_sat_out, False
        if sat_out_last_step:
            return
        if any(not request.tenancy.background and not request.output_token_ids for request in scheduled):
            background = [request for request in scheduled if request.tenancy.background]
            for request in background:
                del scheduled[request]
            self.background_sat_out = bool(background)

    def _admit_in_arrival_order(
        self, batch: ScheduledBatch, scheduled: dict[Request, int], preempted_any: bool, budget: int
    ) -> None:
        while self.swapped and not preempted_any and budget > 0 and self._seats_taken() < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = self._swap_in(request, batch, budget)
            if num_new is None:
                break
            scheduled[request] = num_new
            budget -= num_new
        while self.waiting and not self.swapped and not preempted_any and budget > 0:
            request = self.waiting[0]
            if self._seats_taken() + 1 + self._unforked(request) > self.config.max_num_seqs:
                break
            if self._waits_for_shared_prefix(request, scheduled):
                break
            num_new = self._start_waiting(request, batch, budget)
            if num_new is None:
                break
            scheduled[request] = num_new
            budget -= num_new

    def _admit_fairly(
        self, batch: ScheduledBatch, scheduled: dict[Request, int], preempted: set[Request], budget: int
    ) -> None:
        """Queued requests and running partial prefills in fair order; the first queued one that doesn't fit
        takes the place of an over-served one.

        The order is never skipped, so a small request of an over-served team can't pass a waiting
        under-served one; once a queued request finds no place, only the partial prefills already holding
        seats go on. Requests preempted this step wait for the next (they gave up their KV for someone). A
        partial prefill that yielded its seat stays in the order: what the step has left when those ranked
        before it are placed (a seat, tokens, blocks) is its, as it would be next step. It can't ping-pong:
        once back it has not run a step, so no candidate makes it give way again in this one.
        """
        admitting = True
        while True:
            queued = [r for r in (*self.waiting, *self.swapped) if r not in preempted] if admitting else []
            prefilling = [r for r in self.running if r not in scheduled and self._in_prefill(r)]
            if not queued and not prefilling:
                return
            candidate = min((*queued, *prefilling), key=self._fair_rank)
            if candidate.status is RequestStatus.RUNNING:
                if budget <= 0:
                    return
                num_new, refund = self._continue_prefill(candidate, budget, batch, scheduled, preempted)
                budget += refund - (num_new or 0)
                continue
            if candidate.status is RequestStatus.WAITING and self._waits_for_shared_prefix(candidate, scheduled):
                admitting = False  # it keeps its place: nothing queued passes it this step
                continue
            if self._seats_taken() + 1 + self._unforked(candidate) <= self.config.max_num_seqs:
                if budget <= 0:
                    return
                if candidate.status is RequestStatus.SWAPPED:
                    num_new = self._swap_in(candidate, batch, budget)
                else:
                    num_new = self._start_waiting(candidate, batch, budget)
                if num_new is not None:
                    scheduled[candidate] = num_new
                    budget -= num_new
                    continue
            victim = self._victim_for(candidate)
            if victim is None:  # no queued request passes it; the partial prefills holding seats go on
                admitting = False
                continue
            budget += scheduled.pop(victim, 0)
            if self._in_prefill(victim):
                self._yield_seat(victim)
            else:
                self._preempt(victim, batch)
                preempted.add(victim)
            self.counters.preemptions_fair += 1

    def _continue_prefill(
        self,
        request: Request,
        budget: int,
        batch: ScheduledBatch,
        scheduled: dict[Request, int],
        preempted: set[Request],
    ) -> tuple[int | None, int]:
        """The next chunk of a running request's prefill, preempting for blocks as `_schedule_running` does:
        (tokens scheduled, or None when it preempted itself; budget given back by those preempted)."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        refund = 0
        while True:
            copies = self.blocks.allocate_slots(request, num_new)
            if copies is not None:
                break
            if self._release_held_blocks(request):
                continue
            victim = self._victim_for_blocks()
            refund += scheduled.pop(victim, 0)
            self._preempt(victim, batch)
            preempted.add(victim)
            if victim is request:
                return None, refund
        batch.copies.extend(copies)
        self.counters.copy_on_write_blocks += len(copies)
        scheduled[request] = num_new
        return num_new, refund

    def _waits_for_shared_prefix(self, request: Request, scheduled: dict[Request, int]) -> bool:
        """Whether a request with nothing computed should wait a step because its next uncached prompt block is
        one that a request scheduled this step computes (same team and tokens so far: the same block hash).

        Blocks enter the prefix cache after the step that fills them, so two requests with a shared prompt
        start (a team's system prompt, a batch's instructions) admitted in one step would both compute it.
        Waiting a step makes it a cache hit instead: computed once, and on a CPU, where a step's time is its
        tokens, that step comes sooner by as much. A wait lasts while the shared blocks are being computed
        (a long prefix in chunks: it follows them step by step), and ends where the prompts part."""
        if request.block_ids or not self.blocks.enable_prefix_caching:
            return False
        next_block = len(self.blocks.find_cached_prefix(request))
        if next_block >= (request.num_tokens - 1) // self.blocks.block_size:  # no full block left to share
            return False
        wanted = request.block_hashes[next_block]
        size = self.blocks.block_size
        for other, num_new in scheduled.items():
            filled = other.block_hashes[
                other.num_computed_tokens // size : (other.num_computed_tokens + num_new) // size
            ]
            if wanted in filled:
                return True
        return False

    @staticmethod
    def _in_prefill(request: Request) -> bool:
        """More than one known token left to compute: a prompt (or a recompute) not yet caught up."""
        return request.num_tokens - request.num_computed_tokens > 1

    def _yield_seat(self, request: Request) -> None:
        """A partial prefill gives its seat back but keeps its blocks and progress: it resumes where it
        stopped (_start_waiting). Any slots allocated for it this step stay in its table, unused until then."""
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _release_held_blocks(self, keep: Request) -> bool:
        """Blocks are short: the most over-served queued request that holds blocks (a yielded partial
        prefill) gives them back. Its full blocks stay in the prefix cache, so a resume finds them unless
        they are evicted first. False when none holds any."""
        holders = [r for r in self.waiting if r.block_ids and r is not keep]
        if not holders:
            return False
        holder = max(holders, key=self._fair_rank)
        self.blocks.free(holder)
        holder.num_computed_tokens = 0
        return True

    def _newcomer_steps_short(self, scheduled: dict[Request, int]) -> None:
        """A step that computes the first token of a team with nothing decoding carries at most
        FIRST_TOKEN_STEP_PREFILL prefill tokens of the teams served more than it, the rest cut (they keep
        their seats, blocks and progress, and go on next step). Never two such steps running, so that
        newcomers arriving on every step still leave the others half the steps."""
        was_short, self.newcomer_step_was_short = self.newcomer_step_was_short, False
        if was_short:
            return
        decoding = {r.team for r in self.running if not self._in_prefill(r) and r.output_token_ids}
        newcomers = [
            r
            for r, count in scheduled.items()
            if r.team not in decoding
            and not r.output_token_ids
            and r.num_computed_tokens + count >= r.num_tokens
            and not r.tenancy.background
        ]
        if not newcomers:
            return
        least = min(self.ledger.service(r.team) for r in newcomers)
        newcomer_teams = {r.team for r in newcomers}
        allowed = FIRST_TOKEN_STEP_PREFILL
        cut = False
        # the most served first lose their chunks; the least served keep theirs
        for request in sorted(scheduled, key=lambda r: self.ledger.service(r.team)):
            count = scheduled[request]
            if (
                not self._in_prefill(request)
                or request.team in newcomer_teams
                or self.ledger.service(request.team) <= least
            ):
                continue
            keep = min(count, allowed)
            allowed -= keep
            if keep < count:
                cut = True
                if keep:
                    scheduled[request] = keep
                else:
                    del scheduled[request]
        self.newcomer_step_was_short = cut

    def _fair_rank(self, request: Request) -> tuple[int, float, int, int]:
        """Lowest goes first; the highest running request is the first to give way. At equal service the
        team with fewer sequences under way (started, unfinished) goes first: a team that just joined, level
        with the least-served active team (charged already for prompts it may still be prefilling), does
        not queue behind that team's requests."""
        return (
            request.tenancy.priority,
            self.ledger.service(request.team),
            self.started_by_team[request.team],
            request.arrival_seq,
        )

    def _victim_for_blocks(self) -> Request:
        if self.fair:
            return max(self.running, key=self._fair_rank)
        return self.running[-1]

    def _victim_for(self, candidate: Request) -> Request | None:
        """The running request that gives its place to `candidate`: of a lower priority class, or at the same
        priority of a team served more than the candidate's even once the candidate's prompt is counted
        (else the two would trade places on every admission); newest first, and only once it has run
        `fair_min_run_steps`. A partial prefill gives way first: to a candidate's first chunk as soon as it
        has run a step and its team ranks after the candidate's (it keeps its blocks, so yielding costs it
        nothing), else by the same rule as the rest."""
        rank = self._fair_rank(candidate)
        margin = self.config.fair_prompt_weight * candidate.num_prompt_tokens / candidate.tenancy.weight
        victims = [request for request in self.running if self._gives_way(request, candidate, rank, margin)]
        return max(victims, key=lambda r: (self._in_prefill(r), self._fair_rank(r)), default=None)

    def _gives_way(
        self, request: Request, candidate: Request, rank: tuple[int, float, int, int], margin: float
    ) -> bool:
        if request.tenancy.priority != rank[0]:
            return request.tenancy.priority > rank[0] and self._has_run(request)
        if request.team == candidate.team or not self._has_run(request):
            return False
        if self._in_prefill(request):
            # Yielding costs it nothing, so it gives way to any team ranked after the candidate's; but only
            # to a candidate's first chunk, so that two partial prefills never take turns at one seat (nor
            # at each other's blocks when the pool runs short).
            if not candidate.prompt_charged:
                return self._fair_rank(request)[1:3] > rank[1:3]
        return self.ledger.service(request.team) > rank[1] + margin

    def _has_run(self, request: Request) -> bool:
        """A partial prefill may give way once it has run a step, anyone else after `fair_min_run_steps`."""
        minimum = 1 if self._in_prefill(request) else self.config.fair_min_run_steps
        return self.num_steps - request.running_since_step >= minimum

    def _swap_in(self, request: Request, batch: ScheduledBatch, budget: int) -> int | None:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        while not self.blocks.can_swap_in(request, num_new):
            if not self._release_held_blocks(request):
                return None
        self.swapped.remove(request)
        batch.swap_in.extend(self.blocks.swap_in(request, hold_cpu_blocks=True))
        batch.copies.extend(self.blocks.allocate_slots(request, num_new) or ())
        self._start_running(request)
        return num_new

    def _start_waiting(self, request: Request, batch: ScheduledBatch, budget: int) -> int | None:
        # (a yielded request may come back with nothing computed: its chunk was cut, see _newcomer_steps_short)
        first_admission = not request.prompt_charged and not request.output_token_ids
        # A yielded partial prefill holds its blocks: it goes on from where it stopped.
        holds_blocks = bool(request.block_ids)
        cached = [] if holds_blocks else self.blocks.find_cached_prefix(request)
        num_computed = request.num_computed_tokens if holds_blocks else len(cached) * self.blocks.block_size
        num_new = min(request.num_tokens - num_computed, budget)
        while (copies := self.blocks.allocate_slots(request, num_new, cached)) is None:
            if not self._release_held_blocks(request):
                return None
        self.waiting.remove(request)
        batch.copies.extend(copies)
        request.num_computed_tokens = num_computed
        if first_admission:
            request.num_cached_tokens = num_computed
            self.counters.prefix_cache_queries += request.num_prompt_tokens
            self.counters.prefix_cache_hits += num_computed
        if not request.prompt_charged:
            request.prompt_charged = True
            self.ledger.charge(request.team, prompt_tokens=request.num_prompt_tokens)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self._start_running(request)
        return num_new

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.running_since_step = self.num_steps
        self.running.append(request)
        if request not in self.started:
            self.started.add(request)
            self.started_by_team[request.team] += 1

    @staticmethod
    def _unforked(request: Request) -> int:
        return sum(1 for sibling in request.siblings if sibling.fork_parent is request)

    def _seats_taken(self) -> int:
        """Running sequences plus the siblings that will fork off them."""
        return len(self.running) + sum(self._unforked(request) for request in self.running)

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        self.running.remove(victim)
        victim.draft_token_ids = []
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
