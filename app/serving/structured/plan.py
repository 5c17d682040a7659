"""What one chat request asks of structured output, decided once before generation: the prompt (with
tools), the guide that constrains the output, and how the output turns into a message or stream pieces.
The chat route asks the plan at these points and knows nothing else of tools or schemas."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.errors import invalid_request
from app.serving.prompts import chat_prompt_ids
from app.serving.structured.guides import GrammarError, GrammarGuideFactory, compiler_for, json_schema_grammar
from app.serving.structured.response_format import response_schema
from app.serving.structured.tool_calls import ToolCallParser, parse_message
from app.serving.structured.tools import (
    Tool,
    check_tool_calls,
    conversation,
    parse_tool_choice,
    parse_tools,
    template_knows_tools,
    tools_grammar,
)
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from app.serving.schemas import ChatCompletionRequest, ChatMessage


@dataclass(frozen=True)
class StructuredPlan:
    shown_tools: list[Tool] = field(default_factory=list)  # in the prompt; empty for tool_choice "none"
    native_tools: bool = False  # the chat template renders tools itself
    guide_factory: object | None = None
    tool_history: bool = False  # earlier turns hold tool calls or results

    @property
    def parses_calls(self) -> bool:
        return bool(self.shown_tools)

    def prompt_ids(self, tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage]) -> list[int]:
        if not (self.shown_tools or self.tool_history):
            return chat_prompt_ids(tokenizer, messages)
        turns = conversation(messages, self.shown_tools, self.native_tools)
        try:
            text = tokenizer.apply_chat_template(
                turns,
                tokenize=False,
                add_generation_prompt=True,
                tools=[tool.openai() for tool in self.shown_tools] if self.native_tools and self.shown_tools else None,
            )
        except Exception as error:
            raise invalid_request(f"The chat template rejected these messages: {error}", param="messages") from error
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)  # a decorator hides encode's type
        return ids

    def constrain(self, params: SamplingParams) -> SamplingParams:
        if self.guide_factory is None:
            return params
        return dataclasses.replace(params, guide_factory=self.guide_factory)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        if not self.parses_calls:
            return {"role": "assistant", "content": text, "refusal": None}, finish_reason
        return parse_message(text, finish_reason)

    def streams(self, n: int) -> ChoiceStreams:
        return ChoiceStreams([ToolCallParser() for _ in range(n)] if self.parses_calls else None)


class ChoiceStreams:
    """Turns each engine delta of a streamed request into the chunk deltas to send, per choice."""

    def __init__(self, parsers: list[ToolCallParser] | None) -> None:
        self._parsers = parsers

    def pieces(
        self, index: int, text: str, finish_reason: str | None, has_logprobs: bool
    ) -> list[tuple[dict[str, Any], str | None]]:
        """(delta, finish_reason) pairs; the finish reason rides on the last one."""
        if self._parsers is None:
            deltas = [{"content": text}] if text else []
        else:
            parser = self._parsers[index]
            deltas = parser.feed(text) if text else []
            if finish_reason is not None:
                deltas += parser.finish()
                if finish_reason == "stop" and parser.announced_calls:
                    finish_reason = "tool_calls"
        if not deltas:
            return [({}, finish_reason)] if finish_reason or has_logprobs else []
        return [(delta, None) for delta in deltas[:-1]] + [(deltas[-1], finish_reason)]


def prepare_chat(tokenizer: PreTrainedTokenizerBase, body: ChatCompletionRequest) -> tuple[StructuredPlan, list[int]]:
    """The plan and the prompt's token ids. Blocking: run it off the event loop."""
    plan = plan_request(tokenizer, body)
    return plan, plan.prompt_ids(tokenizer, body.messages)


def plan_request(tokenizer: PreTrainedTokenizerBase, body: ChatCompletionRequest) -> StructuredPlan:
    """Reads `response_format`, `tools`, `tool_choice` and `parallel_tool_calls`, and compiles the grammar
    (cached per grammar). Blocking (the first compile builds the tokenizer's tables): run it off the loop."""
    schema = response_schema(body.response_format)
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    check_tool_calls(body.messages)
    tool_history = any(message.role == "tool" or message.tool_calls for message in body.messages)
    shown = tools if choice.mode != "none" else []
    factory: GrammarGuideFactory | None = None
    if schema is not None:  # refused here, named as the culprit, even when a tools grammar embeds it
        factory = _compile(tokenizer, lambda: json_schema_grammar(schema), "response_format")
    if shown:
        parallel = body.parallel_tool_calls is not False
        factory = _compile(tokenizer, lambda: tools_grammar(tools, choice, parallel, schema), "tools")
    return StructuredPlan(
        shown_tools=shown,
        native_tools=template_knows_tools(tokenizer),
        guide_factory=factory,
        tool_history=tool_history,
    )


def _compile(tokenizer: PreTrainedTokenizerBase, grammar: Callable[[], str], param: str) -> GrammarGuideFactory:
    try:
        return compiler_for(tokenizer).compile(grammar())
    except GrammarError as error:
        raise invalid_request(f"Invalid schema in '{param}': {error}", param=param) from None
