"""The body of POST /v1/responses, and which of its fields we honour, accept or refuse.

Every field OpenAI defines is one of three kinds here: honoured (it changes what we do), accepted (it
does not apply to a model we serve, and saying so in the README is enough: `reasoning`, `client_metadata`
...), or refused with a 400 naming it when it asks for something we do not do (`background: true`,
`conversation`, hosted tools ...). A field OpenAI does not define is refused too, never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from app.errors import invalid_request

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
# What `include` may name: we produce no reasoning items, so there is no encrypted content to add.
ACCEPTED_INCLUDES = ("reasoning.encrypted_content",)
# Fields that ask for features we do not build: refused unless absent or null (or the value that
# means "off", given here).
REFUSED_UNLESS = {
    "background": (None, False),
    "background_options": (None,),
    "conversation": (None,),
    "prompt": (None,),
    "context_management": (None,),
    "moderation": (None,),
    "image": (None,),
    "access_programs": (None,),
    "prompt_cache_options": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "prompt_cache_retention": (None, "in_memory"),  # prefixes live in the KV pool, never 24h
    "service_tier": (None, "auto", "default"),
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # extras are refused by name in check_fields

    model: str
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    client_metadata: dict[str, Any] | None = None  # Codex CLI sends its turn metadata here
    # Refused when set (REFUSED_UNLESS):
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    service_tier: Any = None

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def text_format(self) -> dict[str, Any]:
        return (self.text or {}).get("format") or {"type": "text"}


def check_fields(body: ResponsesRequest) -> None:
    """400 for a field we do not know or a value we would otherwise have to ignore."""
    for name in body.model_extra or {}:
        raise invalid_request(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
    for name, allowed in REFUSED_UNLESS.items():
        value = getattr(body, name)
        if not any(value is option or (value == option and type(value) is type(option)) for option in allowed):
            raise invalid_request(
                f"'{name}' is not supported by tokenmill's Responses API"
                f"{'' if value is True else f' (got {value!r})'}.",
                param=name,
                code="unsupported_parameter",
            )
    if body.input is None:
        raise invalid_request("Missing required parameter: 'input'.", param="input")
    if isinstance(body.input, list) and not body.input and body.previous_response_id is None:
        raise invalid_request("'input' must contain at least one item.", param="input")
    if body.metadata is not None and len(body.metadata) > 16:
        raise invalid_request("'metadata' may have at most 16 keys.", param="metadata")
    if body.stream_options is not None:
        if not body.stream:
            raise invalid_request("stream_options is only allowed when stream is true.", param="stream_options")
        unknown = set(body.stream_options) - {"include_obfuscation"}
        if unknown:
            raise invalid_request(f"Unrecognized stream option: {sorted(unknown)[0]}", param="stream_options")
    for index, include in enumerate(body.include or ()):
        if include not in ACCEPTED_INCLUDES:
            raise invalid_request(
                f"'include' value {include!r} is not supported: this server has no hosted tools, "
                "logprobs in output or images to include.",
                param=f"include.[{index}]",
                code="unsupported_parameter",
            )
    _check_reasoning(body.reasoning)
    _check_text(body.text)


def _check_reasoning(reasoning: dict[str, Any] | None) -> None:
    """Reasoning settings are accepted (clients such as Codex always send them) and echoed; the models
    we serve do not reason, so they produce no reasoning items and no reasoning tokens."""
    if reasoning is None:
        return
    unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise invalid_request(f"Unrecognized reasoning option: {sorted(unknown)[0]}", param="reasoning")
    if reasoning.get("effort") not in (None, *REASONING_EFFORTS):
        raise invalid_request(
            f"Invalid value for 'reasoning.effort': {reasoning.get('effort')!r}.", param="reasoning.effort"
        )
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) not in (None, *REASONING_SUMMARIES):
            raise invalid_request(
                f"Invalid value for 'reasoning.{name}': {reasoning.get(name)!r}.", param=f"reasoning.{name}"
            )


def _check_text(text: dict[str, Any] | None) -> None:
    if text is None:
        return
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise invalid_request(f"Unrecognized text option: {sorted(unknown)[0]}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid_request(
            "'text.verbosity' other than 'medium' is not supported: the model has no verbosity control.",
            param="text.verbosity",
            code="unsupported_parameter",
        )
    format_ = text.get("format")
    if format_ is not None and not isinstance(format_, dict):
        raise invalid_request("'text.format' must be an object.", param="text.format")


def reasoning_echo(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    reasoning = reasoning or {}
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}
