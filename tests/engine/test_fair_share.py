"""Fair share between teams in the engine: cache isolation, the service bound, work conservation, exact output."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.tenancy import Tenancy
from tests.support.engine import QUESTIONS, chat_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir)))


def prompt_of(number: int, length: int) -> list[int]:
    return [50 + (number * 97 + i * 13) % 4000 for i in range(length)]


def drain(engine: LLMEngine, outputs: dict[str, list[int]] | None = None, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return
        for output in engine.step():
            if outputs is not None:
                for delta in output.deltas:
                    outputs.setdefault(f"{output.request_id}/{delta.index}", []).extend(delta.token_ids)
    raise AssertionError("the engine stopped making progress")


def cached_tokens_of(engine: LLMEngine, request_id: str, prompt: list[int], tenancy: Tenancy) -> int:
    engine.add_request(request_id, prompt, GREEDY, tenancy)
    cached = engine.groups[request_id].sequences[0]
    drain(engine)
    return cached.num_cached_tokens


# ---- cache isolation --------------------------------------------------------------------------------
def test_a_cached_prefix_is_reused_within_a_team_and_never_across_teams(tiny):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=16), tiny)
    system_prompt = prompt_of(1, 100)
    assert cached_tokens_of(engine, "a1", system_prompt + [7, 8], Tenancy(team="a")) == 0
    assert cached_tokens_of(engine, "a2", system_prompt + [9], Tenancy(team="a")) == 96
    assert cached_tokens_of(engine, "b1", system_prompt + [9], Tenancy(team="b")) == 0
    assert engine.stats.prefix_cache_hits == 96  # the metric counts only what was really reused


def test_teams_in_one_cache_group_or_the_global_scope_share_prefixes(tiny):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=16), tiny)
    system_prompt = prompt_of(2, 64)
    assert cached_tokens_of(engine, "a", system_prompt + [5], Tenancy(team="a", cache_salt="group-1")) == 0
    assert cached_tokens_of(engine, "b", system_prompt + [6], Tenancy(team="b", cache_salt="group-1")) == 64
    assert cached_tokens_of(engine, "c", system_prompt + [6], Tenancy(team="c", cache_salt="")) == 0
    assert cached_tokens_of(engine, "d", system_prompt + [6], Tenancy(team="d", cache_salt="")) == 64


# ---- the service bound, work conservation, exact output ----------------------------------------------
def service_bound(config: EngineConfig, longest_prompt: int, weight_g: float, weight_f: float = 1.0) -> float:
    """U_fg from engine/scheduler.py, the most team g may lead team f by while both have requests queued:
    prompt_weight * P / w_f + (prompt_weight * P + (m + 1) * output_weight * S) / w_g."""
    return (
        config.fair_prompt_weight * longest_prompt / weight_f
        + (
            config.fair_prompt_weight * longest_prompt
            + (config.fair_min_run_steps + 1) * config.fair_output_weight * config.max_num_seqs
        )
        / weight_g
    )


def fits_now(scheduler: Scheduler, request: Request, budget_left: int) -> bool:
    num_new = min(request.num_tokens - request.num_computed_tokens, budget_left)
    if request in scheduler.swapped:
        return scheduler.blocks.can_swap_in(request, num_new)
    return scheduler.blocks.blocks_for(num_new) <= scheduler.blocks.num_free_blocks


def watch_work_conservation(engine: LLMEngine) -> None:
    """After each scheduling decision: no seat, token or block left idle while a queued request would fit
    (prefix caching off, so that "would fit" is plain arithmetic; a step that preempted is exempt)."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def checked() -> ScheduledBatch:
        preemptions_before = scheduler.counters.preemptions_recompute + scheduler.counters.preemptions_swap
        batch = schedule()
        preempted = scheduler.counters.preemptions_recompute + scheduler.counters.preemptions_swap > preemptions_before
        queued = [*scheduler.waiting, *scheduler.swapped]
        budget_left = engine.config.max_num_batched_tokens - batch.num_tokens
        seats_free = scheduler._seats_taken() < engine.config.max_num_seqs
        if queued and seats_free and budget_left > 0 and not preempted:
            best = min(queued, key=scheduler._fair_rank)
            assert not fits_now(scheduler, best, budget_left), "a seat stayed idle while a request could run"
        return batch

    scheduler.schedule = checked  # type: ignore[method-assign]


