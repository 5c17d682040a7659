"""The Response object, whole or as the typed server-sent events `responses.stream()` consumes."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from app.serving.responses.items import function_call_item, new_item_id, output_message
from app.serving.responses.request import ResponsesRequest, reasoning_echo


@dataclass
class ResponseHeader:
    """What every form of one response repeats: its id, when, which model, and the request's settings."""

    id: str
    model: str
    body: ResponsesRequest
    tools: list[dict[str, Any]]  # as run: function tools with `strict` resolved
    temperature: float = 1.0  # as run: the request's, else the server's default
    top_p: float = 1.0
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        *,
        error: dict[str, Any] | None = None,
        incomplete_reason: str | None = None,
    ) -> dict[str, Any]:
        body = self.body
        finished = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": reasoning_echo(body.reasoning),
            "service_tier": "default",
            "store": body.stores,
            "temperature": self.temperature,
            "text": {"format": body.text_format, "verbosity": "medium"},
            "tool_choice": body.tool_choice or "auto",
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": body.truncation or "disabled",
            "usage": usage if finished else None,
            "user": body.user,
            "metadata": body.metadata or {},
            "prompt_cache_key": body.prompt_cache_key,
            "safety_identifier": body.safety_identifier,
        }


def response_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """The tracker's chat-shaped usage in the Responses API's names."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def final_status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) for how generation ended."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class ResponseEvents:
    """Builds the event stream of one response from chat stream deltas ({"content": ...} or
    {"tool_calls": [...]}, app.structured's pieces), numbering every event."""

    def __init__(self, header: ResponseHeader, obfuscate: bool = False) -> None:
        self.header = header
        self.obfuscate = obfuscate
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self._open_message: dict[str, Any] | None = None
        self._text_parts: list[str] = []
        self._open_calls: dict[int, dict[str, Any]] = {}  # the chat stream's call index -> its output item

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _delta_extras(self) -> dict[str, Any]:
        # A random-length pad on deltas, as OpenAI sends, so sizes on the wire do not give the text away.
        return {"obfuscation": secrets.token_urlsafe(secrets.randbelow(12) + 1)} if self.obfuscate else {}

    def started(self) -> list[str]:
        response = self.header.response("in_progress", [])
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call_piece(call)
        return events

    def _open(self) -> list[str]:
        self._open_message = output_message("", "in_progress")
        self._open_message["content"] = []
        self._text_parts = []
        index = len(self.output)
        self.output.append(self._open_message)
        return [
            self.event("response.output_item.added", output_index=index, item=self._open_message),
            self.event(
                "response.content_part.added",
                item_id=self._open_message["id"],
                output_index=index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            ),
        ]

    def _text(self, text: str) -> list[str]:
        events = self._open() if self._open_message is None else []
        message = self._open_message
        assert message is not None
        self._text_parts.append(text)
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=message["id"],
                output_index=self.output.index(message),
                content_index=0,
                delta=text,
                logprobs=[],
                **self._delta_extras(),
            )
        )
        return events

    def _close_message(self, status: str) -> list[str]:
        message = self._open_message
        if message is None:
            return []
        self._open_message = None
        index = self.output.index(message)
        text = "".join(self._text_parts)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        message.update(status=status, content=[part])
        return [
            self.event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done", item_id=message["id"], output_index=index, content_index=0, part=part
            ),
            self.event("response.output_item.done", output_index=index, item=message),
        ]

    def _call_piece(self, piece: dict[str, Any]) -> list[str]:
        events = []
        function = piece.get("function") or {}
        if piece["index"] not in self._open_calls:
            events += self._close_message("completed")  # text before the calls is a message of its own
            item = function_call_item(piece["id"], function["name"], "", new_item_id("fc"), status="in_progress")
            self._open_calls[piece["index"]] = item
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        item = self._open_calls[piece["index"]]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=function["arguments"],
                    **self._delta_extras(),
                )
            )
        return events

    def finished(self, finish_reason: str | None) -> list[str]:
        """Closes what is open; the caller sends the final response.completed / .incomplete after storing."""
        status, _ = final_status(finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        events = self._close_message(item_status)
        for item in self._open_calls.values():
            index = self.output.index(item)
            item["status"] = item_status
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        self._open_calls = {}
        if not self.output:  # nothing at all came out: still one (empty) message, as whole responses have
            events += self._open() + self._close_message(item_status)
        return events
