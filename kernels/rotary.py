"""Rotary position embedding, neox style (rotate halves), from a precomputed cos/sin table."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels._triton import lazy_jit, next_power_of_2

if TYPE_CHECKING:
    import triton.language as tl


@lazy_jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    positions_ptr,
    cos_sin_ptr,
    x_token_stride,
    x_head_stride,
    cos_sin_position_stride,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    # Like the reference, cos and sin are rounded to the activation dtype before use.
    dtype = x_ptr.dtype.element_ty
    row = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * cos_sin_position_stride
    half_mask = dims < HALF
    cos_first = tl.load(row + dims, mask=half_mask).to(dtype).to(tl.float32)
    cos_second = tl.load(row + HALF + dims, mask=half_mask).to(dtype).to(tl.float32)
    sin_first = tl.load(row + 2 * HALF + dims, mask=half_mask).to(dtype).to(tl.float32)
    sin_second = tl.load(row + 3 * HALF + dims, mask=half_mask).to(dtype).to(tl.float32)

    x = x_ptr + token * x_token_stride + heads * x_head_stride + dims
    first = tl.load(x, mask=mask).to(tl.float32)
    second = tl.load(x + HALF, mask=mask).to(tl.float32)
    out = out_ptr + token * num_heads * 2 * HALF + heads * 2 * HALF + dims
    tl.store(out, (first * cos_first - second * sin_first).to(dtype), mask=mask)
    tl.store(out + HALF, (second * cos_second + first * sin_second).to(dtype), mask=mask)


def _rotate_triton(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    _rotary_kernel[(tokens,)](
        x,
        out,
        positions,
        cos_sin_cache,
        x.stride(0),
        x.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        HALF=head_dim // 2,
        BLOCK_HEADS=next_power_of_2(num_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
    )
    return out


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin_cache = cos_sin_cache.contiguous()
    return _rotate_triton(positions, query, cos_sin_cache), _rotate_triton(positions, key, cos_sin_cache)


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
