"""The data folder is private to the server's user: the folder and its folders 0700, its files 0600
(the SQLite database, uploaded files and batch results, the admin key, spilled usage, converted weights).

The process's umask is set to 077 first, so everything created later is private too (SQLite's -wal and
-shm files, files written by libraries); what a start finds already there (from a version that did not
do this) is tightened once. Links are left alone: their targets are not ours to change."""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
FOLDER_MODE, FILE_MODE = 0o700, 0o600


def make_private(data_dir: str | Path) -> None:
    os.umask(PRIVATE_UMASK)
    root = Path(data_dir)
    root.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    _tighten(root, FOLDER_MODE)
    for folder, folders, files in os.walk(root):  # does not follow links
        for name in folders:
            _tighten(Path(folder) / name, FOLDER_MODE)
        for name in files:
            _tighten(Path(folder) / name, FILE_MODE)


def _tighten(path: Path, mode: int) -> None:
    try:
        found = path.lstat()
        if not stat.S_ISLNK(found.st_mode) and stat.S_IMODE(found.st_mode) & ~mode:
            path.chmod(stat.S_IMODE(found.st_mode) & mode)
    except OSError:  # gone meanwhile, or not ours: the server runs on
        pass
