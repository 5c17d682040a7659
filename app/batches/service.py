"""What the /v1/files and /v1/batches routes share with the runner: the stores, the limits, the runner and
the sweep of expired files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp

from app.batches.files import FileStore
from app.batches.jobs import BatchStore
from app.batches.runner import BatchRunner
from app.batches.sweeper import FileSweeper
from app.gateway.auth import KeyCache
from app.settings import Settings

MULTIPART_OVERHEAD = 64 * 1024  # the form around the file: boundaries, headers, the purpose field


@dataclass(frozen=True)
class BatchService:
    files: FileStore
    jobs: BatchStore
    runner: BatchRunner
    sweeper: FileSweeper
    max_batch_lines: int
    max_line_bytes: int  # a line longer than a request may be is refused unparsed

    @classmethod
    def create(
        cls, app: ASGIApp, sessions: sessionmaker[Session], settings: Settings, keys: KeyCache | None = None
    ) -> BatchService:
        files = FileStore(
            sessions, Path(settings.files_dir), settings.max_file_bytes, settings.default_file_quota_bytes
        )
        jobs = BatchStore(sessions)
        runner = BatchRunner(
            app,
            jobs=jobs,
            files=files,
            max_in_flight=settings.batch_max_in_flight,
            max_line_bytes=settings.max_request_bytes,
            key_changes=(lambda: keys.generation) if keys is not None else lambda: 0,
            key_ttl_s=keys.ttl_s if keys is not None else 5.0,
            lease_s=settings.batch_lease_s,
        )
        sweeper = FileSweeper(files, settings.files_sweep_interval_s)
        return cls(files, jobs, runner, sweeper, settings.max_batch_lines, settings.max_request_bytes)

    @property
    def upload_cap(self) -> int:
        """The body cap of POST /v1/files: a file of max_bytes and its form fit, a body past that is a 413."""
        return self.files.max_bytes + MULTIPART_OVERHEAD
