"""Bad chat bodies against the real server: every one gets a 4xx in OpenAI's shape, fast, and the server
goes on serving. Hand-picked nasties (huge, deep, invalid UTF-8, NaN, out-of-range numbers, 100k-item
lists, wrong types) and a bounded hypothesis fuzz of random JSON."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

MAX_BYTES = 256 * 1024
CAP = 8
HELLO = [{"role": "user", "content": "hi"}]
SLOW_S = 5.0


@pytest.fixture(scope="module")
def server(smollm2):
    config = EngineConfig(dtype="float32", num_kv_blocks=256, max_num_seqs=8)
    with running_server(smollm2, engine_config=config, max_request_bytes=MAX_BYTES, max_tokens_cap=CAP) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def body(**fields) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields}


def raw(text: str) -> bytes:
    return text.encode()


NASTY: dict[str, dict | bytes] = {
    # numbers
    "seed_beyond_int64": body(seed=2**70),  # once killed the engine thread: every later request hung
    "seed_2_63": body(seed=2**63),
    "max_tokens_huge": body(max_tokens=2**80),
    "max_tokens_over_cap": body(max_tokens=CAP + 1),
    "max_completion_tokens_over_cap": body(max_completion_tokens=10**6),
    "max_tokens_negative": body(max_tokens=-1),
    "max_tokens_zero": body(max_tokens=0),
    "n_huge": body(n=2**70),
    "n_negative": body(n=-3),
    "min_tokens_huge": body(min_tokens=2**70),
    "top_logprobs_huge": body(logprobs=True, top_logprobs=2**40),
    "temperature_nan": raw(f'{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"temperature":NaN}}'),
    "top_p_infinity": raw(f'{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"top_p":Infinity}}'),
    "penalty_minus_infinity": raw(
        f'{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"presence_penalty":-Infinity}}'
    ),
    "temperature_huge": body(temperature=1e308),
    "logit_bias_negative_id": body(logit_bias={"-3": 5}),  # once wrapped round to the vocabulary's end
    "logit_bias_huge_id": body(logit_bias={str(2**80): 5}),
    "logit_bias_nan": raw(
        f'{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"logit_bias":{{"5":NaN}}}}'
    ),
    "stop_token_ids_negative": body(stop_token_ids=[-1]),
    # strings and encodings
    "invalid_utf8": b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"\xff\xfe\xc3"}]}',
    "lone_surrogate": raw(f'{{"model":"{MODEL}","messages":[{{"role":"user","content":"\\ud800"}}]}}'),
    "nul_in_model": body(model="Smol\x00LM"),
    "huge_prompt_under_the_size_cap": body(messages=[{"role": "user", "content": "word " * 50_000}]),
    "body_over_the_size_cap": body(messages=[{"role": "user", "content": "x" * (MAX_BYTES + 1)}]),
    "many_messages": body(messages=[{"role": "user", "content": "a"}] * 100_000),
    "many_stop_strings": body(stop=["x"] * 100_000),
    # structure
    "deep_list": raw('{"model":"x","messages":' + "[" * 100_000 + "]" * 100_000 + "}"),
    "deep_object": raw(
        '{"model":"x","messages":[{"role":"user","content":"x","name":' + '{"a":' * 50_000 + "1" + "}" * 50_000 + "}]}"
    ),
    "deep_schema": raw(
        f'{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"response_format":'
        '{"type":"json_schema","json_schema":{"name":"x","schema":'
        + '{"type":"object","properties":{"a":' * 2000
        + '{"type":"string"}'
        + "}}" * 2000
        + "}}}"
    ),
    "not_json": raw("{model: x"),
    "truncated_json": raw(json.dumps(body())[:-5]),
    "json_array": raw("[1, 2, 3]"),
    "json_null": raw("null"),
    "empty_messages": body(messages=[]),
    "messages_string": body(messages="hi"),
    "message_without_role": body(messages=[{"content": "hi"}]),
    "unknown_role": body(messages=[{"role": "wizard", "content": "hi"}]),
    "content_number": body(messages=[{"role": "user", "content": 5}]),
    "content_image_part": body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
    "model_null": body(model=None),
    "model_list": body(model=[MODEL]),
    "unknown_model": body(model="gpt-4"),
    "stream_string": body(stream="yes"),
    "stream_options_without_stream": body(stream_options={"include_usage": True}),
    "max_tokens_float": body(max_tokens=2.5),
    "max_tokens_string": body(max_tokens="2"),
    "n_bool": body(n=True),
    "stop_dict": body(stop={"a": 1}),
    "tools_garbage": body(tools=[{"type": "function", "function": {"name": 1}}]),
    "tools_empty_object": body(tools=[{}], tool_choice="required"),
    "tool_choice_unknown": body(tool_choice={"type": "function", "function": {"name": "nope"}}),
    "response_format_garbage": body(response_format={"type": "json_schema", "json_schema": 5}),
    "response_format_unknown": body(response_format={"type": "yaml"}),
}


def assert_openai_4xx(response: httpx.Response, elapsed: float) -> None:
    assert 400 <= response.status_code < 500, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert elapsed < SLOW_S


@pytest.mark.parametrize("name", sorted(NASTY))
def test_nasty_chat_body_gets_an_openai_4xx(server, http, name):
    payload = NASTY[name]
    started = time.monotonic()
    if isinstance(payload, bytes):
        response = http.post("/chat/completions", content=payload, headers={"content-type": "application/json"})
    else:
        response = http.post("/chat/completions", json=payload)
    assert_openai_4xx(response, time.monotonic() - started)


def test_the_server_still_serves_after_the_nasties(server, http):
    for name in ("seed_beyond_int64", "logit_bias_negative_id", "deep_list"):
        payload = NASTY[name]
        if isinstance(payload, bytes):
            http.post("/chat/completions", content=payload, headers={"content-type": "application/json"})
        else:
            http.post("/chat/completions", json=payload)
    response = http.post("/chat/completions", json=body(seed=2**63 - 1, n=2), timeout=20)
    assert response.status_code == 200, response.text
    server.wait_for_metrics(lambda m: m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0)


def test_big_but_valid_bodies_are_answered_quickly(http):
    for payload in (
        body(logit_bias={str(i): 1 for i in range(20_000)}),
        body(user="u" * 200_000),
        body(messages=[{"role": "user", "content": "a"}] * 2_000),
    ):
        started = time.monotonic()
        response = http.post("/chat/completions", json=payload)
        assert response.status_code in (200, 400), response.text[:300]
        assert time.monotonic() - started < SLOW_S


def test_max_tokens_cap_bounds_a_request_that_names_none(http):
    response = http.post("/chat/completions", json={"model": MODEL, "messages": HELLO, "ignore_eos": True})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] <= CAP


JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "response_format",
    "tools",
    "tool_choice",
    "user",
]
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]), "content": JSON_VALUES}
    ),
    max_size=3,
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5), messages=MESSAGES)
def test_random_chat_bodies_get_a_200_or_an_openai_4xx(server, http, fields, messages):
    payload = {"model": MODEL, "messages": messages, "max_tokens": 2, **fields}
    started = time.monotonic()
    response = http.post("/chat/completions", json=payload)
    elapsed = time.monotonic() - started
    if response.status_code == 200:
        if payload.get("stream") is True:
            assert response.text.rstrip().endswith("data: [DONE]")
            assert '"type":"server_error"' not in response.text
        return
    assert_openai_4xx(response, elapsed)
