"""Tool calls without the model's forward pass: the grammar each tool_choice compiles to, the prompt that
shows tools and earlier calls, and reading calls out of text whole or piece by piece."""

from __future__ import annotations

import json

import pytest

from app.errors import OpenAIError
from app.serving.schemas import ChatCompletionRequest
from app.serving.structured.guides import compiler_for
from app.serving.structured.plan import plan_request, prepare_chat
from app.serving.structured.tool_calls import ToolCallParser, parse_message
from app.serving.structured.tools import ToolChoice, parse_tools, tools_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
TWO_CALLS = (
    'Checking. <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, {"a": "}"}]}}, '
    '{"name": "get_time", "arguments": {}}]</tool_call>'
)


def accepts(smollm2, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write `text` (as the tokenizer splits it) and then stop."""
    guide = compiler_for(smollm2.tokenizer).compile(grammar).new_guide()
    for token in smollm2.tokenizer.encode(text, add_special_tokens=False):
        if guide.done or not guide.allowed_tokens()[token]:
            return False
        guide.advance(token)
    return guide.done or bool(guide.allowed_tokens()[smollm2.tokenizer.eos_token_id])


def grammar(choice: ToolChoice, parallel: bool = True, answer_schema: dict | None = None) -> str:
    return tools_grammar(parse_tools([WEATHER, CLOCK]), choice, parallel, answer_schema)


def test_required_allows_only_calls(smollm2):
    required = grammar(ToolChoice("required"))
    assert accepts(smollm2, required, CALL)
    assert not accepts(smollm2, required, "It is sunny.")
    assert not accepts(smollm2, required, "<tool_call>[]</tool_call>")
    assert not accepts(smollm2, required, CALL.replace('"Paris"', "42"))
    assert not accepts(smollm2, required, CALL.replace("get_weather", "get_news"))


def test_a_named_function_allows_only_that_function(smollm2):
    named = grammar(ToolChoice("function", "get_time"))
    assert accepts(smollm2, named, '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>')
    assert not accepts(smollm2, named, CALL)


def test_auto_allows_text_but_holds_a_started_call_to_the_tools(smollm2):
    auto = grammar(ToolChoice("auto"))
    assert accepts(smollm2, auto, "It is sunny in Paris today.")
    assert accepts(smollm2, auto, CALL)
    assert accepts(smollm2, auto, "Let me look. " + CALL)
    assert not accepts(smollm2, auto, "Let me look. <tool_call>[{\"name\": \"get_news\"")
    assert not accepts(smollm2, auto, CALL + " More text.")


def test_auto_with_a_response_format_answers_in_that_format_or_calls(smollm2):
    auto = grammar(
        ToolChoice("auto"),
        answer_schema={
            "type": "object",
            "properties": {"answer": {"type": "string"}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    )
    assert accepts(smollm2, auto, '{"answer": "sunny"}')
    assert accepts(smollm2, auto, CALL)
    assert not accepts(smollm2, auto, "It is sunny.")


def test_parallel_tool_calls_false_allows_one_call(smollm2):
    two = CALL.replace("]</tool_call>", ', {"name": "get_time", "arguments": {}}]</tool_call>')
    assert accepts(smollm2, grammar(ToolChoice("required")), two)
    assert not accepts(smollm2, grammar(ToolChoice("required"), parallel=False), two)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **fields})


def test_tools_are_shown_in_a_system_prompt_before_the_callers_own(smollm2):
    body = request(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}], tools=[WEATHER]
    )
    _, prompt_ids = prepare_chat(smollm2.tokenizer, body)
    prompt = smollm2.tokenizer.decode(prompt_ids)
    assert prompt.count("<|im_start|>system") == 1
    assert '"name": "get_weather"' in prompt and prompt.index("<tools>") < prompt.index("Be brief.")


def test_tool_choice_none_shows_no_tools_and_parses_no_calls(smollm2):
    plan, prompt_ids = prepare_chat(
        smollm2.tokenizer, request(messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER], tool_choice="none")
    )
    assert "<tools>" not in smollm2.tokenizer.decode(prompt_ids)
    assert plan.guide_factory is None
    assert plan.message(CALL, "stop") == ({"role": "assistant", "content": CALL, "refusal": None}, "stop")


def test_earlier_calls_and_tool_results_are_rendered_in_the_call_format(smollm2):
    body = request(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
        ]
    )
    _, prompt_ids = prepare_chat(smollm2.tokenizer, body)
    prompt = smollm2.tokenizer.decode(prompt_ids)
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\n21 C and sunny\n</tool_response><|im_end|>" in prompt


def test_a_template_that_knows_tools_renders_them_itself(smollm2):
    tokenizer = type(smollm2.tokenizer).from_pretrained(smollm2.folder)
    tokenizer.chat_template = (
        "{% for tool in tools %}TOOL {{ tool.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.arguments.city }}{% endfor %}"
        "{{ '\\n' }}{% endfor %}"
    )
    body = request(
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    _, prompt_ids = prepare_chat(tokenizer, body)
    assert tokenizer.decode(prompt_ids) == "TOOL get_weather\nuser: Weather?\nassistant:  CALL Rome\ntool: sunny\n"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": []}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools.[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.[0].tool_call_id"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
            "messages.[0].tool_calls.[0]",
        ),
    ],
)
def test_malformed_tool_requests_are_refused_with_the_param(smollm2, fields, param):
    with pytest.raises(OpenAIError) as caught:
        plan_request(smollm2.tokenizer, request(**{"messages": [{"role": "user", "content": "Hi"}], **fields}))
    assert caught.value.status == 400 and caught.value.param == param


def test_a_whole_message_with_text_and_two_calls():
    message, finish_reason = parse_message(TWO_CALLS, "stop")
    assert finish_reason == "tool_calls" and message["content"] == "Checking. "
    calls = message["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": [1, {"a": "}"}]}
    assert calls[1]["function"]["arguments"] == "{}"
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]


def test_text_without_a_call_is_content_and_a_cut_off_call_stays_text():
    assert parse_message("Just text <tool", "stop") == (
        {"role": "assistant", "content": "Just text <tool", "refusal": None},
        "stop",
    )
    cut = CALL[:40]
    assert parse_message(cut, "length") == ({"role": "assistant", "content": cut, "refusal": None}, "length")


@pytest.mark.parametrize("piece_size", [1, 3, 7, 1000])
def test_streamed_pieces_add_up_to_the_whole_message(piece_size):
    parser = ToolCallParser()
    deltas = []
    for start in range(0, len(TWO_CALLS), piece_size):
        deltas += parser.feed(TWO_CALLS[start : start + piece_size])
    deltas += parser.finish()
    content = "".join(delta.get("content", "") for delta in deltas)
    pieces = [piece for delta in deltas for piece in delta.get("tool_calls", ())]
    whole, _ = parse_message(TWO_CALLS, "stop")
    assert content == whole["content"]
    for index, call in enumerate(whole["tool_calls"]):
        mine = [piece for piece in pieces if piece["index"] == index]
        assert mine[0]["function"] == {"name": call["function"]["name"], "arguments": ""}
        assert mine[0]["type"] == "function" and mine[0]["id"].startswith("call_")
        assert all("id" not in piece and "name" not in piece["function"] for piece in mine[1:])
        assert "".join(piece["function"]["arguments"] for piece in mine) == call["function"]["arguments"]
    assert not any("<" in delta.get("content", "") for delta in deltas)  # the tag never leaks as text
