"""The Responses API through the official openai client (sync, async, responses.stream()), parsed by its
types, against the real server and the embedded model; and the chat side of the same gap (developer
role, context length on /v1/models, /tokenize and /detokenize)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseInputMessageItem,
    ResponseOutputMessage,
    ResponseTextDeltaEvent,
)

from engine.config import EngineConfig
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2, engine_config=EngineConfig(dtype="float32", num_kv_blocks=1024)) as running:
        yield running


def test_create_returns_a_message_with_usage(server, client):
    response = client.responses.create(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=20
    )
    assert isinstance(response, Response) and response.status == "completed"
    assert "Paris" in response.output_text
    [message] = response.output
    assert isinstance(message, ResponseOutputMessage) and message.content[0].type == "output_text"
    counted = httpx.post(
        f"{server.url}/tokenize",
        json={"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    ).json()
    assert response.usage.input_tokens == counted["count"]
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens > 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_async_client_creates_retrieves_and_deletes(server):
    async def run() -> tuple[Response, Response]:
        client = server.async_client()
        created = await client.responses.create(
            model=MODEL,
            instructions="Answer in one word.",
            input=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
            ],
            temperature=0,
            max_output_tokens=8,
            metadata={"ticket": "42"},
        )
        retrieved = await client.responses.retrieve(created.id)
        await client.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)
        return created, retrieved

    created, retrieved = asyncio.run(run())
    assert retrieved.model_dump() == created.model_dump()
    assert created.instructions == "Answer in one word." and created.metadata == {"ticket": "42"}


def test_stream_helper_gets_typed_events_in_sequence(client):
    with client.responses.stream(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=20
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if isinstance(event, ResponseTextDeltaEvent))
    assert deltas == final.output_text and "Paris" in deltas
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_strict_function_tool_call_validates_against_its_schema(client):
    response = client.responses.create(
        model=MODEL, input="What is the weather in Berlin?", tools=[WEATHER_TOOL], tool_choice="required", temperature=0
    )
    [call] = response.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert call.call_id.startswith("call_") and response.tools[0].name == "get_weather"


def test_streamed_function_call_arguments_add_up(client):
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Rome?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = final.output
    assert deltas == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_text_format_json_schema_constrains_the_output(client):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="What is the capital of France? Answer in JSON.",
        temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_three_chained_turns_hit_the_prefix_cache_and_list_every_item(client):
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required", temperature=0
    )
    [call] = first.output
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."}],
        temperature=0,
        max_output_tokens=24,
    )
    third = client.responses.create(
        model=MODEL,
        previous_response_id=second.id,
        tools=[WEATHER_TOOL],
        input="Thanks! Say goodbye.",
        temperature=0,
        max_output_tokens=12,
    )
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert third.usage.input_tokens_details.cached_tokens > second.usage.input_tokens_details.cached_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(third.id, order="asc", limit=100)
    assert isinstance(items.data[0], ResponseInputMessageItem) and isinstance(items.data[3], ResponseOutputMessage)
    assert [(item.type, getattr(item, "role", None)) for item in items.data] == [
        ("message", "user"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items.data[1].id == call.id and items.data[1].call_id == call.call_id
    assert items.data[3].id == second.output[0].id
    newest_first = client.responses.input_items.list(third.id, limit=2)
    assert [item.id for item in newest_first.data] == [items.data[4].id, items.data[3].id] and newest_first.has_more


def test_truncation_auto_drops_old_turns_to_fit(smollm2):
    config = EngineConfig(dtype="float32", num_kv_blocks=256, max_model_len=160)
    with running_server(smollm2, engine_config=config) as small:
        client = small.client()
        long_turn = "Tell me about the history of Paris and its many bridges over the river. " * 3
        first = client.responses.create(model=MODEL, input=long_turn, temperature=0, max_output_tokens=16)
        follow_up = dict(
            model=MODEL, previous_response_id=first.id, input=long_turn, temperature=0, max_output_tokens=16
        )
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**follow_up)
        assert refused.value.code == "context_length_exceeded" and refused.value.param == "input"
        truncated = client.responses.create(**follow_up, truncation="auto")
    assert truncated.status in ("completed", "incomplete") and truncated.truncation == "auto"
    assert truncated.usage.input_tokens + 16 <= 160


def test_codex_request_shape_is_accepted(client):
    """What Codex CLI 0.169 sends (with web search and sub-agents off): reasoning, include, store=false,
    prompt_cache_key, client_metadata, ids on input items, non-strict function tools."""
    response = client.responses.create(
        model=MODEL,
        stream=False,
        store=False,
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        prompt_cache_key="session-1",
        extra_body={"client_metadata": {"x-codex-turn-metadata": "{}"}},
        max_output_tokens=16,
        temperature=0,
        tools=[
            {
                "type": "function",
                "name": "exec_command",
                "description": "Runs a command.",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"cmd": {"type": "string"}},
                    "required": ["cmd"],
                    "additionalProperties": False,
                },
            }
        ],
        input=[
            {
                "type": "message",
                "id": "msg_dev",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are a coding agent."}],
            },
            {
                "type": "message",
                "id": "msg_user",
                "role": "user",
                "content": [{"type": "input_text", "text": "Say hello."}],
            },
        ],
    )
    assert response.status in ("completed", "incomplete") and response.reasoning.summary == "auto"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)  # store=false


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "frobnicate": 1}, "frobnicate"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.[0].type"),
        ({"input": "hi", "tools": [{"type": "namespace", "name": "x", "tools": []}]}, "tools.[0].type"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include.[0]"),
        ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": [{"role": "narrator", "content": "hi"}]}, "input.[0].role"),
        (
            {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.[0].content.[0]",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "call_nowhere", "output": "42"}]}, "input.[0].call_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.[0].type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.[0].call_id"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
            "text.format",
        ),
        ({"input": "hi", "max_output_tokens": "ten"}, "max_output_tokens"),
    ],
)
def test_bad_input_is_refused_in_openai_shape(server, body, param):
    reply = httpx.post(f"{server.base_url}/responses", json={"model": MODEL, **body}, timeout=30)
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_response_ids_are_404(server, client):
    for call in (
        lambda: client.responses.retrieve("resp_nope"),
        lambda: client.responses.delete("resp_nope"),
        lambda: client.responses.input_items.list("resp_nope"),
        lambda: client.responses.cancel("resp_nope"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()


def test_developer_role_in_chat_counts_as_system(client):
    def answer(role: str) -> str:
        completion = client.chat.completions.create(
            model=MODEL,
            temperature=0,
            max_tokens=10,
            messages=[{"role": role, "content": "Always answer in French."}, {"role": "user", "content": "Hello!"}],
        )
        return completion.choices[0].message.content

    assert answer("developer") == answer("system")


def test_models_carry_the_context_length(server, client):
    [model] = client.models.list().data
    assert model.model_extra["context_length"] == model.model_extra["max_model_len"] == server.engine.max_model_len
    assert client.models.retrieve(MODEL).model_extra["context_length"] == server.engine.max_model_len


def test_tokenize_counts_what_chat_usage_counts(server, client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Rome?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
    completion = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=1)
    counted = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages, "tools": tools}).json()
    assert counted["count"] == len(counted["tokens"]) == completion.usage.prompt_tokens
    assert counted["max_model_len"] == server.engine.max_model_len
    plain = httpx.post(
        f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}
    ).json()
    assert len(plain["token_strs"]) == plain["count"]
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}).json()
    assert back["prompt"].endswith("Hello world")
    bad = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    missing = httpx.post(f"{server.url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_obfuscation_pads_deltas_only_when_asked(server):
    def deltas(**extra) -> list[dict]:
        body = {"model": MODEL, "input": "Say hi.", "stream": True, "temperature": 0, "max_output_tokens": 4, **extra}
        with httpx.stream("POST", f"{server.base_url}/responses", json=body, timeout=60) as reply:
            events = [json.loads(line[len("data: ") :]) for line in reply.iter_lines() if line.startswith("data: ")]
        return [event for event in events if event["type"] == "response.output_text.delta"]

    padded, plain = deltas(stream_options={"include_obfuscation": True}), deltas()
    assert padded and all(event["obfuscation"] for event in padded)
    assert plain and not any("obfuscation" in event for event in plain)
    refused = httpx.post(
        f"{server.base_url}/responses",
        json={"model": MODEL, "input": "hi", "stream_options": {"include_obfuscation": True}},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"
