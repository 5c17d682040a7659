"""The batch runner stops when the app shuts down, even when a batch ends (and wakes the runner) at the
same instant: Python 3.11's asyncio.wait_for returned the wakeup and dropped the cancel when both came
together, so the runner polled on and the app's shutdown waited for it forever."""

from __future__ import annotations

import asyncio
import threading

from app.batches.runner import BatchRunner


class NoBatches:
    """A batch store with nothing to claim; says when the runner has looked."""

    def __init__(self) -> None:
        self.looked = threading.Event()

    def claim_next(self, *_: object) -> None:
        self.looked.set()


async def stop_as_it_wakes() -> bool:
    jobs = NoBatches()
    runner = BatchRunner(None, jobs=jobs, files=None, max_in_flight=1, poll_s=60.0)  # type: ignore[arg-type]
    await runner.start()
    while not jobs.looked.is_set():
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.05)  # back in its wait for a wakeup or the next poll
    runner.wakeup.set()  # a batch just ended: the runner's wait completes in this loop turn ...
    stopping = asyncio.create_task(runner.stop())  # ... and shutdown cancels it in the same one
    done, _ = await asyncio.wait({stopping}, timeout=5.0)
    task = runner.task
    if task is not None:  # not stopped: do not leave it polling behind the test
        task.cancel()
        await asyncio.gather(task, stopping, return_exceptions=True)
    return stopping in done


def test_the_runner_stops_when_shutdown_meets_a_wakeup():
    assert asyncio.run(stop_as_it_wakes()), "the batch runner did not stop: shutdown would hang"
