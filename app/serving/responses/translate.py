"""A Responses request as the chat-completions request the rest of the server already runs: tools,
tool_choice and text.format in chat's shapes, so app.structured plans, constrains and parses them the
same way. Errors that machinery raises are renamed to the Responses parameters they came from."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from app.errors import OpenAIError, invalid_request
from app.serving.responses.request import ResponsesRequest
from app.serving.schemas import ChatCompletionRequest, ChatMessage
from app.serving.structured.guides import GrammarError, check_json_schema

Result = TypeVar("Result")

# Tool types OpenAI runs on its side (or the client runs under a shape we have no grammar for).
HOSTED_TOOL_HINTS = {
    "web_search": " (Codex CLI: set web_search = \"disabled\")",
    "namespace": " (Codex CLI: set [agents] enabled = false; other clients: list the functions as tools)",
}


def chat_request(body: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text_format),
    }
    return ChatCompletionRequest.model_validate({name: value for name, value in fields.items() if value is not None})


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            shown = kind if isinstance(kind, str) else "?"
            raise invalid_request(
                f"Tool type {shown!r} is not supported: tokenmill runs function tools only"
                f"{HOSTED_TOOL_HINTS.get(shown, '')}.",
                param=f"tools.[{index}].type",
                code="unsupported_tool_type",
            )
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise invalid_request(f"Unrecognized function tool field: {sorted(unknown)[0]}", param=f"tools.[{index}]")
        function = {name: tool[name] for name in ("name", "description", "parameters") if tool.get(name) is not None}
        function["strict"] = _strict(tool)
        converted.append({"type": "function", "function": function})
    return converted


def _strict(tool: dict[str, Any]) -> bool:
    """OpenAI's Responses API makes function tools strict unless told otherwise; a schema that cannot be
    enforced as written is then run lenient, as OpenAI does, rather than refused."""
    strict = tool.get("strict")
    if strict is not None:
        return bool(strict)
    try:
        check_json_schema(tool.get("parameters") or {"type": "object"})
    except GrammarError:
        return False
    return True


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise invalid_request(
        f"tool_choice of type {kind!r} is not supported: use 'none', 'auto', 'required' or "
        "{\"type\": \"function\", \"name\": ...}.",
        param="tool_choice",
    )


def response_format(text_format: dict[str, Any]) -> dict[str, Any] | None:
    kind = text_format.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = {name: text_format[name] for name in ("name", "schema", "strict", "description") if name in text_format}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": kind}  # json_object, or a type the chat side refuses by name


CHAT_TO_RESPONSES = (
    (re.compile(r"^tools\.\[(\d+)\]\.function\."), r"tools.[\1]."),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
)


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for pattern, replacement in CHAT_TO_RESPONSES:
        param = pattern.sub(replacement, param)
    return param


def renamed_errors(work: Callable[[], Result]) -> Result:
    """Runs chat machinery; an error it raises names the Responses parameter instead of chat's."""
    try:
        return work()
    except OpenAIError as error:
        error.param = responses_param(error.param)
        error.message = (
            error.message.replace("'response_format.json_schema.", "'text.format.")
            .replace("response_format", "text.format")
            .replace("max_completion_tokens", "max_output_tokens")
        )
        raise
