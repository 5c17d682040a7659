"""Structured output and tool calls through the official openai client, real model: the shape is
guaranteed by constrained decoding, whatever the model would rather say."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, StringConstraints

from tests.support.server import MODEL

pytestmark = pytest.mark.real_model

# Nested, with arrays, enums, numbers and required fields; bounded so that it always fits in max_tokens.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"enum": ["book", "pen", "lamp"]},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    "rating": {"type": "number", "minimum": 0, "maximum": 5, "multipleOf": 0.5},
                },
                "required": ["product", "quantity", "rating"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["open", "shipped", "closed"]},
    },
    "required": ["customer", "items", "status"],
    "additionalProperties": False,
}
ORDER_FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}}
ORDER_PROMPT = [{"role": "user", "content": "Make up a customer order and give it as JSON."}]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_ARGUMENTS = WEATHER_TOOL["function"]["parameters"]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_fifty_sampled_outputs_all_validate_against_a_nested_schema(server):
    async def sample() -> list:
        async with server.async_client(timeout=600) as client:
            responses = await asyncio.gather(
                *[
                    client.chat.completions.create(
                        model=MODEL,
                        messages=ORDER_PROMPT,
                        response_format=ORDER_FORMAT,
                        temperature=1,
                        n=10,
                        seed=seed,
                        max_tokens=160,
                    )
                    for seed in range(5)
                ]
            )
        return [choice for response in responses for choice in response.choices]

    choices = asyncio.run(sample())
    assert len(choices) == 50
    for choice in choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ORDER_SCHEMA)
    assert len({choice.message.content for choice in choices}) > 10  # sampled, not one answer fifty times


ShortText = Annotated[str, StringConstraints(max_length=20)]


class Person(BaseModel):
    name: ShortText
    age: int = Field(ge=18, le=99)


class CityFacts(BaseModel):  # nested models become $defs and $ref in the schema the client sends
    city: ShortText
    mayor: Person
    country: ShortText
    population_millions: int = Field(ge=0, le=100)
    climate: Literal["cold", "mild", "hot"]
    landmarks: list[ShortText] = Field(max_length=3)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give facts about Paris."}],
        response_format=CityFacts,
        temperature=0,
        max_tokens=200,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, CityFacts)
    assert CityFacts.model_validate_json(message.content) == message.parsed


def test_json_object_mode_returns_a_json_object(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with the name and age of a cat."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_streamed_structured_output_concatenates_to_valid_json(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ORDER_PROMPT,
        response_format=ORDER_FORMAT,
        temperature=0.8,
        seed=7,
        max_tokens=160,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), ORDER_SCHEMA)


def test_required_tool_call_returns_valid_arguments(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        arguments = json.loads(call.function.arguments)
        tool = WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL
        jsonschema.validate(arguments, tool["function"]["parameters"])


def test_named_tool_call_streams_the_way_openai_does(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        temperature=1,
        seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        stream=True,
    )
    pieces = [(chunk.choices[0].delta, chunk.choices[0].finish_reason) for chunk in stream]
    calls = [call for delta, _ in pieces for call in delta.tool_calls or ()]
    first, rest = calls[0], calls[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert rest and all(piece.id is None and piece.function.name is None for piece in rest)
    arguments = "".join(piece.function.arguments for piece in rest)
    jsonschema.validate(json.loads(arguments), WEATHER_ARGUMENTS)
    assert not any(delta.content for delta, _ in pieces)
    assert pieces[-1][1] == "tool_calls"


def test_streamed_and_whole_forced_calls_agree(client):
    request = dict(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0].function
    streamed = "".join(
        call.function.arguments or ""
        for chunk in client.chat.completions.create(**request, stream=True)
        for call in chunk.choices[0].delta.tool_calls or ()
    )
    assert streamed == whole.arguments


def test_parallel_tool_calls_false_allows_one_call(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather and time in Paris, Rome and Oslo?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1,
        seed=1,
        n=4,
        max_tokens=80,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


def test_tool_choice_none_never_returns_a_call(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Call get_weather for Paris. Answer with <tool_call>."}],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        temperature=1,
        seed=5,
        n=4,
        max_tokens=40,
    )
    for choice in response.choices:
        assert choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")


def test_auto_answers_in_text_or_with_a_valid_call(client):
    response = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=1, seed=2, n=4, max_tokens=40
    )
    for choice in response.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGUMENTS)
        else:
            assert "<tool_call>" not in (choice.message.content or "")


def test_tool_results_are_accepted_in_the_next_turn(client):
    first = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        *WEATHER_QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=[WEATHER_TOOL], tool_choice="none", temperature=0, max_tokens=30
    )
    assert second.choices[0].message.content
    assert second.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "response_format, fragment",
    [
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "strict": True,
                    "schema": {"type": "object", "properties": {"a": {"not": {}}}},
                },
            },
            "not",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "strng"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}},
            "look",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
        ({"type": "xml"}, "type"),
    ],
)
def test_bad_schemas_are_refused_with_400(client, response_format, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ORDER_PROMPT, response_format=response_format, max_tokens=5
        )
    error = caught.value.body
    assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
    assert fragment in error["message"]


@pytest.mark.parametrize(
    "request_fields, param",
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {"type": "object", "properties": {"a": {"not": {}}}},
                        },
                    }
                ]
            },
            "tools.[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_bad_tools_are_refused_with_400(client, request_fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, max_tokens=5, **request_fields)
    assert caught.value.body["param"] == param
