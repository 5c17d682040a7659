"""Batches in the database: create, read, list, cancel, and the runner's progress (one row per finished
line, counted on the batch in the same transaction). Keyword-only and blocking; a batch of another team
is as absent as one that never existed."""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, or_, select, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.batches.files import unix
from app.errors import OpenAIError, invalid_request
from app.gateway.audit import Actor, record_change
from app.gateway.crud import utcnow
from app.tables import BatchJob, BatchLine

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# Statuses the runner still has work in; the rest are final.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW_PATTERN = re.compile(r"([1-9][0-9]{0,5})([smh])")
MAX_WINDOW = timedelta(days=7)


def completion_window_length(window: str) -> timedelta:
    """OpenAI's "24h", or any whole number of s / m / h up to a week."""
    match = WINDOW_PATTERN.fullmatch(window) if isinstance(window, str) else None
    if match is None:
        raise invalid_request(
            f"completion_window must look like '24h' (s, m or h); got {window!r}.", param="completion_window"
        )
    length = timedelta(seconds=int(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]])
    if length > MAX_WINDOW:
        raise invalid_request("completion_window may be at most 168h.", param="completion_window")
    return length


def batch_not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")


def batch_view(row: BatchJob) -> dict[str, Any]:
    """A Batch, as the openai client reads it."""
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "errors": None if not row.errors else {"object": "list", "data": row.errors},
        "created_at": unix(row.created_at),
        "in_progress_at": unix(row.in_progress_at),
        "expires_at": unix(row.expires_at),
        "finalizing_at": unix(row.finalizing_at),
        "completed_at": unix(row.completed_at),
        "failed_at": unix(row.failed_at),
        "expired_at": unix(row.expired_at),
        "cancelling_at": unix(row.cancelling_at),
        "cancelled_at": unix(row.cancelled_at),
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "metadata": row.batch_metadata,
    }


