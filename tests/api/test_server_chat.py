"""Chat completions and models through the official openai client, sync and async, real model."""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from tests.support.server import MODEL

pytestmark = pytest.mark.real_model

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_async_models_list(server):
    async def ids():
        async with server.async_client() as client:
            return [model.id async for model in client.models.list()]

    assert asyncio.run(ids()) == [MODEL]


def test_chat_answers_with_usage(client):
    response = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=20)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    usage = response.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_content_as_text_parts_equals_plain_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    response = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=20)
    assert response.choices[0].message.content == "The capital of France is Paris."


def test_system_and_assistant_turns_are_templated(server, client):
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5)
    expected_prompt = server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert response.usage.prompt_tokens == len(
        server.engine.tokenizer.encode(expected_prompt, add_special_tokens=False)
    )


def test_greedy_chat_equals_the_engine_called_directly(server, client):
    messages = [{"role": "user", "content": "Write one sentence about rivers."}]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    tokenizer = server.engine.tokenizer
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )

    async def engine_text() -> str:
        parts = []
        async for output in server.engine.generate(
            "direct-greedy", prompt, SamplingParams(temperature=0, max_tokens=24)
        ):
            parts.extend(delta.text for delta in output.deltas)
        return "".join(parts)

    assert response.choices[0].message.content == asyncio.run(engine_text())


def test_stream_sends_role_first_then_text_then_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == "The capital of France is Paris."
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finish == ["stop"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_async_stream_matches_the_whole_response(server, client):
    whole = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=20)

    async def streamed():
        async with server.async_client() as aclient:
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=CAPITAL,
                temperature=0,
                max_tokens=20,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

    text, usage = asyncio.run(streamed())
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_gives_that_many_choices_and_counts_all_tokens(client):
    response = client.chat.completions.create(model=MODEL, messages=CAPITAL, n=2, max_tokens=6, seed=3)
    assert [choice.index for choice in response.choices] == [0, 1]
    assert all(choice.message.content for choice in response.choices)
    assert response.usage.completion_tokens <= 12
    assert response.usage.completion_tokens >= 2


def test_stop_string_cuts_the_text(client):
    response = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=20, stop=[" is"])
    assert response.choices[0].message.content == "The capital of France"
    assert response.choices[0].finish_reason == "stop"


def test_max_tokens_ends_with_length(client):
    response = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=3)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 3
    newer = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_completion_tokens=2)
    assert newer.choices[0].finish_reason == "length" and newer.usage.completion_tokens == 2


def test_same_seed_same_sampled_text(client):
    story = [{"role": "user", "content": "Tell me a story about a cat."}]

    def sample(seed: int) -> str:
        return (
            client.chat.completions.create(model=MODEL, messages=story, temperature=1.0, seed=seed, max_tokens=24)
            .choices[0]
            .message.content
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_logprobs_match_the_tokens(client):
    response = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=20, logprobs=True, top_logprobs=3
    )
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert "".join(entry.token for entry in entries) == choice.message.content
    assert len(entries) <= response.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0
        assert bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the best one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert [top.logprob for top in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )


def test_streamed_logprobs_cover_the_streamed_text(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=20, logprobs=True, stream=True
    )
    text, tokens = "", ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += "".join(entry.token for entry in chunk.choices[0].logprobs.content)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert tokens == text == "The capital of France is Paris."


def test_no_logprobs_unless_asked(client):
    response = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=3)
    assert response.choices[0].logprobs is None


def test_engine_extras_and_unknown_fields_pass_through(client):
    greedy = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=8)
    top_k_one = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=1.0,
        max_tokens=8,
        user="someone",
        extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0, "some_future_field": {"x": 1}},
    )
    assert top_k_one.choices[0].message.content == greedy.choices[0].message.content
    forced = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12, extra_body={"ignore_eos": True, "min_tokens": 12}
    )
    assert forced.usage.completion_tokens == 12 and forced.choices[0].finish_reason == "length"


def test_logit_bias_bans_a_token(server, client):
    paris = server.engine.tokenizer.encode(" Paris")
    assert len(paris) == 1
    response = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12, logit_bias={str(paris[0]): -100}
    )
    assert "Paris" not in response.choices[0].message.content


def test_repeated_long_system_prompt_hits_the_prefix_cache(client):
    system = "You are a meticulous librarian who catalogues rare maps. " * 30

    def ask(question: str):
        return client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )

    first = ask("Which map is the oldest?")
    second = ask("Which map is the largest?")
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.8 * second.usage.prompt_tokens - 32


def test_a_burst_sharing_a_system_prompt_computes_it_once(server):
    system = "You are the night-shift dispatcher of a ferry line; log every crossing with its time. " * 25

    async def burst():
        async with server.async_client() as client:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        max_tokens=2,
                        temperature=0,
                        messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Crossing {n}?"}],
                    )
                    for n in range(4)
                )
            )

    responses = asyncio.run(burst())
    cached = sorted(response.usage.prompt_tokens_details.cached_tokens for response in responses)
    prompt_tokens = min(response.usage.prompt_tokens for response in responses)
    # sent together, nothing cached before: one computes the system prompt, the others read it from the cache
    assert cached[0] < 0.5 * prompt_tokens
    assert all(tokens >= 0.8 * prompt_tokens - 32 for tokens in cached[1:])


def test_sixteen_concurrent_streams_all_finish_with_their_usage(server):
    tokenizer = server.engine.tokenizer

    async def one(aclient, index: int):
        messages = [{"role": "user", "content": f"Give me fact number {index} about the sea."}]
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        return chunks, len(prompt)

    async def all_of_them():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, index) for index in range(16)))

    for chunks, prompt_len in asyncio.run(all_of_them()):
        usage = chunks[-1].usage
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish in (["stop"], ["length"])
        assert usage.prompt_tokens == prompt_len
        assert 1 <= usage.completion_tokens <= 8
        if finish == ["length"]:
            assert usage.completion_tokens == 8
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    server.wait_for_metrics(lambda m: m["vllm:num_requests_running"] == 0)
