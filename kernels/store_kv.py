"""Write new keys and values into the paged KV cache at their slots (slot = block * block_size + offset)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels._triton import lazy_jit, next_power_of_2

if TYPE_CHECKING:
    import triton.language as tl


@lazy_jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    kv_heads,
    head_dim,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    # Slot -1 marks a padding token: nothing to store. (The reference is never given one.)
    heads_to_store = tl.where(slot >= 0, kv_heads, 0)
    mask = (heads < heads_to_store) & (dims < head_dim)
    cache_offsets = slot * kv_heads * head_dim + heads * head_dim + dims
    key = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    tokens, kv_heads, head_dim = key.shape
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_heads,
        head_dim,
        BLOCK_HEADS=next_power_of_2(kv_heads),
        BLOCK_DIM=next_power_of_2(head_dim),
    )


def store_kv_reference(
    key: torch.Tensor,  # [tokens, kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64
) -> None:
    block_size = key_cache.shape[1]
    # Indexing by (block, offset) rather than a flat view works whatever the cache's memory order.
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)
