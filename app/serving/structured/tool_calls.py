"""Reading calls out of a choice's text as it arrives, and giving them back the way OpenAI does: whole
(`message.tool_calls`) or in stream pieces (`delta.tool_calls`: index, id, type and name first, then the
arguments in fragments).

The text is `free text` or `[free text]<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`
(the grammar in tools.py makes sure of it). Arguments are passed on exactly as the model wrote them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.serving.structured.tools import CALL_OPEN


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    arguments_start: int | None = None  # in the call text
    arguments_end: int | None = None
    arguments_sent: int = 0  # how much of the arguments went out in stream pieces
    announced: bool = False  # the first piece (id, type, name) went out
    complete: bool = False


class ToolCallParser:
    """One choice. `feed` text pieces, then `finish`; each returns the stream deltas they produce."""

    def __init__(self) -> None:
        self.content = ""  # text before the tag (all of it when there is no tag)
        self._held = ""  # a tail that may be the start of the tag
        self._in_calls = False
        self._text = ""  # after the tag
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._string_start = 0
        self._at_value = False  # inside a call object: after ':' (a value), not after ',' (a key)
        self._key: str | None = None
        self._array_closed = False
        self.calls: list[ParsedCall] = []

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [call for call in self.calls if call.complete]

    @property
    def well_formed(self) -> bool:
        """No tag, or a tag followed by a closed array of complete calls."""
        return not self._in_calls or (self._array_closed and all(call.complete for call in self.calls))

    @property
    def announced_calls(self) -> bool:
        return any(call.announced for call in self.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not self._in_calls:
            return self._feed_text(text)
        self._text += text
        self._scan()
        return self._call_deltas()

    def finish(self) -> list[dict[str, Any]]:
        if self._in_calls or not self._held:
            return []
        held, self._held = self._held, ""
        self.content += held
        return [{"content": held}]

    def _feed_text(self, text: str) -> list[dict[str, Any]]:
        pending = self._held + text
        tag_at = pending.find(CALL_OPEN)
        if tag_at >= 0:
            before, self._held = pending[:tag_at], ""
            self._in_calls = True
            deltas = [{"content": before}] if before else []
            self.content += before
            return deltas + self.feed(pending[tag_at + len(CALL_OPEN) :])
        keep = _tag_prefix_length(pending)
        sendable, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.content += sendable
        return [{"content": sendable}] if sendable else []

    def _scan(self) -> None:
        text = self._text
        for index in range(self._pos, len(text)):
            char = text[index]
            if self._array_closed:
                break
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    if self._depth == 2:
                        self._string_ended(json.loads(text[self._string_start : index + 1]), self._call, index)
                continue
            if (
                self._depth == 2
                and self._at_value
                and self._key == "arguments"
                and self._call.arguments_start is None
                and not char.isspace()
            ):
                self._call.arguments_start = index
            if char == '"':
                self._in_string, self._string_start = True, index
            elif char in "{[":
                self._depth += 1
                if self._depth == 2:
                    self.calls.append(ParsedCall())
                    self._at_value, self._key = False, None
            elif char in "}]":
                self._depth -= 1
                if self._depth == 2 and self._call.arguments_start is not None and self._call.arguments_end is None:
                    self._call.arguments_end = index + 1
                elif self._depth == 1:
                    call = self._call
                    self._end_value(call, index)
                    call.complete = call.name is not None and call.arguments_end is not None
                elif self._depth == 0:
                    self._array_closed = True
            elif self._depth == 2 and char == ":":
                self._at_value = True
            elif self._depth == 2 and char == ",":
                self._end_value(self._call, index)
                self._at_value, self._key = False, None
        self._pos = len(text)

    @property
    def _call(self) -> ParsedCall:
        """The call being scanned, wherever the scan is inside an object of the array (depth 2 or more, or
        just closing one): the array's last, appended when its object opened."""
        return self.calls[-1]

    def _string_ended(self, value: str, call: ParsedCall, index: int) -> None:
        if not self._at_value:
            self._key = value
        elif self._key == "name":
            call.name = value
        elif self._key == "arguments" and call.arguments_end is None:
            call.arguments_end = index + 1

    def _end_value(self, call: ParsedCall, index: int) -> None:
        """A scalar `arguments` value ends at the ',' or '}' after it."""
        if self._key == "arguments" and call.arguments_start is not None and call.arguments_end is None:
            call.arguments_end = len(self._text[:index].rstrip())

    def _call_deltas(self) -> list[dict[str, Any]]:
        pieces = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            if not call.announced:
                call.announced = True
                pieces.append(
                    {
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            if call.arguments_start is None:
                continue
            end = call.arguments_end
            if end is None:  # still being written: objects and arrays can go out as they come
                end = len(self._text) if self._text[call.arguments_start] in "{[" else call.arguments_start
            fragment = self._text[call.arguments_start + call.arguments_sent : end]
            if fragment:
                call.arguments_sent += len(fragment)
                pieces.append({"index": index, "function": {"arguments": fragment}})
        return [{"tool_calls": [piece]} for piece in pieces]

    def arguments(self, call: ParsedCall) -> str:
        return self._text[call.arguments_start : call.arguments_end]


def _tag_prefix_length(text: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of the opening tag."""
    for length in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


def parse_message(text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice: (message, finish_reason). Text that is not well-formed calls stays content."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    calls = parser.complete_calls
    if not parser.well_formed and not calls:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parser.content if parser.content.strip() or not calls else None,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": parser.arguments(call)}}
            for call in calls
        ]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason
