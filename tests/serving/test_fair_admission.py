"""Admission work in fair turns across teams: a flood from one team queues behind itself, not in front of
a quiet team's request; a client that goes away while waiting gives its place up."""

from __future__ import annotations

import asyncio

from app.serving.admission import FairAdmission


async def admit_all(admission: FairAdmission, arrivals: list[str], order: list[str]) -> None:
    release = asyncio.Event()

    async def one(team: str, number: int) -> None:
        async with admission.turn(team):
            order.append(f"{team}{number}")
            await release.wait()  # the admission work: a template, a tokenizer call, the holds
            release.clear()

    tasks = [asyncio.create_task(one(team, number)) for number, team in enumerate(arrivals)]
    await asyncio.sleep(0)
    while not all(task.done() for task in tasks):
        release.set()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)


def test_a_quiet_teams_request_waits_one_turn_not_the_whole_flood():
    admission = FairAdmission(slots=2)
    order: list[str] = []
    arrivals = ["a"] * 160 + ["b"] + ["a"] * 3 + ["c"]
    asyncio.run(admit_all(admission, arrivals, order))
    assert len(order) == len(arrivals)
    # two slots start with a's first two; then a and b take turns, and c joins the round
    assert order.index("b160") <= 4, order[:8]
    assert order.index("c164") <= 6, order[:8]
    assert [name for name in order if name.startswith("a")] == [f"a{n}" for n in range(160)] + [
        f"a{n}" for n in range(161, 164)
    ]  # first come, first served within a team
    assert admission.busy == 0 and admission.num_waiting == 0


def test_a_waiter_that_goes_away_gives_its_place_up():
    async def scenario() -> None:
        admission = FairAdmission(slots=1)
        entered: list[str] = []
        held = asyncio.Event()

        async def holder() -> None:
            async with admission.turn("a"):
                entered.append("holder")
                await held.wait()

        async def waiter(team: str) -> None:
            async with admission.turn(team):
                entered.append(team)

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        gone = asyncio.create_task(waiter("b"))
        stays = asyncio.create_task(waiter("c"))
        await asyncio.sleep(0)
        assert admission.num_waiting == 2
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert admission.num_waiting == 1
        held.set()
        await asyncio.gather(first, stays)
        assert entered == ["holder", "c"]
        assert admission.busy == 0 and admission.num_waiting == 0

    asyncio.run(scenario())
