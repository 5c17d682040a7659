"""`tools` and `tool_choice`: which calls the model may make, how the prompt shows the tools, and the
grammar that makes a call well-formed.

The output format is one JSON array of calls between tags, the format SmolLM2 was tuned on:
    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>
Templates that know tools (they mention `tools`) render them themselves; for templates that do not
(SmolLM2's), a system prompt lists the tools and asks for this format, tool results come back as
`<tool_response>` user turns, and earlier calls are shown in the same format. The grammar then holds
the model to it: `required` and a named function force a call; `auto` lets the model write text, but
once it writes `<tool_call>` the rest must be valid calls to the given functions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.errors import invalid_request
from app.serving.structured.guides import GrammarError, check_json_schema, json_schema_lark

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PreTrainedTokenizerBase

    from app.serving.schemas import ChatMessage

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

TOOLS_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible functions.
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, point it out and refuse to answer.
If the given question lacks the parameters required by the function, also point it out.
You have access to the following tools:
<tools>{tools}</tools>
The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no function call is needed, please make the tool calls an empty list '[]'.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
(more tool calls as required)
]</tool_call>"""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool

    def openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "function"
    name: str | None = None  # the forced function's name


def parse_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    if tools is None:
        return []
    if not tools:
        raise invalid_request("'tools' must contain at least one tool.", param="tools")
    parsed: list[Tool] = []
    for index, tool in enumerate(tools):
        param = f"tools.[{index}]"
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise invalid_request("Only tools of type 'function' with a 'function' object are supported.", param=param)
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise invalid_request(
                "A function name must be 1 to 64 letters, digits, '_' or '-'.", param=f"{param}.function.name"
            )
        if any(other.name == name for other in parsed):
            raise invalid_request(f"Duplicate function name {name!r}.", param=f"{param}.function.name")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise invalid_request("'parameters' must be a JSON schema object.", param=f"{param}.function.parameters")
        strict = bool(function.get("strict"))
        if strict:  # a strict function's schema must be enforceable as written
            try:
                check_json_schema(parameters)
            except GrammarError as error:
                raise invalid_request(
                    f"Invalid schema for function {name!r}: {error}", param=f"{param}.function.parameters"
                ) from None
        description = function.get("description")
        parsed.append(Tool(name, description if isinstance(description, str) else None, parameters, strict))
    return parsed


def parse_tool_choice(tool_choice: str | dict[str, Any] | None, tools: list[Tool]) -> ToolChoice:
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if not tools:
        raise invalid_request("'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice")
    if tool_choice in ("none", "auto", "required"):
        return ToolChoice(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if not any(tool.name == name for tool in tools):
            raise invalid_request(
                f"Invalid value for 'tool_choice': no function named {name!r} in 'tools'.", param="tool_choice"
            )
        return ToolChoice("function", name)
    raise invalid_request(
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
        param="tool_choice",
    )


def calls_schema(tools: list[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
    offered = [tool for tool in tools if choice.mode != "function" or tool.name == choice.name]
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in offered
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": variants}}
    if choice.mode in ("required", "function"):
        schema["minItems"] = 1
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tools_grammar(tools: list[Tool], choice: ToolChoice, parallel: bool, answer_schema: dict[str, Any] | None) -> str:
    """The Lark grammar for a request with tools (choice is not 'none'). `answer_schema`: what a reply
    that is not a call must be (response_format), else free text."""
    schema = calls_schema(tools, choice, parallel)
    if not all(tool.strict for tool in tools):
        schema["x-guidance"] = {"lenient": True}
    calls = f'calls: {json_schema_lark(schema)}\n'
    tagged = f'"{CALL_OPEN}" calls "{CALL_CLOSE}"'
    if choice.mode in ("required", "function"):
        return f"start: {tagged}\n{calls}"
    if answer_schema is not None:
        return f"start: answer | {tagged}\nanswer: {json_schema_lark(answer_schema)}\n{calls}"
    # Text that never contains the opening tag, or text up to the tag and then valid calls.
    return (
        f"start: PLAIN | prefix calls \"{CALL_CLOSE}\"\n"
        f"prefix[lazy]: /(?s:.*){re.escape(CALL_OPEN)}/\n"
        f"PLAIN: /(?s:.*)/ & ~/(?s:.*){re.escape(CALL_OPEN)}(?s:.*)/\n{calls}"
    )


def template_knows_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _text(content: str | None) -> str:
    return content or ""


def _calls_text(tool_calls: list[dict[str, Any]]) -> str:
    calls = [
        {"name": call["function"]["name"], "arguments": _parsed_arguments(call["function"].get("arguments"))}
        for call in tool_calls
    ]
    return f"{CALL_OPEN}{json.dumps(calls, ensure_ascii=False)}{CALL_CLOSE}"


def check_tool_calls(messages: Sequence[ChatMessage]) -> None:
    """Assistant turns' `tool_calls` and tool turns' `tool_call_id`, in OpenAI's shape."""
    for index, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            raise invalid_request(
                "Messages with role 'tool' must have a 'tool_call_id'.", param=f"messages.[{index}].tool_call_id"
            )
        for call_index, call in enumerate(message.tool_calls or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), str)
            ):
                raise invalid_request(
                    "A tool call needs 'function' with a 'name' and 'arguments' (a string).",
                    param=f"messages.[{index}].tool_calls.[{call_index}]",
                )
        if message.tool_calls and message.role != "assistant":
            raise invalid_request(
                "Only assistant messages can have 'tool_calls'.", param=f"messages.[{index}].tool_calls"
            )


def conversation(messages: Sequence[ChatMessage], tools: list[Tool], native: bool) -> list[dict[str, Any]]:
    """The messages as the chat template gets them. `tools`: the tools the prompt shows (none when the
    choice is 'none'). `native`: the template renders tools, tool turns and calls itself."""
    if native:
        return [_native_message(message) for message in messages]
    turns: list[dict[str, Any]] = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        if role == "tool":
            turns.append({"role": "user", "content": f"<tool_response>\n{_text(message.content)}\n</tool_response>"})
        elif role == "assistant" and message.tool_calls:
            turns.append({"role": "assistant", "content": _text(message.content) + _calls_text(message.tool_calls)})
        else:
            turns.append({"role": role, "content": _text(message.content)})
    if tools:
        prompt = TOOLS_PROMPT.format(
            tools=json.dumps([tool.openai()["function"] for tool in tools], ensure_ascii=False)
        )
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{prompt}\n\n{turns[0]['content']}"}
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns


def _native_message(message: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": _text(message.content),
    }
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _parsed_arguments(call["function"].get("arguments")),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


MAX_ARGUMENTS_DEPTH = 64  # far beyond any real call; keeps json, Jinja and the prompt clear of recursion limits


def json_depth(text: str) -> int:
    """How deep the arrays and objects in `text` nest (brackets inside strings do not count), in one pass
    without recursion, so that a 3,000-deep argument is refused before a parser recurses into it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _parsed_arguments(raw: str | None) -> Any:
    text = raw or "{}"
    if json_depth(text) > MAX_ARGUMENTS_DEPTH:
        raise invalid_request(
            f"Tool call arguments are nested more than {MAX_ARGUMENTS_DEPTH} levels deep.", param="tool_calls"
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return raw
