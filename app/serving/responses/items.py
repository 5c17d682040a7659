"""Conversation items: what a client sends as `input` becomes stored items in OpenAI's item shapes (each
with an id), and stored items become the chat messages the chat template renders.

One rule keeps the prefix cache hitting across turns: turn n+1's messages are turn n's messages, then
turn n's output as the assistant turn the model wrote, then the new input. So the new prompt begins
with the old one, token for token, up to where the model's reply starts.
"""

from __future__ import annotations

import uuid
from typing import Any

from app.errors import invalid_request
from app.serving.schemas import ChatMessage

INPUT_ROLES = ("user", "system", "developer")
ROLES = (*INPUT_ROLES, "assistant")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def normalize_input(raw: str | list[Any], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as stored items; 400 for anything malformed or that we cannot run. `earlier`:
    the items of the conversation so far (through previous_response_id), for call ids."""
    if isinstance(raw, str):
        return [_message("user", [{"type": "input_text", "text": raw}], None)]
    known_calls = {item["call_id"] for item in earlier if item["type"] == "function_call"}
    items = []
    for index, entry in enumerate(raw):
        item = _normalize_item(entry, f"input.[{index}]")
        if item["type"] == "function_call":
            known_calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in known_calls:
            raise invalid_request(
                f"No tool call found for function call output with call_id {item['call_id']!r}.",
                param=f"input.[{index}].call_id",
                code="unknown_call_id",
            )
        items.append(item)
    return items


def _normalize_item(entry: Any, param: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise invalid_request("Each input item must be an object.", param=param)
    kind = entry.get("type", "message" if "role" in entry else None)
    if kind == "message":
        return _normalize_message(entry, param)
    if kind == "function_call":
        call_id, name, arguments = (entry.get(field) for field in ("call_id", "name", "arguments"))
        for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
            if not isinstance(value, str) or (field != "arguments" and not value):
                raise invalid_request(f"A function_call item needs '{field}' as a string.", param=f"{param}.{field}")
        return {
            "id": _given_id(entry, "fc"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }
    if kind == "function_call_output":
        call_id, output = entry.get("call_id"), entry.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise invalid_request("A function_call_output item needs 'call_id' as a string.", param=f"{param}.call_id")
        if not isinstance(output, str):
            output = "\n".join(_texts(output, ("input_text", "output_text"), f"{param}.output"))
        return {
            "id": _given_id(entry, "fco"),
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
    if kind is None:
        raise invalid_request("An input item needs a 'type' (or a 'role' for a message).", param=f"{param}.type")
    raise invalid_request(
        f"Input items of type {kind!r} are not supported: send messages, function_call and function_call_output items.",
        param=f"{param}.type",
        code="unsupported_item_type",
    )


def _normalize_message(entry: dict[str, Any], param: str) -> dict[str, Any]:
    role = entry.get("role")
    if role not in ROLES:
        raise invalid_request(
            f"Invalid value for 'role': {role!r}. Supported values are {', '.join(repr(r) for r in ROLES)}.",
            param=f"{param}.role",
        )
    content = entry.get("content")
    if role == "assistant":
        text = (
            content
            if isinstance(content, str)
            else "\n".join(_texts(content, ("output_text", "refusal"), f"{param}.content"))
        )
        return _message(role, [{"type": "output_text", "text": text, "annotations": []}], entry.get("id"))
    if isinstance(content, str):
        return _message(role, [{"type": "input_text", "text": content}], entry.get("id"))
    parts = [{"type": "input_text", "text": text} for text in _texts(content, ("input_text",), f"{param}.content")]
    return _message(role, parts, entry.get("id"))


def _texts(parts: Any, kinds: tuple[str, ...], param: str) -> list[str]:
    """The text of each content part; 400 for a part that is not one of `kinds` with text."""
    if not isinstance(parts, list):
        raise invalid_request("Content must be a string or a list of content parts.", param=param)
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        value = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(value, str):
            shown = kind if isinstance(kind, str) else "?"
            raise invalid_request(
                f"Content parts of type {shown!r} are not supported here; expected {' or '.join(kinds)} with text.",
                param=f"{param}.[{index}]",
            )
        texts.append(value)
    return texts


def _message(role: str, content: list[dict[str, Any]], given_id: Any) -> dict[str, Any]:
    return {
        "id": given_id if isinstance(given_id, str) and given_id else new_item_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": content,
    }


def _given_id(entry: dict[str, Any], prefix: str) -> str:
    given = entry.get("id")
    return given if isinstance(given, str) and given else new_item_id(prefix)


def message_text(item: dict[str, Any]) -> str:
    return "\n".join(part.get("text") or part.get("refusal") or "" for part in item["content"])


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[ChatMessage]:
    """The conversation as chat messages: instructions first (as a system turn), an assistant message and
    the calls after it as one assistant turn, each call output as a tool turn."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    for item in items:
        if item["type"] == "message":
            messages.append(ChatMessage(role=item["role"], content=message_text(item)))
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"]))
    return messages


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat message the model produced (app.structured's shape) as output items: the text, if any, as
    a message, then one function_call item per call."""
    items = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(output_message(message.get("content") or "", status))
    for call in calls:
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def output_message(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or new_item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def function_call_item(
    call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id or new_item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
