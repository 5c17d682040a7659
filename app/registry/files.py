"""Opening a file an operator named: regular files only. A FIFO would block the reader forever and a
device (a link to /dev/zero) would never end, so both are refused before a byte is read; the check is
made on the opened descriptor, so a path swapped after the check can't slip through."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class NotARegularFile(OSError):
    pass


def open_regular(path: Path | str) -> BinaryIO:
    """Opened for reading in binary; NotARegularFile for a FIFO, socket, device or folder."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open would wait for a writer
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"{path} is not a regular file")
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_regular(path: Path | str, max_bytes: int) -> bytes:
    """The whole of a small regular file; ValueError when it is larger than max_bytes."""
    with open_regular(path) as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    return data