workloads = st.fixed_dictionaries(
    {
        # per team: (weight, [(prompt length, max tokens)...])
        "teams": st.lists(
            st.tuples(
                st.sampled_from([1.0, 2.0]),
                st.lists(st.tuples(st.integers(1, 30), st.integers(1, 14)), min_size=3, max_size=8),
            ),
            min_size=2,
            max_size=3,
        ),
        "max_num_seqs": st.integers(1, 5),
        "max_num_batched_tokens": st.sampled_from([16, 32, 64]),
        "extra_blocks": st.integers(0, 12),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "fair_min_run_steps": st.integers(1, 4),
        "interleave": st.booleans(),  # submit team by team, or round robin
    }
)


@given(workload=workloads)
@settings(
    max_examples=30,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_backlogged_teams_stay_within_the_bound_with_exact_output_and_no_idle_seat(tiny, workload):
    workload = dict(workload)
    teams = workload.pop("teams")
    interleave = workload.pop("interleave")
    extra = workload.pop("extra_blocks")
    jobs = [
        (f"t{team}", weight, number, length, max_tokens)
        for team, (weight, requests) in enumerate(teams)
        for number, (length, max_tokens) in enumerate(requests)
    ]
    if interleave:
        jobs.sort(key=lambda job: (job[2], job[0]))
    longest = max(length + max_tokens for *_, length, max_tokens in jobs)
    config = EngineConfig(
        block_size=8, num_kv_blocks=-(-longest // 8) + 1 + extra, enable_prefix_caching=False, **workload
    )
    engine = LLMEngine(config, tiny)
    watch_work_conservation(engine)
    prompts = {}
    for team, weight, number, length, max_tokens in jobs:
        prompts[f"{team}-{number}"] = (prompt_of(hash(team) % 50 + number, length), max_tokens)
        engine.add_request(
            f"{team}-{number}",
            prompts[f"{team}-{number}"][0],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            Tenancy(team=team, weight=weight),
        )
    weights = {team: weight for team, weight, *_ in jobs}
    longest_prompt = max(length for *_, length, _ in jobs)
    backlogged_throughout = set(weights)
    outputs: dict[str, list[int]] = {}
    for _ in range(3000):
        if not engine.has_unfinished:
            break
        scheduler = engine.scheduler
        queued_teams = {request.team for request in (*scheduler.waiting, *scheduler.swapped)}
        backlogged_throughout &= queued_teams
        for f, g in combinations(sorted(backlogged_throughout), 2):
            c_f, c_g = scheduler.ledger.service(f), scheduler.ledger.service(g)
            assert c_g - c_f <= service_bound(config, longest_prompt, weights[g], weights[f]) + 1e-9
            assert c_f - c_g <= service_bound(config, longest_prompt, weights[f], weights[g]) + 1e-9
        for output in engine.step():
            for delta in output.deltas:
                outputs.setdefault(output.request_id, []).extend(delta.token_ids)
    assert not engine.has_unfinished

    reference = LLMEngine(EngineConfig(num_kv_blocks=256, scheduling="fcfs", enable_prefix_caching=False), tiny)
    for request_id, (prompt, max_tokens) in prompts.items():
        reference.add_request(
            request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    expected: dict[str, list[int]] = {}
    drain(reference, expected)
    assert outputs == {request_id: expected[f"{request_id}/0"] for request_id in prompts}
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and len(blocks.free_cpu_blocks) == blocks.num_cpu_blocks


def largest_gap_while_backlogged(engine: LLMEngine, teams: tuple[str, str]) -> float:
    """Steps the engine to the end; the largest counter gap seen while both teams had requests queued."""
    largest = 0.0
    for _ in range(5000):
        if not engine.has_unfinished:
            return largest
        scheduler = engine.scheduler
        queued = {request.team for request in (*scheduler.waiting, *scheduler.swapped)}
        if set(teams) <= queued:
            largest = max(largest, abs(scheduler.ledger.service(teams[0]) - scheduler.ledger.service(teams[1])))
        engine.step()
    raise AssertionError("the engine stopped making progress")


@pytest.mark.parametrize("scheduling", ["fair", "fcfs"])
def test_a_flooding_team_starves_another_only_under_fcfs(tiny, scheduling):
    config = EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=2, scheduling=scheduling, fair_min_run_steps=2)
    engine = LLMEngine(config, tiny)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for number in range(12):
        engine.add_request(f"flood-{number}", prompt_of(number, 20), params, Tenancy(team="flood"))
    for number in range(3):
        engine.add_request(f"quiet-{number}", prompt_of(100 + number, 20), params, Tenancy(team="quiet"))
    gap = largest_gap_while_backlogged(engine, ("flood", "quiet"))
    bound = service_bound(config, 20, 1.0)
    if scheduling == "fair":
        assert gap <= bound
    else:
        assert gap > 2 * bound  # the quiet team waited behind every flood request


def test_a_waiting_team_takes_the_seat_of_the_newest_request_that_has_run_its_minimum(tiny):
    engine = LLMEngine(EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=2, fair_min_run_steps=3), tiny)
    long_run = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    running = lambda: {request.request_id for request in engine.scheduler.running}  # noqa: E731
    engine.add_request("a-old", prompt_of(1, 10), long_run, Tenancy(team="a"))
    engine.step()
    engine.add_request("a-new", prompt_of(2, 10), long_run, Tenancy(team="a"))
    engine.step()
    # a 2-token prompt: team a need only lead it by 2 to give way (the candidate's prompt is the margin)
    engine.add_request("b-1", prompt_of(3, 2), GREEDY, Tenancy(team="b"))
    engine.step()  # b-1 joined level with team a, whose counter moves on; both of a's requests are protected
    assert running() == {"a-old", "a-new"}
    engine.step()  # a-old has run 3 steps, a-new only 2
    assert running() == {"a-new", "b-1"}
    drain(engine)
    preemptions_so_far = engine.stats.num_preemptions_fair

    engine.add_request("a-3", prompt_of(4, 10), long_run, Tenancy(team="a"))
    engine.add_request("a-4", prompt_of(5, 10), long_run, Tenancy(team="a"))
    for _ in range(4):
        engine.step()
    engine.add_request("b-2", prompt_of(6, 2), GREEDY, Tenancy(team="b"))
    engine.step()
    engine.step()
    assert running() == {"a-3", "b-2"}  # of two that may give way, the newest does
    assert engine.stats.num_preemptions_fair == preemptions_so_far + 1
    drain(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_lower_priority_value_runs_first_and_fcfs_holds_within_a_team(tiny):
    engine = LLMEngine(EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=1), tiny)
    order: list[str] = []
    for request_id, priority in (("first", 0), ("second", 0), ("urgent", -1), ("third", 0), ("batch", 5)):
        engine.add_request(request_id, prompt_of(len(order) + 7, 12), GREEDY, Tenancy(team="a", priority=priority))
    for _ in range(500):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            if output.finished:
                order.append(output.request_id)
    assert order == ["urgent", "first", "second", "third", "batch"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_output_equals_hf_under_fair_preemption(smollm2, hf_greedy, mode):
    engine = LLMEngine(
        EngineConfig(
            num_kv_blocks=256, max_num_seqs=3, fair_min_run_steps=2, preemption_mode=mode, enable_prefix_caching=False
        ),
        smollm2,
    )
    prompts = {f"q{number}": chat_prompt(smollm2.tokenizer, question) for number, question in enumerate(QUESTIONS)}
    params = SamplingParams(temperature=0.0, max_tokens=16)
    names = list(prompts)
    for name in names[:5]:
        engine.add_request(name, prompts[name], params, Tenancy(team="a"))
    outputs: dict[str, list[int]] = {}
    for _ in range(6):
        for output in engine.step():
            for delta in output.deltas:
                outputs.setdefault(f"{output.request_id}/{delta.index}", []).extend(delta.token_ids)
    for name in names[5:]:
        engine.add_request(name, prompts[name], params, Tenancy(team="b"))
    drain(engine, outputs)
    assert engine.stats.num_preemptions_fair > 0
    for name, prompt in prompts.items():
        assert outputs[f"{name}/0"] == hf_greedy(prompt, 16), f"{name} diverged from HF"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_tokens_served_in_the_last_minute_fall_back_to_zero_when_a_team_goes_quiet(tiny):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=16), tiny)
    now = [1000.0]
    engine.scheduler.ledger.clock = lambda: now[0]
    engine.add_request("a", prompt_of(1, 20), GREEDY, Tenancy(team="a"))
    drain(engine)
    team = engine.stats.teams["a"]
    assert (team.running, team.waiting, team.prompt_tokens_total, team.generation_tokens_total) == (0, 0, 20, 8)
    assert team.tokens_last_minute(now=1030.0) == 28
    assert team.tokens_last_minute(now=1061.0) == 0


