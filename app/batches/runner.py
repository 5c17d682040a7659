"""The batch runner: a background task of the app that feeds batch lines into the engine at the lowest
priority, a bounded number at a time, so interactive requests are scheduled ahead of every waiting line.

Each finished line is written to the database as it finishes (jobs.BatchStore.record_line); a restart
skips the lines found there and runs the rest, so no line is lost or recorded twice. A cancel stops the
feeding and aborts the lines in flight (the route sees its client go away: the engine frees their KV
blocks and the tokens they made are metered), then writes the output so far; past its completion window
a batch does the same and ends `expired`. Lines that never ran or were cut short go to the error file,
saying why.

A runner holds a lease on each batch it runs (renewed while it runs, released when it stops), so replicas
sharing the database never run one batch at once; one that was killed lets go when its lease runs out.

Many batches run at once and share the batch seats (max_in_flight lines in the engine); a free seat goes
to the team served least, by the engine's fair-share rule with the teams' weights (batches/seats.py), so
one team's long batch does not hold another team's short one. The key that created a batch is checked
again before each line starts (reloaded when the key cache was invalidated by an admin change here, or
after the cache's TTL for a change made on another replica): a revoked key or a blocked team stops the
batch (lines in flight are aborted, their tokens billed), a lowered budget refuses its next lines.

A pass over a batch that raises is retried a few times, then the batch fails with a reason: one batch
never holds the runner. A batch being cancelled ends cancelled even when its pass keeps failing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp

from app.batches.dispatch import dispatch
from app.batches.files import FileStore
from app.batches.jobs import BatchStore, expired
from app.batches.lines import InputLine, encode, error_line, output_line, read_lines
from app.batches.seats import BatchSeats
from app.gateway.auth import KeyPrincipal, principal_of
from app.gateway.crud import utcnow
from app.tables import ApiKey, BatchJob, Team

log = logging.getLogger("tokenmill.batches")

# Lower runs first; a request body may ask for at most 1000, so every interactive request outranks this.
BATCH_PRIORITY = 1_000_000
STATUS_CHECK_S = 0.5  # how stale a cancel made by another replica may be seen while feeding
MAX_BATCHES_AT_ONCE = 64  # batches one runner feeds at the same time (they share the seats)
MAX_FAILED_PASSES = 3  # a batch whose pass raised this often fails
RETRY_AFTER_S = (0.1, 5.0)  # back-off before a failed pass is tried again: first, most
REVOKED = ("invalid_api_key", "The API key that created this batch was revoked, or its team blocked or deleted.")
CUT_SHORT = {
    "cancelled": ("batch_cancelled", "The batch was cancelled while this request ran; the tokens it made are billed."),
    "expired": ("batch_expired", "The batch's completion window ended while this request ran; its tokens are billed."),
    "revoked": (REVOKED[0], REVOKED[1] + " This request was stopped; the tokens it made are billed."),
}


@dataclass
class Halt:
    """Why a batch's feeding stopped early ("cancelled", "expired", "revoked", or "lost": another runner
    has the batch); setting it reads to each line in flight as its client going away."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str | None = None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.event.set()


@dataclass
class KeyWatch:
    """The batch's principal as last loaded, and when: reloaded when stale (see BatchRunner.principal)."""

    key_id: int | None
    principal: KeyPrincipal | None
    loaded_at: float
    generation: int


def cut_short(body: dict[str, Any]) -> bool:
    """Whether a 2xx response is one the engine aborted before it finished (chat and completions say so
    per choice, a response by its status)."""
    choices = body.get("choices")
    if isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices):
        return True
    return body.get("object") == "response" and body.get("status") in ("incomplete", "cancelled")


def tokens_served(body: dict[str, Any]) -> tuple[int, int]:
    """(prompt, output) tokens of a line's response, for the seats' fair share."""
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    output = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return (prompt if isinstance(prompt, int) else 0), (output if isinstance(output, int) else 0)


def batch_principal(sessions: sessionmaker[Session], key_id: int | None) -> KeyPrincipal | None:
    """The key that created the batch, as its lines run: its budget and model access, none of its rpm /
    tpm limits, at the batch priority. None when the key is revoked or gone, or its team blocked or gone."""
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


