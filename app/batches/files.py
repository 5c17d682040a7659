"""Files of the Files API: bytes in the files folder under the file's id, a row in the database saying
whose it is. Everything here is keyword-only and blocking (routes run it in a thread); a file another
team owns, or one past its expires_at, is as absent as one that never existed (the sweep deletes the
expired ones for good)."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import func, or_, select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from app.errors import OpenAIError, invalid_request
from app.gateway.crud import utcnow
from app.tables import StoredFile, Team

UPLOAD_PURPOSES = ("batch", "user_data")  # what a client may upload; batch_output is ours
COPY_CHUNK = 1024 * 1024
EXPIRY_SECONDS = (3600, 30 * 24 * 3600)  # OpenAI's bounds on expires_after / output_expires_after
SWEEP_BATCH = 500  # expired files deleted per database round trip


def unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.replace(tzinfo=UTC).timestamp())


def expiry_after(seconds: object, param: str) -> timedelta:
    """An expiry policy's `seconds` ({"anchor": "created_at", "seconds": ...}), checked as OpenAI does."""
    low, high = EXPIRY_SECONDS
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not low <= seconds <= high:
        raise invalid_request(f"{param}.seconds must be a whole number from {low} to {high}.", param=f"{param}.seconds")
    return timedelta(seconds=seconds)


def private_file(path: Path) -> BinaryIO:
    """A new file only the server's user can read, whatever the umask (a team's data)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


def live(row: StoredFile | None, now: datetime) -> bool:
    return row is not None and (row.expires_at is None or row.expires_at > now)


def file_not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")


def file_view(row: StoredFile) -> dict[str, Any]:
    """A FileObject, as the openai client reads it."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": unix(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": unix(row.expires_at),
        "status_details": None,
    }


