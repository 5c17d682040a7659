"""Legacy completions through the official openai client: text, lists, token ids, echo, logprobs."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.server import MODEL

pytestmark = pytest.mark.real_model


def test_text_prompt_with_default_length(server, client):
    response = client.completions.create(
        model=MODEL, prompt="The sky is", temperature=0, extra_body={"ignore_eos": True}
    )
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 16  # the legacy API's default max_tokens
    assert response.usage.prompt_tokens == len(server.engine.tokenizer.encode("The sky is"))


def test_token_id_prompt_equals_its_text(server, client):
    ids = server.engine.tokenizer.encode("Once upon a time")
    as_text = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=8)
    as_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == len(ids)


def test_list_of_prompts_gives_n_choices_each_in_order(client):
    prompts = ["The sky is", "Water is"]
    singles = [
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=5).choices[0].text for p in prompts
    ]
    response = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5, n=2)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in response.choices] == [singles[0], singles[0], singles[1], singles[1]]


def test_echo_repeats_the_prompt(client):
    plain = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=5)
    echoed = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=5, echo=True)
    assert echoed.choices[0].text == "The sky is" + plain.choices[0].text


def test_stop_and_length_finish_reasons(client):
    plain = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12)
    text = plain.choices[0].text
    cut = text.index(",", 1)
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=",")
    assert stopped.choices[0].text == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    assert plain.choices[0].finish_reason == "length"


def test_logprobs_line_up_with_the_text(client):
    response = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6, logprobs=2
    )
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    offsets = [sum(len(token) for token in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob, abs=1e-5) and top[token] == logprob


def test_stream_with_usage_equals_the_whole_response(client):
    whole = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=8)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The sky is",
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_async_streams_of_several_prompts_are_merged(server):
    async def run():
        async with server.async_client() as aclient:
            stream = await aclient.completions.create(
                model=MODEL,
                prompt=["The sky is", "Water is"],
                max_tokens=4,
                temperature=0,
                echo=True,
                stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0].startswith("The sky is") and texts[1].startswith("Water is")
    assert chunks[-1].usage.completion_tokens == 8