def _no_changes() -> int:
    return 0


class BatchRunner:
    def __init__(
        self,
        app: ASGIApp,
        *,
        jobs: BatchStore,
        files: FileStore,
        max_in_flight: int,
        max_line_bytes: int = 2 * 1024 * 1024,
        key_changes: Callable[[], int] = _no_changes,
        key_ttl_s: float = 5.0,
        poll_s: float = 1.0,
        lease_s: float = 30.0,
    ) -> None:
        self.app = app
        self.runner_id = f"{socket.gethostname()[:40]}-{uuid.uuid4().hex[:12]}"  # this process, for the lease
        self.lease = timedelta(seconds=lease_s)
        self.jobs = jobs
        self.files = files
        self.max_in_flight = max_in_flight
        self.seats = BatchSeats(max_in_flight)
        self.max_line_bytes = max_line_bytes
        self.key_changes = key_changes  # the key cache's invalidation count: an admin change made here
        self.key_ttl_s = key_ttl_s  # how stale a change made on another replica may be seen
        self.poll_s = poll_s
        self.cancelled: set[str] = set()  # cancels made in this process, seen at once
        self.halts: dict[str, Halt] = {}  # the batches being fed here, to stop their lines in flight
        self.running: dict[str, asyncio.Task[Any]] = {}  # batch id -> the task running it here
        self.failed_passes: dict[str, int] = {}
        self.retry_at: dict[str, float] = {}  # batch id -> monotonic time before which it is not retried
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
        batches = list(self.running.values())
        for task in batches:
            task.cancel()
        await asyncio.gather(*batches, return_exceptions=True)

    def wake(self, cancelled: str | None = None) -> None:
        if cancelled is not None:
            self.cancelled.add(cancelled)
            self.retry_at.pop(cancelled, None)
            if cancelled in self.halts:
                self.halts[cancelled].set("cancelled")
        self.wakeup.set()

    async def run_forever(self) -> None:
        while True:
            try:
                await self.claim_batches()
            except asyncio.CancelledError:
                raise
            except Exception:  # a database hiccup: try again after a pause, never die
                log.exception("batch runner pass failed")
            self.wakeup.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a wait that completed in the same
            # loop turn as a cancel and drops the cancel, so a batch ending as the app shut down left this loop
            # polling and the shutdown waiting for it forever
            try:
                async with asyncio.timeout(self.poll_s):
                    await self.wakeup.wait()
            except TimeoutError:
                pass

    async def claim_batches(self) -> None:
        """Start every batch with work left that no other runner holds, oldest first, up to the limit."""
        while len(self.running) < MAX_BATCHES_AT_ONCE:
            now = time.monotonic()
            backing_off = {batch_id for batch_id, when in self.retry_at.items() if when > now}
            skip = set(self.running) | backing_off
            job = await run_in_threadpool(self.jobs.claim_next, self.runner_id, self.lease, skip)
            if job is None:
                return
            self.retry_at.pop(job.id, None)
            self.running[job.id] = asyncio.create_task(self.run_claimed(job), name=f"batch-{job.id}")

    async def run_claimed(self, job: BatchJob) -> None:
        try:
            try:
                await self.run(job)
                self.failed_passes.pop(job.id, None)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch %s: pass failed", job.id)
                await self.after_failed_pass(job)
            finally:  # also on shutdown: the next process takes the batch over at once
                await run_in_threadpool(self.jobs.release, job.id, self.runner_id)
        finally:
            self.running.pop(job.id, None)
            self.wakeup.set()

    async def after_failed_pass(self, job: BatchJob) -> None:
        """A cancelled batch ends cancelled; one that failed too often fails; the rest wait and retry."""
        failures = self.failed_passes[job.id] = self.failed_passes.get(job.id, 0) + 1
        status = await run_in_threadpool(self.jobs.status_of, job.id)
        if status == "cancelling" or job.id in self.cancelled:
            why = "The batch was cancelled before this request ran."
            await run_in_threadpool(self.end, job, "cancelled", "batch_cancelled", why, None)
        elif failures >= MAX_FAILED_PASSES:
            message = (
                f"The server failed to run this batch ({failures} attempts); the lines that finished are in "
                "the output and error files, the others never ran."
            )
            errors = [{"code": "batch_failed", "message": message, "param": None, "line": None}]
            await run_in_threadpool(self.end, job, "failed", "batch_failed", message, errors)
        else:
            first, most = RETRY_AFTER_S
            self.retry_at[job.id] = time.monotonic() + min(most, first * 2 ** (failures - 1))
            return
        self.failed_passes.pop(job.id, None)
        self.cancelled.discard(job.id)

    def end(self, job: BatchJob, final: str, code: str, why: str, errors: list[dict[str, Any]] | None) -> None:
        """End the batch `final` with what it has; when even that fails, end it bare (no files)."""
        try:
            self.write_results(job, final, code, why, errors)
        except Exception:
            log.exception("batch %s: writing its results failed; it ends %s without them", job.id, final)
            extra = {} if errors is None else {"errors": errors}
            self.jobs.set_status(
                job.id, final, only_from=("validating", "in_progress", "finalizing", "cancelling"), **extra
            )

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
        input_path = self.files.path_of(job.input_file_id)
        if not input_path.is_file():
            await self.fail(job, "input_file_missing", "The batch's input file is gone.")
            return
        watch = KeyWatch(job.key_id, None, 0.0, -1)
        if await self.principal(watch) is None:
            await self.fail(job, *REVOKED)
            return
        reason = None
        if job.status == "in_progress":
            reason = await self.feed(job, input_path, watch, lost)
        if not lost.is_set():
            await self.finish(job, reason)

    async def principal(self, watch: KeyWatch) -> KeyPrincipal | None:
        """The batch's principal now: reloaded after an admin change in this process (the key cache was
        invalidated) or once the cache's TTL has passed, else the one loaded last."""
        generation, now = self.key_changes(), time.monotonic()
        if generation != watch.generation or now - watch.loaded_at >= self.key_ttl_s:
            watch.principal = await run_in_threadpool(batch_principal, self.jobs.sessions, watch.key_id)
            watch.loaded_at, watch.generation = now, generation
        return watch.principal

    async def feed(self, job: BatchJob, input_path: Path, watch: KeyWatch, lost: asyncio.Event) -> str | None:
        """Runs the lines not yet finished, each in a batch seat, until they are all done or the batch is
        cancelled, expires or loses its key: then the lines in flight are aborted too. Why it stopped early."""
        done = await run_in_threadpool(self.jobs.finished_lines, job.id)
        team = f"team:{job.team_id}"
        in_flight: set[asyncio.Task[Any]] = set()
        halt = self.halts[job.id] = Halt()
        if job.id in self.cancelled:
            halt.set("cancelled")
        watcher = asyncio.create_task(self.watch(job, halt, lost, watch))
        lines: Generator[InputLine, None, None] = read_lines(input_path, job.endpoint, self.max_line_bytes)
        try:
            while halt.reason is None:
                line = await run_in_threadpool(next, lines, None)
                if line is None:
                    break
                if line.number in done:
                    continue
                principal = await self.principal(watch)
                if principal is None:
                    halt.set("revoked")
                    break
                await self.seats.acquire(team, principal.team_weight)
                if halt.reason is not None:
                    self.seats.release(team)
                    break
                task = asyncio.create_task(self.run_line(job, line, principal, halt))
                in_flight.add(task)

                def free_seat(finished: asyncio.Task[Any]) -> None:
                    in_flight.discard(finished)
                    served = (0, 0)
                    if not finished.cancelled() and finished.exception() is None:
                        served = finished.result()
                    self.seats.release(team, prompt_tokens=served[0], output_tokens=served[1])

                task.add_done_callback(free_seat)
            await asyncio.gather(*in_flight)
        except asyncio.CancelledError:  # shutting down: what is in flight runs again after the restart
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise
        except BaseException:  # a failed pass: stop what it started before the runner decides what's next
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise
        finally:
            watcher.cancel()
            self.halts.pop(job.id, None)
            lines.close()
        return halt.reason

    async def watch(self, job: BatchJob, halt: Halt, lost: asyncio.Event, key: KeyWatch) -> None:
        """Halts the feeding when the batch is cancelled (here or by another replica), runs past its window,
        loses its key or is lost to another runner; a cancel made in this process halts it at once (wake)."""
        while halt.reason is None:
            try:
                status = await run_in_threadpool(self.jobs.status_of, job.id)
                principal = await self.principal(key)
            except Exception:  # a database hiccup: look again next time
                log.exception("batch %s: status check failed", job.id)
                status, principal = "in_progress", key.principal
            if lost.is_set():
                halt.set("lost")
            elif status != "in_progress":
                self.cancelled.add(job.id)
                halt.set("cancelled")
            elif expired(job, utcnow()):
                halt.set("expired")
            elif principal is None:
                halt.set("revoked")
            else:
                await asyncio.sleep(STATUS_CHECK_S)

    async def run_line(self, job: BatchJob, line: InputLine, principal: KeyPrincipal, halt: Halt) -> tuple[int, int]:
        """Runs one line and records it; the tokens it was served."""
        served = (0, 0)
        if line.body is None:
            result = error_line(line.custom_id, line.code, line.problem or "The line is malformed.")
            status = 400
        else:
            status, body = await dispatch(self.app, job.endpoint, line.body, principal, stop=halt.event)
            served = tokens_served(body)
            result = output_line(line.custom_id, status, body)
            if halt.reason is not None and 200 <= status < 300 and cut_short(body):
                if halt.reason not in CUT_SHORT:  # lost: the runner that has the batch now runs it again
                    return served
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
        return served

    async def finish(self, job: BatchJob, reason: str | None) -> None:
        """Write the output and error files and end the batch: completed, or cancelled / expired / failed
        (its key revoked) with the lines that never ran in the error file."""
        status = await run_in_threadpool(self.jobs.status_of, job.id)
        errors = None
        if status == "cancelling" or job.id in self.cancelled:
            final, code, why = "cancelled", "batch_cancelled", "The batch was cancelled before this request ran."
        elif reason == "revoked":
            final, (code, why) = "failed", REVOKED
            errors = [{"code": code, "message": why, "param": None, "line": None}]
        elif status == "in_progress" and expired(job, utcnow()):
            final, code, why = (
                "expired",
                "batch_expired",
                "The batch's completion window ended before this request ran.",
            )
        else:
            final, code, why = "completed", "", ""
        await run_in_threadpool(self.write_results, job, final, code, why, errors)
        self.cancelled.discard(job.id)

    def write_results(
        self, job: BatchJob, final: str, code: str, why: str, errors: list[dict[str, Any]] | None = None
    ) -> None:
        if final == "completed":
            self.jobs.set_status(job.id, "finalizing", only_from=("in_progress",))
        else:  # the lines left over are failed lines of this batch, recorded like any other
            done = self.jobs.finished_lines(job.id)
            path = self.files.path_of(job.input_file_id)
            for line in read_lines(path, job.endpoint, self.max_line_bytes) if path.is_file() else ():
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
        failures = [encode(r.result) for r in results if not 200 <= r.status_code < 300]
        values: dict[str, object] = {"total": job.total}
        if errors is not None:
            values["errors"] = errors
        seconds = job.output_expires_after_s
        expires_after = None if seconds is None else timedelta(seconds=seconds)
        for kind, found in (("output", outputs), ("error", failures)):
            if found:
                values[f"{kind}_file_id"] = self.files.write(
                    team_id=job.team_id,
                    purpose="batch_output",
                    filename=f"{job.id}_{kind}.jsonl",
                    lines=found,
                    expires_after=expires_after,
                ).id
        self.jobs.set_status(
            job.id, final, only_from=("validating", "in_progress", "finalizing", "cancelling"), **values
        )

    async def fail(self, job: BatchJob, code: str, message: str) -> None:
        await run_in_threadpool(
            self.jobs.set_status,
            job.id,
            "failed",
            only_from=("validating", "in_progress", "finalizing", "cancelling"),
            errors=[{"code": code, "message": message, "param": None, "line": None}],
        )