@dataclass(frozen=True)
class FileStore:
    sessions: sessionmaker[Session]
    folder: Path
    max_bytes: int
    default_quota_bytes: int = 1024**3  # a team's files in all, unless the team's file_quota_bytes says

    def quota_of(self, team_id: int | None) -> int:
        if team_id is None:
            return self.default_quota_bytes
        with self.sessions() as session:
            own = session.scalar(select(Team.file_quota_bytes).where(Team.id == team_id))
        return self.default_quota_bytes if own is None else own

    def stored_bytes(self, team_id: int | None) -> int:
        """What the team's live files take (uploads and batch results alike)."""
        unexpired = or_(StoredFile.expires_at.is_(None), StoredFile.expires_at > utcnow())
        query = select(func.coalesce(func.sum(StoredFile.bytes), 0)).where(StoredFile.team_id == team_id, unexpired)
        with self.sessions() as session:
            return int(session.scalar(query) or 0)

    def path_of(self, file_id: str) -> Path:
        return self.folder / file_id

    def save(
        self,
        *,
        team_id: int | None,
        purpose: str,
        filename: str,
        source: BinaryIO,
        expires_after: timedelta | None = None,
    ) -> StoredFile:
        """Copy `source` in under a new id; refused (400) past max_bytes or past what is left of the team's
        storage quota, with nothing left behind. (Two uploads at once may each fit what is left: the quota
        can be passed by at most one file's size.)"""
        quota = self.quota_of(team_id)
        room = quota - self.stored_bytes(team_id)
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = self.folder / f".{file_id}.part"
        size = 0
        try:
            with private_file(partial) as out:
                while chunk := source.read(COPY_CHUNK):
                    size += len(chunk)
                    if size > room and room < self.max_bytes:
                        raise OpenAIError(
                            400,
                            f"This upload would pass the team's file storage quota of {quota} bytes "
                            f"({max(0, room)} left); delete files or ask an admin for a larger quota.",
                            param="file",
                            code="storage_quota_exceeded",
                        )
                    if size > self.max_bytes:
                        raise invalid_request(
                            f"The file is larger than the {self.max_bytes} bytes a file may have.",
                            param="file",
                            code="file_too_large",
                        )
                    out.write(chunk)
            os.replace(partial, self.path_of(file_id))
        finally:
            partial.unlink(missing_ok=True)
        return self.record(
            file_id=file_id,
            team_id=team_id,
            purpose=purpose,
            filename=filename,
            size=size,
            expires_after=expires_after,
        )

    def write(
        self,
        *,
        team_id: int | None,
        purpose: str,
        filename: str,
        lines: list[bytes],
        expires_after: timedelta | None = None,
    ) -> StoredFile:
        """A file we make ourselves (a batch's output or errors); no cap."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = self.folder / f".{file_id}.part"
        with private_file(partial) as out:
            out.writelines(lines)
        os.replace(partial, self.path_of(file_id))
        return self.record(
            file_id=file_id,
            team_id=team_id,
            purpose=purpose,
            filename=filename,
            size=self.path_of(file_id).stat().st_size,
            expires_after=expires_after,
        )

    def record(
        self,
        *,
        file_id: str,
        team_id: int | None,
        purpose: str,
        filename: str,
        size: int,
        expires_after: timedelta | None,
    ) -> StoredFile:
        now = utcnow()
        row = StoredFile(
            id=file_id,
            team_id=team_id,
            purpose=purpose,
            filename=filename[:256],
            bytes=size,
            created_at=now,
            expires_at=None if expires_after is None else now + expires_after,
        )
        with self.sessions() as session, session.begin():
            session.add(row)
        return row

    def get(self, *, team_id: int | None, file_id: str) -> StoredFile:
        with self.sessions() as session:
            row = session.get(StoredFile, file_id)
        if row is None or row.team_id != team_id or not live(row, utcnow()):
            raise file_not_found(file_id)
        return row

    def page(
        self, *, team_id: int | None, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[StoredFile], bool]:
        """A page of the team's files and whether more follow, newest first unless `ascending`."""
        unexpired = or_(StoredFile.expires_at.is_(None), StoredFile.expires_at > utcnow())
        query = select(StoredFile).where(StoredFile.team_id == team_id, unexpired)
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        order = (StoredFile.created_at, StoredFile.id)
        if after is not None:
            cursor = self.get(team_id=team_id, file_id=after)
            position = tuple_(*order)
            bound = tuple_(cursor.created_at, cursor.id)
            query = query.where(position > bound if ascending else position < bound)
        query = query.order_by(*(column.asc() if ascending else column.desc() for column in order)).limit(limit + 1)
        with self.sessions() as session:
            rows = list(session.scalars(query))
        return rows[:limit], len(rows) > limit

    def delete(self, *, team_id: int | None, file_id: str) -> None:
        with self.sessions() as session, session.begin():
            row = session.get(StoredFile, file_id)
            if row is None or row.team_id != team_id or not live(row, utcnow()):
                raise file_not_found(file_id)
            session.delete(row)
        self.path_of(file_id).unlink(missing_ok=True)

    def open(self, *, team_id: int | None, file_id: str) -> tuple[StoredFile, Path]:
        row = self.get(team_id=team_id, file_id=file_id)
        path = self.path_of(file_id)
        if not path.exists():  # the row outlived its bytes (a folder restored without them)
            raise file_not_found(file_id)
        return row, path

    def sweep_expired(self) -> int:
        """Delete the files past their expires_at, rows and bytes; how many went. The row goes first: a
        crash between the two leaves bytes no row names (harmless), never a row without its bytes."""
        swept = 0
        while True:
            with self.sessions() as session, session.begin():
                rows = list(
                    session.scalars(select(StoredFile).where(StoredFile.expires_at <= utcnow()).limit(SWEEP_BATCH))
                )
                for row in rows:
                    session.delete(row)
            for row in rows:
                self.path_of(row.id).unlink(missing_ok=True)
            swept += len(rows)
            if len(rows) < SWEEP_BATCH:
                return swept
