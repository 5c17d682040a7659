"""Write new keys and values into the paged KV cache at their slots (slot = block * block_size + offset)."""
from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor,  # [tokens, kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64
) -> None:
    kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))
