"""Rotary embedding tables, computed exactly as transformers computes them: one per rope a model's layers use
(Gemma 3's local layers have their own base)."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.shape import DecoderShape, UnsupportedModel


def rope_cos_sin_cache(config: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> torch.Tensor:
    """[max_positions, 2, rotary dims] cos and sin. `head_dim`: the dims rope rotates (with a partial rotary
    factor, the leading int(head_dim * factor) of each head; transformers' tables cover those alone too).
    `layer_type`: the entry of a per-layer-type rope_parameters."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        rope = dict(rope[layer_type])
    rope_type = rope.get("rope_type", "default")
    positions = torch.arange(max_positions, dtype=torch.float)
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return _table(positions[:, None] * inv_freq[None, :], 1.0)
    if rope_type in ("linear", "llama3", "yarn"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
        return _table(positions[:, None] * inv_freq[None, :], scaling)
    if rope_type == "longrope":
        # Phi-3's LongRoPE: short factors up to original_max_position_embeddings, long ones beyond. Per position
        # (as vLLM does); transformers switches a whole sequence to the long factors once it passes the original
        # length, so the two differ only for sequences longer than that.
        original = rope.get("original_max_position_embeddings") or config.original_max_position_embeddings
        short, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
        long, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=original + 1, layer_type=layer_type)
        inv_freq = torch.where((positions < original)[:, None], short[None, :], long[None, :])
        return _table(positions[:, None] * inv_freq, scaling)
    raise UnsupportedModel(f"rope type {rope_type!r} is not supported")


def _table(freqs: torch.Tensor, scaling: float) -> torch.Tensor:
    angles = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((angles.cos() * scaling, angles.sin() * scaling), dim=1)


def rope_tables(config: Any, shape: DecoderShape, max_positions: int | None = None) -> dict[str, torch.Tensor]:
    """The tables a model's layers use, by the names in `shape.layer_rope`."""
    positions = max_positions or shape.max_position_embeddings
    names = set(shape.layer_rope) or {"default"}
    return {
        name: rope_cos_sin_cache(config, shape.rotary_dims, positions, None if name == "default" else name)
        for name in names
    }
