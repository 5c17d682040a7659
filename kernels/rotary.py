"""Rotary position embedding, neox style (rotate halves), from a precomputed cos/sin table."""
from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def rotary_embedding_reference(
    positions: torch.Tensor,  # [tokens] int64
    query: torch.Tensor,  # [tokens, heads, head_dim]
    key: torch.Tensor,  # [tokens, kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, 2, head_dim]: cos then sin, halves duplicated
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache[positions]
    cos = cos_sin[:, 0, None, :].to(query.dtype)
    sin = cos_sin[:, 1, None, :].to(query.dtype)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)
