"""A batch's input lines, and the lines of its output and error files (OpenAI's batch file formats).

An input line is `{"custom_id": ..., "method": "POST", "url": <the batch's endpoint>, "body": {...}}`.
One that is not goes to the error file with its custom_id (when it has one) and an error saying why; the
body itself is judged later, by the endpoint's own route.

Lines are read one at a time, never the whole file: a line longer than the request size cap is refused
unread (a 48 MB line parsed whole cost 1 GB of memory), and any failure to parse a line (a line nested
too deep for the parser included) is that line's error alone."""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

SKIP_CHUNK = 1024 * 1024  # how much of an over-long line is read (and dropped) at a time


@dataclass(frozen=True)
class InputLine:
    number: int  # 0-based, among the file's non-blank lines: the line's identity across restarts
    custom_id: str | None
    body: bytes | None  # the request body to send; None when the line is malformed
    problem: str | None = None  # why it is malformed
    code: str = "invalid_request"  # the error file's code for a malformed line


def raw_lines(source: BinaryIO, max_line_bytes: int) -> Iterator[bytes | None]:
    """The file's non-blank lines, one at a time; None for a line longer than `max_line_bytes`, which is
    skipped in chunks without being held."""
    while line := source.readline(max_line_bytes + 2):  # room for the line, its newline and one byte more
        if len(line) > max_line_bytes + 1 or (len(line) == max_line_bytes + 1 and not line.endswith(b"\n")):
            while line and not line.endswith(b"\n"):
                line = source.readline(SKIP_CHUNK)
            yield None
        elif line.strip():
            yield line


def count_lines(path: Path, max_line_bytes: int) -> int:
    with open(path, "rb") as source:
        return sum(1 for _ in raw_lines(source, max_line_bytes))


def read_lines(path: Path, endpoint: str, max_line_bytes: int) -> Generator[InputLine, None, None]:
    """The batch's lines in order, parsed as they are read. A custom_id seen before is refused; only the
    ids are kept (at most 512 characters each)."""
    seen: set[str] = set()
    with open(path, "rb") as source:
        for number, raw in enumerate(raw_lines(source, max_line_bytes)):
            if raw is None:
                yield InputLine(
                    number,
                    None,
                    None,
                    f"Line {number + 1} is longer than the {max_line_bytes} bytes a request may have.",
                    code="line_too_large",
                )
                continue
            line = parse_line(number, raw, endpoint, seen)
            if line.custom_id is not None and line.problem is None:
                seen.add(line.custom_id)
            yield line


def parse_line(number: int, raw: bytes, endpoint: str, seen: set[str]) -> InputLine:
    try:
        return _parse_line(number, raw, endpoint, seen)
    except Exception:  # RecursionError (nested too deep), MemoryError, ...: this line's error, never the batch's
        return InputLine(number, None, None, f"Line {number + 1} is not valid JSON the server can read.")


def _parse_line(number: int, raw: bytes, endpoint: str, seen: set[str]) -> InputLine:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return InputLine(number, None, None, f"Line {number + 1} is not valid JSON.")
    if not isinstance(data, dict):
        return InputLine(number, None, None, f"Line {number + 1} is not a JSON object.")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        return InputLine(number, None, None, f"Line {number + 1} needs a custom_id: a string of 1-512 characters.")

    def bad(problem: str) -> InputLine:
        return InputLine(number, custom_id, None, problem)

    if custom_id in seen:
        return bad(f"The custom_id {custom_id!r} is used by an earlier line; each line needs its own.")
    if data.get("method") != "POST":
        return bad("method must be POST.")
    if data.get("url") != endpoint:
        return bad(f"url must be this batch's endpoint, {endpoint}; got {data.get('url')!r}.")
    body = data.get("body")
    if not isinstance(body, dict):
        return bad("body must be a JSON object.")
    if body.get("stream"):
        return bad("stream is not supported in a batch: each line's whole response goes to the output file.")
    return InputLine(number, custom_id, json.dumps(body).encode())


def output_line(custom_id: str | None, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """The output file's line for a response of the endpoint (status 2xx), or the error file's for a refusal."""
    line: dict[str, Any] = {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": body.get("id", ""), "body": body},
        "error": None,
    }
    if not 200 <= status_code < 300:
        found = body.get("error")
        error: dict[str, Any] = found if isinstance(found, dict) else {}
        line["error"] = {
            "code": error.get("code") or error.get("type") or "request_failed",
            "message": error.get("message") or f"The request failed with status {status_code}.",
        }
    return line


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The error file's line for a request that never ran (malformed, cancelled, expired)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def encode(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"
