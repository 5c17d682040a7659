"""app/serving/encoder_queue.py: one worker, batches of concurrent requests run together, failures and
cancellations stay with their own requests. A fake model records the batches it is given."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from app.serving.encoder_queue import EncoderQueue


class RecordingModel:
    """Each input's vector is [its first token id]; the first batch waits until `release` is set, so
    the jobs sent meanwhile pile up in the queue."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[list[int]]] = []
        self.release = threading.Event()
        self.fail_on = fail_on

    def encode_token_ids(self, token_ids):
        if not self.batches:
            self.release.wait(10)
        self.batches.append(token_ids)
        if any(ids[0] == self.fail_on for ids in token_ids):
            raise RuntimeError("the model failed")
        return torch.tensor([[float(ids[0])] for ids in token_ids]), [len(ids) for ids in token_ids]


async def wait_until(predicate) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


def test_requests_waiting_together_run_as_one_batch_and_get_their_own_vectors():
    async def run() -> None:
        queue, model = EncoderQueue(max_batch_inputs=8), RecordingModel()
        first = asyncio.ensure_future(queue.encode(model, [[100]]))
        await wait_until(lambda: queue._worker is not None and not queue._jobs)  # the worker holds it
        waiting = [asyncio.ensure_future(queue.encode(model, [[i], [i + 50]])) for i in range(6)]
        await wait_until(lambda: len(queue._jobs) == 6)
        model.release.set()
        assert (await first).tolist() == [[100.0]]
        results = await asyncio.gather(*waiting)
        assert [r.flatten().tolist() for r in results] == [[i, i + 50] for i in range(6)]
        assert [len(batch) for batch in model.batches] == [1, 8, 4]  # 8 inputs at most per batch

    asyncio.run(run())


def test_a_cancelled_request_is_skipped():
    async def run() -> None:
        queue, model = EncoderQueue(), RecordingModel()
        first = asyncio.ensure_future(queue.encode(model, [[1]]))
        await wait_until(lambda: queue._worker is not None and not queue._jobs)
        gone = asyncio.ensure_future(queue.encode(model, [[2]]))
        kept = asyncio.ensure_future(queue.encode(model, [[3]]))
        await wait_until(lambda: len(queue._jobs) == 2)
        gone.cancel()
        await wait_until(lambda: queue._jobs[0].result.cancelled())
        model.release.set()
        await first
        assert (await kept).tolist() == [[3.0]]
        assert model.batches == [[[1]], [[3]]]

    asyncio.run(run())


def test_a_failure_reaches_its_batch_and_the_worker_goes_on():
    async def run() -> None:
        queue, model = EncoderQueue(), RecordingModel(fail_on=7)
        model.release.set()
        with pytest.raises(RuntimeError, match="failed"):
            await queue.encode(model, [[7]])
        assert (await queue.encode(model, [[8]])).tolist() == [[8.0]]

    asyncio.run(run())


def test_models_are_never_mixed_in_one_batch():
    async def run() -> None:
        queue, a, b = EncoderQueue(), RecordingModel(), RecordingModel()
        b.release.set()
        first = asyncio.ensure_future(queue.encode(a, [[1]]))
        await wait_until(lambda: queue._worker is not None and not queue._jobs)
        jobs = [asyncio.ensure_future(queue.encode(model, [[n]])) for n, model in ((2, a), (3, b), (4, a))]
        await wait_until(lambda: len(queue._jobs) == 3)
        a.release.set()
        await asyncio.gather(first, *jobs)
        assert a.batches == [[[1]], [[2]], [[4]]] and b.batches == [[[3]]]

    asyncio.run(run())
