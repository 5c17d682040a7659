"""`tokenmill batches list|show|cancel`: every team's batches from a shell, against the server's database.
A cancel here is seen by the running server within a second; it stops feeding and writes the partial output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.batches.jobs import BatchStore, batch_view
from app.cli.admin import _fail, _open, _store_arguments, _table
from app.errors import OpenAIError
from app.tables import BatchJob, Team


def batches_list(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    query = select(BatchJob, Team.name).outerjoin(Team, Team.id == BatchJob.team_id)
    if args.team is not None:
        query = query.where(Team.name == args.team)
    if args.status is not None:
        query = query.where(BatchJob.status == args.status)
    with sessions() as session:
        rows = session.execute(query.order_by(BatchJob.created_at.desc(), BatchJob.id.desc()).limit(args.limit)).all()
    _table(
        [
            {
                "id": job.id,
                "team": team,
                "status": job.status,
                "endpoint": job.endpoint,
                "done": f"{job.completed + job.failed}/{job.total}",
                "failed": job.failed,
                "created": job.created_at.isoformat(timespec="seconds"),
            }
            for job, team in rows
        ],
        ["id", "team", "status", "endpoint", "done", "failed", "created"],
    )
    return 0


def _team_of(sessions: sessionmaker[Session], batch_id: str) -> int | None:
    with sessions() as session:
        job = session.get(BatchJob, batch_id)
    if job is None:
        raise LookupError(f"no batch {batch_id!r}")
    return job.team_id


def batches_show(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    try:
        job = BatchStore(sessions).get(team_id=_team_of(sessions, args.batch_id), batch_id=args.batch_id)
    except LookupError as error:
        return _fail(str(error))
    json.dump(batch_view(job), sys.stdout, indent=2)
    print()
    return 0


def batches_cancel(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    try:
        job = BatchStore(sessions).cancel(team_id=_team_of(sessions, args.batch_id), batch_id=args.batch_id)
    except LookupError as error:
        return _fail(str(error))
    except OpenAIError as error:
        return _fail(error.message)
    print(f"batch {job.id} is {job.status}; the server stops feeding it and writes what is done")
    return 0


def _batches_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = sub.add_parser("list", help="list batches, newest first")
    listing.add_argument("--team", default=None, help="only this team's batches")
    listing.add_argument("--status", default=None, help="only batches in this status (in_progress, completed, ...)")
    listing.add_argument("--limit", type=int, default=50)
    _store_arguments(listing)
    listing.set_defaults(run=batches_list)
    show = sub.add_parser("show", help="one batch, as the API shows it (JSON)")
    show.add_argument("batch_id")
    _store_arguments(show)
    show.set_defaults(run=batches_show)
    cancel = sub.add_parser("cancel", help="cancel a batch of any team")
    cancel.add_argument("batch_id")
    _store_arguments(cancel)
    cancel.set_defaults(run=batches_cancel)


def commands() -> list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]]:
    """(name, help, add_arguments, run) for app.cli.main's COMMANDS."""
    return [("batches", "list, show and cancel batches (Batch API)", _batches_arguments, lambda args: args.run(args))]