# ---- departed teams are forgotten -----------------------------------------------------------------


LEDGER_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 2)),
        st.tuples(st.just("leave"), st.integers(0, 2)),
        st.tuples(st.just("charge"), st.integers(0, 2), st.integers(1, 200)),
        st.tuples(st.just("wait"), st.sampled_from([0.5, 30.0, 70.0])),
    ),
    max_size=60,
)
# An over-served team goes quiet while a less-served one stays: on its return it must not start lower.
OVER_SERVED_RETURNS = [("join", 0), ("join", 1), ("charge", 0, 100), ("leave", 0), ("wait", 70.0), ("join", 0)]


@settings(max_examples=400, deadline=None)
@example(ops=OVER_SERVED_RETURNS)
@given(ops=LEDGER_OPS)
def test_forgetting_idle_teams_never_changes_an_active_teams_counter(ops):
    """A ledger that forgets departed teams and one that remembers every team give every active team
    the same counter, whatever the order of arrivals, service, departures and pauses."""
    from engine.fair_share import TeamLedger

    now = [0.0]
    forgetful = TeamLedger(clock=lambda: now[0], forget_after_s=60)
    remembering = TeamLedger(clock=lambda: now[0], forget_after_s=float("inf"))
    active = dict.fromkeys(range(3), 0)
    for op in ops:
        team = f"team:{op[1]}"
        if op[0] == "wait":
            now[0] += op[1]
            continue
        if op[0] == "leave" and not active[op[1]]:
            continue
        if op[0] == "charge" and not active[op[1]]:
            continue
        for ledger in (forgetful, remembering):
            if op[0] == "join":
                ledger.join(team)
            elif op[0] == "leave":
                ledger.leave(team)
            else:
                ledger.charge(team, output_tokens=op[2])
        active[op[1]] += {"join": 1, "leave": -1, "charge": 0}[op[0]]
        for number, count in active.items():
            if count:
                name = f"team:{number}"
                assert forgetful.service(name) == pytest.approx(remembering.service(name))
    assert set(forgetful.teams) <= set(remembering.teams)


def test_the_engine_forgets_teams_that_have_been_gone_a_while(tiny):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=16), tiny)
    now = [1000.0]
    engine.scheduler.ledger.clock = lambda: now[0]
    for number in range(40):  # forty teams, one short request each, then silence
        engine.add_request(f"r{number}", prompt_of(number, 8), GREEDY, Tenancy(team=f"team:{number}"))
        drain(engine)
        now[0] += 1.5
    assert len(engine.stats.teams) == 40
    now[0] += 30  # the first has been gone 90 s: not long enough to be forgotten
    engine.add_request("late", prompt_of(99, 8), GREEDY, Tenancy(team="team:late"))
    assert len(engine.stats.teams) == 41
    now[0] += 120
    engine.add_request("later", prompt_of(98, 8), GREEDY, Tenancy(team="team:later"))
    drain(engine)
    assert set(engine.stats.teams) == {"team:late", "team:later"}  # the departed are gone ...
    assert engine.stats.teams["team:late"].prompt_tokens_total == 8  # ... the active kept their counts
