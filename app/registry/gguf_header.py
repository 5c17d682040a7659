"""A GGUF file's metadata, read from its header without touching its tensors; the readers of its values
serve app/registry/memory.py too, which walks on to the tensor index."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

from app.registry.files import open_regular

# GGUF metadata value types: struct formats of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Real files nest at most an array of arrays; deeper is a crafted file (and Python's recursion limit).
MAX_ARRAY_DEPTH = 4


def gguf_header(path: Path, *, wanted: tuple[str, ...], stop_prefix: str) -> dict[str, Any]:
    """The wanted metadata of a GGUF file, read from its header without touching tensors (gguf's reader
    maps the whole file: seconds for a 100 MB model). Stops at the first key starting with stop_prefix
    (the tokenizer's big arrays come last), or when every wanted key is found."""
    found: dict[str, Any] = {}
    with open_regular(path) as file:
        magic, version = struct.unpack("<4sI", file.read(8))
        if magic != b"GGUF" or version < 2:
            raise ValueError("not a GGUF v2+ file")  # never echo its bytes: it may be a link to a secret
        _tensors, kv_count = struct.unpack("<QQ", file.read(16))
        for _ in range(kv_count):
            key = read_string(file)
            if key.startswith(stop_prefix):
                break
            value = read_value(file, struct.unpack("<I", file.read(4))[0])
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found


def read_string(file: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", file.read(8))
    if length > 1 << 20:
        raise ValueError(f"implausible string length {length}")
    return file.read(length).decode("utf-8", errors="replace")


def read_value(file: BinaryIO, kind: int, depth: int = 0) -> object:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack(fmt, file.read(struct.calcsize(fmt)))[0]
    if kind == 8:
        return read_string(file)
    if kind == 9:
        if depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item_kind, count = struct.unpack("<IQ", file.read(12))
        if count > os.fstat(file.fileno()).st_size - file.tell():  # every item takes a byte at least
            raise ValueError(f"implausible array length {count}")
        return [read_value(file, item_kind, depth + 1) for _ in range(count)]
    raise ValueError(f"unknown GGUF value type {kind}")
