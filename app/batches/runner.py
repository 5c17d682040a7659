"""The batch runner: a background task of the app that feeds batch lines into the engine at the lowest
priority, a bounded number at a time, so interactive requests are scheduled ahead of every waiting line.

Each finished line is written to the database as it finishes (jobs.BatchStore.record_line); a restart
skips the lines found there and runs the rest, so no line is lost or recorded twice. A cancel stops the
feeding and aborts the lines in flight (the route sees its client go away: the engine frees their KV
blocks and the tokens they made are metered), then writes the output so far; past its completion window
a batch does the same and ends `expired`. Lines that never ran or were cut short go to the error file,
saying why.

A runner holds a lease on the batch it runs (renewed while it runs, released when it stops), so replicas
sharing the database never run one batch at once; one that was killed lets go when its lease runs out."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp

from app.batches.dispatch import dispatch
from app.batches.files import FileStore
from app.batches.jobs import BatchStore, expired
from app.batches.lines import InputLine, encode, error_line, output_line, read_lines
from app.gateway.auth import KeyPrincipal, principal_of
from app.gateway.crud import utcnow
from app.tables import ApiKey, BatchJob, Team

log = logging.getLogger("tokenmill.batches")

# Lower runs first; a request body may ask for at most 1000, so every interactive request outranks this.
BATCH_PRIORITY = 1_000_000
STATUS_CHECK_S = 0.5  # how stale a cancel made by another replica may be seen while feeding
CUT_SHORT = {
    "cancelled": ("batch_cancelled", "The batch was cancelled while this request ran; the tokens it made are billed."),
    "expired": ("batch_expired", "The batch's completion window ended while this request ran; its tokens are billed."),
}


@dataclass
class Halt:
    """Why a batch's feeding stopped early ("cancelled", "expired", or "lost": another runner has the
    batch); setting it reads to each line in flight as its client going away."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str | None = None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.event.set()


def cut_short(body: dict[str, Any]) -> bool:
    """Whether a 2xx response is one the engine aborted before it finished (chat and completions say so
    per choice, a response by its status)."""
    choices = body.get("choices")
    if isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices):
        return True
    return body.get("object") == "response" and body.get("status") in ("incomplete", "cancelled")


def batch_principal(sessions: sessionmaker[Session], key_id: int | None) -> KeyPrincipal | None:
    """The key that created the batch, as its lines run: its budget and model access, none of its rpm /
    tpm limits, at the batch priority. None when the key or its team is gone."""
    if key_id is None:
        return None
    with sessions() as session:
        found = session.execute(
            select(ApiKey, Team).join(Team, Team.id == ApiKey.team_id).where(ApiKey.id == key_id)
        ).first()
    if found is None:
        return None
    principal = principal_of(*found)
    if not principal.valid_at(time.time()):
        return None
    return dataclasses.replace(principal, batch=True, rate_scopes=(), priority_floor=BATCH_PRIORITY)


