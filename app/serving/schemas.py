"""Request bodies of the OpenAI routes. Strict types (no "0.5" for a number), unknown fields ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Body):
    include_usage: bool | None = None


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError("stop must be a string or a list of strings")


class SamplingFields(Body):
    """What chat and completions share: OpenAI's sampling fields plus the engine's extras."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's field: lower runs first. Capped by the key's priority floor (default 0: only later).
    priority: int | None = Field(None, ge=-1000, le=1000)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        return _stop_strings(value)


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns; checked in app/serving/structured
    tool_call_id: str | None = None  # tool turns

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> str | None:
        """Content is a string or a list of text parts; the parts are joined the way vLLM joins them."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Structured output and tools: read and enforced by app/serving/structured.
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value


Prompt = str | list[int]


MAX_PROMPTS = 2048


class CompletionRequest(SamplingFields):
    prompt: list[Prompt]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None  # refused above 1 (below): ignoring it would bill n answers as if best_of ran

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("best_of is not supported (only 1); ask for n choices and pick among them yourself")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> list[Prompt]:
        """A string, a list of strings, a list of token ids, or a list of lists of token ids."""

        def is_ids(item: Any) -> bool:
            return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

        if isinstance(value, str):
            return [value]
        if is_ids(value) and value:
            return [value]
        if isinstance(value, list) and value and all(isinstance(item, str) or is_ids(item) for item in value):
            if len(value) > MAX_PROMPTS:  # OpenAI's cap; each prompt is an engine request of its own
                raise ValueError(f"prompt takes at most {MAX_PROMPTS} prompts, got {len(value)}")
            return list(value)
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")
