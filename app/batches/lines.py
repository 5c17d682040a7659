"""A batch's input lines, and the lines of its output and error files (OpenAI's batch file formats).

An input line is `{"custom_id": ..., "method": "POST", "url": <the batch's endpoint>, "body": {...}}`.
One that is not goes to the error file with its custom_id (when it has one) and an error saying why; the
body itself is judged later, by the endpoint's own route."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class InputLine:
    number: int  # 0-based, among the file's non-blank lines: the line's identity across restarts
    custom_id: str | None
    body: bytes | None  # the request body to send; None when the line is malformed
    problem: str | None = None  # why it is malformed


def count_lines(path: Path) -> int:
    with open(path, "rb") as source:
        return sum(1 for line in source if line.strip())


def read_lines(path: Path, endpoint: str) -> list[InputLine]:
    lines: list[InputLine] = []
    seen: set[str] = set()
    with open(path, "rb") as source:
        for raw in source:
            if raw.strip():
                line = parse_line(len(lines), raw, endpoint, seen)
                if line.custom_id is not None and line.problem is None:
                    seen.add(line.custom_id)
                lines.append(line)
    return lines


def parse_line(number: int, raw: bytes, endpoint: str, seen: set[str]) -> InputLine:
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