class BatchRunner:
    def __init__(
        self,
        app: ASGIApp,
        *,
        jobs: BatchStore,
        files: FileStore,
        max_in_flight: int,
        poll_s: float = 1.0,
        lease_s: float = 30.0,
    ) -> None:
        self.app = app
        self.runner_id = f"{socket.gethostname()[:40]}-{uuid.uuid4().hex[:12]}"  # this process, for the lease
        self.lease = timedelta(seconds=lease_s)
        self.jobs = jobs
        self.files = files
        self.max_in_flight = max_in_flight
        self.poll_s = poll_s
        self.cancelled: set[str] = set()  # cancels made in this process, seen at once
        self.halts: dict[str, Halt] = {}  # the batches being fed here, to stop their lines in flight
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.run_forever(), name="batch-runner")

    async def stop(self) -> None:
        """Lines in flight are dropped unrecorded: the next start runs them again."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    def wake(self, cancelled: str | None = None) -> None:
        if cancelled is not None:
            self.cancelled.add(cancelled)
            if cancelled in self.halts:
                self.halts[cancelled].set("cancelled")
        self.wakeup.set()

    async def run_forever(self) -> None:
        while True:
            try:
                job = await run_in_threadpool(self.jobs.claim_next, self.runner_id, self.lease)
                if job is not None:
                    try:
                        await self.run(job)
                    finally:  # also on shutdown: the next process takes the batch over at once
                        await run_in_threadpool(self.jobs.release, job.id, self.runner_id)
                    continue
            except asyncio.CancelledError:
                raise
            except Exception:  # a database hiccup: try again after a pause, never die
                log.exception("batch runner pass failed")
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), self.poll_s)
            except TimeoutError:
                pass

    async def run(self, job: BatchJob) -> None:
        lost = asyncio.Event()
        keeper = asyncio.create_task(self.hold(job.id, lost))
        try:
            await self.run_held(job, lost)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)

    async def hold(self, batch_id: str, lost: asyncio.Event) -> None:
        """Renews the batch's lease while it runs; if another runner has it (this process stalled past the
        lease), stops this one from feeding or finishing it."""
        while True:
            await asyncio.sleep(self.lease.total_seconds() / 3)
            if not await run_in_threadpool(self.jobs.renew, batch_id, self.runner_id, self.lease):
                lost.set()
                return

    async def run_held(self, job: BatchJob, lost: asyncio.Event) -> None:
        if job.status == "validating":
            if not await run_in_threadpool(self.jobs.set_status, job.id, "in_progress", only_from=("validating",)):
                return  # cancelled meanwhile: the next pass sees it
            job.status = "in_progress"
        try:
            input_path = self.files.path_of(job.input_file_id)
            lines = await run_in_threadpool(read_lines, input_path, job.endpoint)
        except OSError:
            await self.fail(job, "input_file_missing", "The batch's input file is gone.")
            return
        principal = await run_in_threadpool(batch_principal, self.jobs.sessions, job.key_id)
        if principal is None:
            await self.fail(job, "invalid_api_key", "The API key that created this batch is no longer valid.")
            return
        if job.status == "in_progress":
            await self.feed(job, lines, principal, lost)
        if not lost.is_set():
            await self.finish(job, lines)

    async def feed(self, job: BatchJob, lines: list[InputLine], principal: KeyPrincipal, lost: asyncio.Event) -> None:
        """Runs the lines not yet finished, at most max_in_flight at once, until they are all done or the
        batch is cancelled or expires: then the lines in flight are aborted too."""
        done = await run_in_threadpool(self.jobs.finished_lines, job.id)
        seats = asyncio.Semaphore(self.max_in_flight)
        in_flight: set[asyncio.Task[Any]] = set()
        halt = self.halts[job.id] = Halt()
        if job.id in self.cancelled:
            halt.set("cancelled")
        watcher = asyncio.create_task(self.watch(job, halt, lost))
        try:
            for line in lines:
                if line.number in done:
                    continue
                await seats.acquire()
                if halt.reason is not None:
                    seats.release()
                    break
                task = asyncio.create_task(self.run_line(job, line, principal, halt))
                in_flight.add(task)

                def free_seat(finished: asyncio.Task[Any]) -> None:
                    in_flight.discard(finished)
                    seats.release()

                task.add_done_callback(free_seat)
            await asyncio.gather(*in_flight)
        except asyncio.CancelledError:  # shutting down: what is in flight runs again after the restart
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise
        finally:
            watcher.cancel()
            self.halts.pop(job.id, None)

    async def watch(self, job: BatchJob, halt: Halt, lost: asyncio.Event) -> None:
        """Halts the feeding when the batch is cancelled (here or by another replica), runs past its window
        or is lost to another runner; a cancel made in this process halts it at once (wake)."""
        while halt.reason is None:
            try:
                status = await run_in_threadpool(self.jobs.status_of, job.id)
            except Exception:  # a database hiccup: look again next time
                log.exception("batch %s: status check failed", job.id)
                status = "in_progress"
            if lost.is_set():
                halt.set("lost")
            elif status != "in_progress":
                self.cancelled.add(job.id)
                halt.set("cancelled")
            elif expired(job, utcnow()):
                halt.set("expired")
            else:
                await asyncio.sleep(STATUS_CHECK_S)

    async def run_line(self, job: BatchJob, line: InputLine, principal: KeyPrincipal, halt: Halt) -> None:
        if line.body is None:
            result = error_line(line.custom_id, "invalid_request", line.problem or "The line is malformed.")
            status = 400
        else:
            status, body = await dispatch(self.app, job.endpoint, line.body, principal, stop=halt.event)
            result = output_line(line.custom_id, status, body)
            if halt.reason is not None and 200 <= status < 300 and cut_short(body):
                if halt.reason not in CUT_SHORT:  # lost: the runner that has the batch now runs it again
                    return
                status = 499  # a client gone before the answer: a failed line, its partial answer kept
                code, why = CUT_SHORT[halt.reason]
                result = {**result, "response": {**result["response"], "status_code": status}}
                result["error"] = {"code": code, "message": why}
        await run_in_threadpool(
            self.jobs.record_line,
            job.id,
            line_number=line.number,
            custom_id=line.custom_id,
            status_code=status,
            result=result,
        )

    async def finish(self, job: BatchJob, lines: list[InputLine]) -> None:
        """Write the output and error files and end the batch: completed, or cancelled / expired with the
        lines that never ran in the error file."""
        status = await run_in_threadpool(self.jobs.status_of, job.id)
        if status == "cancelling" or job.id in self.cancelled:
            final, code, why = "cancelled", "batch_cancelled", "The batch was cancelled before this request ran."
        elif status == "in_progress" and expired(job, utcnow()):
            final, code, why = (
                "expired",
                "batch_expired",
                "The batch's completion window ended before this request ran.",
            )
        else:
            final, code, why = "completed", "", ""
        await run_in_threadpool(self.write_results, job, lines, final, code, why)
        self.cancelled.discard(job.id)

    def write_results(self, job: BatchJob, lines: list[InputLine], final: str, code: str, why: str) -> None:
        if final == "completed":
            self.jobs.set_status(job.id, "finalizing", only_from=("in_progress",))
        else:  # the lines left over are failed lines of this batch, recorded like any other
            done = self.jobs.finished_lines(job.id)
            for line in lines:
                if line.number not in done:
                    self.jobs.record_line(
                        job.id,
                        line_number=line.number,
                        custom_id=line.custom_id,
                        status_code=499,
                        result=error_line(line.custom_id, code, why),
                    )
        results = self.jobs.results(job.id)
        outputs = [encode(r.result) for r in results if 200 <= r.status_code < 300]
        errors = [encode(r.result) for r in results if not 200 <= r.status_code < 300]
        values: dict[str, object] = {"total": len(lines)}
        seconds = job.output_expires_after_s
        expires_after = None if seconds is None else timedelta(seconds=seconds)
        for kind, found in (("output", outputs), ("error", errors)):
            if found:
                values[f"{kind}_file_id"] = self.files.write(
                    team_id=job.team_id,
                    purpose="batch_output",
                    filename=f"{job.id}_{kind}.jsonl",
                    lines=found,
                    expires_after=expires_after,
                ).id
        self.jobs.set_status(job.id, final, only_from=("in_progress", "finalizing", "cancelling"), **values)

    async def fail(self, job: BatchJob, code: str, message: str) -> None:
        await run_in_threadpool(
            self.jobs.set_status,
            job.id,
            "failed",
            only_from=("validating", "in_progress", "finalizing", "cancelling"),
            errors=[{"code": code, "message": message, "param": None, "line": None}],
        )
