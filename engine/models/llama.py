"""The names the engine has always imported for its Llama-family decoder; the decoder itself now runs every
family from data (engine/models/decoder.py, engine/models/shape.py)."""

from __future__ import annotations

from engine.models.decoder import AttentionMetadata, DecoderForCausalLM, DecoderLayer
from engine.models.rope import rope_cos_sin_cache
from engine.models.shape import SUPPORTED_ARCHITECTURES, DecoderShape, UnsupportedModel

LlamaShape = DecoderShape
LlamaLayer = DecoderLayer
LlamaForCausalLM = DecoderForCausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LlamaLayer",
    "LlamaShape",
    "UnsupportedModel",
    "rope_cos_sin_cache",
]
