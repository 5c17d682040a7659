"""The README's first request, as a new user sends it: no sampling field at all, to a server that loads the
embedded model as `tokenmill serve` does (quantization auto) with its default limits. It must answer
"Paris" and stop on its own, not run on to the end of the context (bench/defaults_bench.py measured why
the embedded model's defaults are what they are). A client's own max_tokens still wins over the default."""

from __future__ import annotations

import pytest

from app.registry.sampling_defaults import EMBEDDED_CHAT_DEFAULTS
from engine.config import EngineConfig
from engine.loader import load_model
from tests.support import MODEL_CACHE
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

README_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TRIES = 10
RUNAWAY_TOKENS = 300  # "a few hundred tokens": the old defaults ran on to 4,096


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(quantization="auto", data_dir=str(MODEL_CACHE), num_kv_blocks=256)
    with running_server(load_model(config), engine_config=config) as running:
        yield running


def test_the_readme_question_is_answered_with_paris_and_never_runs_away(server):
    client = server.client()
    answers = [client.chat.completions.create(model=MODEL, messages=README_QUESTION) for _ in range(TRIES)]
    texts = [answer.choices[0].message.content or "" for answer in answers]
    lengths = [answer.usage.completion_tokens for answer in answers]
    assert sum("Paris" in text for text in texts) >= TRIES - 1, texts
    assert max(lengths) <= RUNAWAY_TOKENS, (lengths, texts)


def test_a_clients_max_tokens_still_wins_over_the_default(server):
    longer = EMBEDDED_CHAT_DEFAULTS["max_tokens"] + 44
    answer = server.client().chat.completions.create(
        model=MODEL, messages=README_QUESTION, max_tokens=longer, extra_body={"ignore_eos": True}
    )
    assert answer.usage.completion_tokens == longer
    assert answer.choices[0].finish_reason == "length"


def test_a_legacy_completion_still_stops_at_16_tokens(server):
    answer = server.client().completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16
