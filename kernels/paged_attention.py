"""Attention over a paged KV cache: decode (one query per sequence) and prefill (many, causal).

Both read keys and values through a block table: sequence i's token j lives in block
block_tables[i, j // block_size] at offset j % block_size. The references below are the CPU path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, kv_heads, head_dim]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention_decode_reference(
    query: torch.Tensor,  # [seqs, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [seqs] int32, keys to attend to, the query's own included
    scale: float,
) -> torch.Tensor:
    seqs, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(context_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long()
    keys = key_cache[tables].reshape(seqs, num_blocks * block_size, kv_heads, head_dim)[:, :max_len]
    values = value_cache[tables].reshape(seqs, num_blocks * block_size, kv_heads, head_dim)[:, :max_len]
    q = query.view(seqs, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).float() * scale  # [seqs, kv_heads, group, len]
    padding = torch.arange(max_len, device=query.device)[None, :] >= context_lens[:, None].long()
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [seqs, kv_heads, group, head_dim]
    return out.reshape(seqs, heads, head_dim).to(query.dtype)


def paged_attention_prefill_reference(
    query: torch.Tensor,  # [tokens, heads, head_dim], sequences back to back
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [seqs + 1] int32, offsets of each sequence's queries
    context_lens: torch.Tensor,  # [seqs] int32; a sequence's queries are its last positions
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lengths = context_lens.tolist()
    for i, length in enumerate(lengths):
        start, end = starts[i], starts[i + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        keys = _gather_context(key_cache, block_tables[i], length).transpose(0, 1)
        values = _gather_context(value_cache, block_tables[i], length).transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # [heads, queries, head_dim]
        if num_queries == length:
            mask, causal = None, True
        else:
            query_pos = torch.arange(length - num_queries, length, device=query.device)
            mask = torch.arange(length, device=query.device)[None, :] <= query_pos[:, None]
            causal = False
        attended = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[start:end] = attended.transpose(0, 1)
    return out