@dataclass(frozen=True)
class BatchStore:
    sessions: sessionmaker[Session]

    def create(
        self,
        *,
        team_id: int | None,
        key_id: int | None,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict[str, Any] | None,
        total: int,
        output_expires_after_s: int | None = None,
    ) -> BatchJob:
        now = utcnow()
        row = BatchJob(
            id=f"batch_{uuid.uuid4().hex[:24]}",
            team_id=team_id,
            key_id=key_id,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            total=total,
            completed=0,
            failed=0,
            batch_metadata=metadata,
            output_expires_after_s=output_expires_after_s,
            created_at=now,
            expires_at=now + completion_window_length(completion_window),
        )
        with self.sessions() as session, session.begin():
            session.add(row)
        return row

    def get(self, *, team_id: int | None, batch_id: str) -> BatchJob:
        with self.sessions() as session:
            row = session.get(BatchJob, batch_id)
        if row is None or row.team_id != team_id:
            raise batch_not_found(batch_id)
        return row

    def page(self, *, team_id: int | None, after: str | None, limit: int) -> tuple[list[BatchJob], bool]:
        """A page of the team's batches, newest first, and whether more follow."""
        query = select(BatchJob).where(BatchJob.team_id == team_id)
        if after is not None:
            cursor = self.get(team_id=team_id, batch_id=after)
            query = query.where(tuple_(BatchJob.created_at, BatchJob.id) < tuple_(cursor.created_at, cursor.id))
        query = query.order_by(BatchJob.created_at.desc(), BatchJob.id.desc()).limit(limit + 1)
        with self.sessions() as session:
            rows = list(session.scalars(query))
        return rows[:limit], len(rows) > limit

    def cancel(self, *, team_id: int | None, batch_id: str, actor: Actor | None = None) -> BatchJob:
        """validating / in_progress -> cancelling (the runner finishes the job); cancelling and cancelled
        stay as they are; any other final status is a conflict. An admin's cancel (`actor`) is audited."""
        with self.sessions() as session, session.begin():
            row = session.get(BatchJob, batch_id, with_for_update=True)
            if row is None or row.team_id != team_id:
                raise batch_not_found(batch_id)
            if row.status in ("validating", "in_progress"):
                before = {"status": row.status, "team_id": row.team_id}
                row.status = "cancelling"
                row.cancelling_at = utcnow()
                if actor is not None:
                    after = {"status": row.status, "team_id": row.team_id, "cancelling_at": row.cancelling_at}
                    record_change(
                        session,
                        actor=actor,
                        action="batch.cancel",
                        target_type="batch",
                        target_id=batch_id,
                        before=before,
                        after=after,
                    )
            elif row.status not in ("cancelling", "cancelled"):
                raise OpenAIError(409, f"Cannot cancel a batch that is {row.status}.", code="batch_not_cancellable")
            session.flush()
            session.expunge(row)
        return row

    # the runner's side

    def claim_next(self, runner_id: str, lease: timedelta, skip: Collection[str] = ()) -> BatchJob | None:
        """The oldest batch with work left that no other runner holds (and not in `skip`: those this runner
        runs already or waits to retry), now held by `runner_id` for `lease`: each by one runner at a time."""
        now = utcnow()
        free = or_(BatchJob.runner_id.is_(None), BatchJob.runner_id == runner_id, BatchJob.lease_expires_at < now)
        with self.sessions() as session:
            candidates = list(
                session.scalars(
                    select(BatchJob.id)
                    .where(BatchJob.status.in_(ACTIVE), free, BatchJob.id.not_in(list(skip)))
                    .order_by(BatchJob.created_at, BatchJob.id)
                    .limit(8)
                )
            )
        for batch_id in candidates:
            if self.renew(batch_id, runner_id, lease):
                with self.sessions() as session:
                    return session.get(BatchJob, batch_id)
        return None

    def renew(self, batch_id: str, runner_id: str, lease: timedelta) -> bool:
        """Take or extend the lease; False when another runner holds it (a compare-and-set, so two
        runners racing for a free batch can't both win)."""
        now = utcnow()
        free = or_(BatchJob.runner_id.is_(None), BatchJob.runner_id == runner_id, BatchJob.lease_expires_at < now)
        with self.sessions() as session, session.begin():
            result = session.execute(
                update(BatchJob)
                .where(BatchJob.id == batch_id, free)
                .values(runner_id=runner_id, lease_expires_at=now + lease)
            )
            return cast(CursorResult[Any], result).rowcount == 1

    def release(self, batch_id: str, runner_id: str) -> None:
        with self.sessions() as session, session.begin():
            session.execute(
                update(BatchJob)
                .where(BatchJob.id == batch_id, BatchJob.runner_id == runner_id)
                .values(runner_id=None, lease_expires_at=None)
            )

    def status_of(self, batch_id: str) -> str | None:
        with self.sessions() as session:
            return session.scalar(select(BatchJob.status).where(BatchJob.id == batch_id))

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...], **values: object) -> bool:
        """Move to `status` (stamping its *_at time) unless the batch has moved on meanwhile, e.g. a
        cancel that came in between."""
        stamp = {
            "in_progress": "in_progress_at",
            "finalizing": "finalizing_at",
            "completed": "completed_at",
            "failed": "failed_at",
            "expired": "expired_at",
            "cancelled": "cancelled_at",
        }.get(status)
        if stamp is not None:
            values[stamp] = utcnow()
        with self.sessions() as session, session.begin():
            result = session.execute(
                update(BatchJob)
                .where(BatchJob.id == batch_id, BatchJob.status.in_(only_from))
                .values(status=status, **values)
            )
            return cast(CursorResult[Any], result).rowcount == 1

    def finished_lines(self, batch_id: str) -> set[int]:
        with self.sessions() as session:
            return set(session.scalars(select(BatchLine.line_number).where(BatchLine.batch_id == batch_id)))

    def record_line(
        self, batch_id: str, *, line_number: int, custom_id: str | None, status_code: int, result: dict[str, Any]
    ) -> bool:
        """Keep one finished line and count it; False if that line was recorded already (it never is twice)."""
        ok = 200 <= status_code < 300
        try:
            with self.sessions() as session, session.begin():
                session.add(
                    BatchLine(
                        batch_id=batch_id,
                        line_number=line_number,
                        custom_id=custom_id,
                        status_code=status_code,
                        result=result,
                    )
                )
                session.flush()
                session.execute(
                    update(BatchJob)
                    .where(BatchJob.id == batch_id)
                    .values(completed=BatchJob.completed + int(ok), failed=BatchJob.failed + int(not ok))
                )
        except IntegrityError:
            return False
        return True

    def results(self, batch_id: str) -> list[BatchLine]:
        with self.sessions() as session:
            return list(
                session.scalars(select(BatchLine).where(BatchLine.batch_id == batch_id).order_by(BatchLine.line_number))
            )


def expired(row: BatchJob, now: datetime) -> bool:
    return now >= row.expires_at
