"""Every refusal in OpenAI's error shape, with the status, type, code and param a client expects."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from engine.config import EngineConfig
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

HELLO = [{"role": "user", "content": "Hello"}]
API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2, max_request_bytes=64 * 1024) as running:
        yield running


@pytest.fixture(scope="module")
def small_server(smollm2):
    """One running sequence, one waiting, and an API key."""
    config = EngineConfig(dtype="float32", num_kv_blocks=64, max_num_seqs=1, max_waiting=1)
    with running_server(smollm2, engine_config=config, api_key=API_KEY) as running:
        yield running


def assert_openai_error(
    response: httpx.Response,
    status: int,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert (error["type"], error["code"], error["param"]) == (type, code, param)
    return error


def assert_bad_request(call, *, param: str | None, code: str | None = None) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value
    assert error.status_code == 400
    assert error.type == "invalid_request_error"
    assert (error.param, error.code) == (param, code)
    return error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"presence_penalty": 9}, "presence_penalty"),
        ({"frequency_penalty": -9}, "frequency_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"seed": "x"}, "seed"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_chat_parameter_is_named(client, fields, param):
    assert_bad_request(lambda: client.chat.completions.create(model=MODEL, messages=HELLO, **fields), param=param)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "robot", "content": "hi"}], "messages.[0].role"),
        ([{"role": "user", "content": "hi"}, {"role": "user", "content": 42}], "messages.[1].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.[0].content"),
        ([{"content": "hi"}], "messages.[0].role"),
    ],
)
def test_bad_messages_are_named(client, messages, param):
    assert_bad_request(lambda: client.chat.completions.create(model=MODEL, messages=messages), param=param)


def test_bad_streamed_request_fails_before_any_chunk(client):
    assert_bad_request(
        lambda: client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, temperature=9),
        param="temperature",
    )
    assert_bad_request(lambda: client.completions.create(model=MODEL, prompt="hi", stream=True, n=99), param="n")


def test_missing_messages_is_named(client):
    assert_bad_request(
        lambda: client.post("/chat/completions", body={"model": MODEL}, cast_to=object), param="messages"
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, -5]}, "prompt"),
        ({"prompt": ["fine", [49152]]}, "prompt.[1]"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": "hi", "logprobs": 99}, "logprobs"),
        ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ],
)
def test_bad_completion_parameter_is_named(client, fields, param):
    assert_bad_request(lambda: client.completions.create(model=MODEL, **fields), param=param)


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 8000}], max_tokens=500
        )
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="word " * 8000, max_tokens=500)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "prompt")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=HELLO)
    assert (caught.value.status_code, caught.value.code, caught.value.param) == (404, "model_not_found", "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-17")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi")


def test_malformed_json_is_400(server):
    response = httpx.post(
        f"{server.base_url}/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, code="invalid_json")


def test_body_that_is_not_an_object_is_400(server):
    response = httpx.post(f"{server.base_url}/chat/completions", json=[1, 2, 3])
    assert_openai_error(response, 400)


def test_empty_body_is_400(server):
    response = httpx.post(f"{server.base_url}/completions", content=b"", headers={"content-type": "application/json"})
    assert_openai_error(response, 400, code="invalid_json")


def test_wrong_content_type_is_415(server):
    body = json.dumps({"model": MODEL, "messages": HELLO})
    response = httpx.post(
        f"{server.base_url}/chat/completions",
        content=body,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert_openai_error(response, 415, code="unsupported_media_type")


def test_huge_body_is_413_not_a_hang(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 200_000}]})
    started = time.monotonic()
    response = httpx.post(
        f"{server.base_url}/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=10
    )
    assert_openai_error(response, 413, code="request_too_large")
    assert time.monotonic() - started < 5


def test_huge_chunked_body_is_413(server):
    def chunks():
        for _ in range(100):
            yield b"x" * 1024

    response = httpx.post(
        f"{server.base_url}/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=10
    )
    assert_openai_error(response, 413, code="request_too_large")


def test_unknown_route_and_method_keep_the_shape(server):
    assert_openai_error(httpx.get(f"{server.base_url}/engines"), 404, code="unknown_url")
    assert_openai_error(httpx.get(f"{server.base_url}/chat/completions"), 405, code="method_not_allowed")


def test_wrong_or_missing_api_key_is_401(small_server):
    with pytest.raises(openai.AuthenticationError) as caught:
        small_server.client(api_key="sk-wrong").models.list()
    assert (caught.value.status_code, caught.value.code) == (401, "invalid_api_key")
    assert_openai_error(httpx.get(f"{small_server.base_url}/models"), 401, code="invalid_api_key")
    assert [m.id for m in small_server.client(api_key=API_KEY).models.list()] == [MODEL]
    assert httpx.get(f"{small_server.url}/health").status_code == 200


def test_full_waiting_queue_is_503_with_retry_after(small_server):
    headers = {"authorization": f"Bearer {API_KEY}"}
    long_stream = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 900,
        "stream": True,
        "extra_ignored": 1,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=small_server.base_url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/chat/completions", json=long_stream) as running:
            running_lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            next(running_lines)
            small_server.wait_for_metrics(lambda m: m["vllm:num_requests_running"] == 1)
            with http.stream("POST", "/chat/completions", json=long_stream) as waiting:
                waiting_lines = waiting.iter_lines()
                next(waiting_lines)
                small_server.wait_for_metrics(lambda m: m["vllm:num_requests_waiting"] == 1)
                with pytest.raises(openai.APIStatusError) as caught:
                    small_server.client(api_key=API_KEY).chat.completions.create(model=MODEL, messages=HELLO)
                error = caught.value
                assert error.status_code == 503
                assert error.response.headers["retry-after"] == "1"
                assert error.code == "queue_full"
    small_server.wait_for_metrics(lambda m: m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0)


def test_default_max_tokens_fits_a_small_kv_pool(small_server):
    response = small_server.client(api_key=API_KEY).chat.completions.create(model=MODEL, messages=HELLO)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_client_gone_mid_body_logs_no_traceback(server, caplog):
    """A client that hangs up while sending its body is not a server error: nothing to answer, nothing
    logged as unhandled (an operator's error alerts must not fire for a flaky phone connection)."""
    address = urlsplit(server.url)
    caplog.clear()
    with socket.create_connection((address.hostname, address.port), timeout=10) as raw:
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n" + b'{"model": "' + b"x" * 100
        )
        time.sleep(0.3)
    time.sleep(0.5)  # the server notices the hang-up
    with httpx.Client(base_url=server.url, timeout=30) as http:  # and still serves the next client
        assert http.get("/v1/models").status_code == 200
    unexpected = [record for record in caplog.records if record.levelname in ("ERROR", "CRITICAL")]
    assert not unexpected, [record.getMessage() for record in unexpected]
