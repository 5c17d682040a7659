"""Faster CPU paths for paged attention, for a cache stored heads-major.

The runner keeps the CPU cache as [kv_heads, blocks, block_size, head_dim] memory behind the usual
[blocks, block_size, kv_heads, head_dim] view. Whole blocks of one head are then contiguous, so one
gather yields [kv_heads * seqs, len, head_dim] keys that bmm reads directly; in the token-major layout
bmm has to copy strided keys again, which costs more than the matmul (measured: bench/engine_bench.py).
The references in paged_attention.py stay the definition; tests hold these to them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.huge_pages import zeroed_huge_page_buffer
from kernels.paged_attention import masked_attention, soft_cap


def is_heads_major(cache: torch.Tensor) -> bool:
    return cache.permute(2, 0, 1, 3).is_contiguous()


def heads_major_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype) -> torch.Tensor:
    """A zeroed cache in the usual [blocks, block_size, kv_heads, head_dim] view, stored heads-major, on huge pages
    that become resident as blocks are first written.

    A decode step reads each sequence's blocks (2-4 KB per head) from anywhere in the pool; on 4 KB pages nearly
    every block began with a TLB miss: on 2 MB pages the native decode attention at 64 sequences x 300 tokens
    (bfloat16, 30 layers, 2-core EPYC Zen 5) took 0.83-0.88x the time, the same bits."""
    shape = (kv_heads, num_blocks, block_size, head_dim)
    nbytes = math.prod(shape) * dtype.itemsize
    cache = zeroed_huge_page_buffer(nbytes).view(dtype).view(shape)
    return cache.permute(1, 2, 0, 3)


def paged_attention_decode_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    seqs, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    num_blocks = (int(context_lens.max()) + block_size - 1) // block_size
    padded_len = num_blocks * block_size
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    # a cache narrower than the query (bfloat16 under float32 activations) is widened as it is gathered
    keys = key_cache.permute(2, 0, 1, 3).index_select(1, blocks).view(kv_heads * seqs, padded_len, head_dim)
    values = value_cache.permute(2, 0, 1, 3).index_select(1, blocks).view(kv_heads * seqs, padded_len, head_dim)
    keys, values = keys.to(query.dtype), values.to(query.dtype)
    q = query.view(seqs, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads * seqs, group, head_dim)
    scores = soft_cap(torch.bmm(q, keys.transpose(1, 2)).float().mul_(scale), softcap)
    key_positions = torch.arange(padded_len)[None, :]
    padding = key_positions >= context_lens[:, None].long()  # [seqs, len]
    if window is not None:  # a sliding-window layer sees the last `window` keys, its own included
        padding |= key_positions <= context_lens[:, None].long() - 1 - window
    scores.view(kv_heads, seqs, group, padded_len).masked_fill_(padding[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.bmm(probs, values).view(kv_heads, seqs, group, head_dim)
    return out.transpose(0, 1).reshape(seqs, heads, head_dim).to(query.dtype)


def paged_attention_prefill_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    key_store, value_store = key_cache.permute(2, 0, 1, 3), value_cache.permute(2, 0, 1, 3)
    starts = query_start_loc.tolist()
    for i, length in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        blocks = block_tables[i, : (length + block_size - 1) // block_size].long()
        # [kv_heads, length, head_dim], widened to the query's type where the cache is narrower
        keys = key_store.index_select(1, blocks).flatten(1, 2)[:, :length].to(query.dtype)
        values = value_store.index_select(1, blocks).flatten(1, 2)[:, :length].to(query.dtype)
        # 4-D inputs: with 3-D ones SDPA on the CPU falls back to its math path (bmm, masks, softmax),
        # measured 2.5-3.5x slower at 512 tokens in bfloat16 and float32; 4-D takes the flash kernel,
        # which also handles the GQA groups without repeating the kv heads.
        if window is not None or softcap is not None:
            q_heads = query[start:end].transpose(0, 1)
            attended = masked_attention(q_heads, keys, values, length, scale, window, softcap)
            out[start:end] = attended.transpose(0, 1)
            continue
        q = query[start:end].transpose(0, 1)[None]
        mask = None
        if num_queries != length:
            query_pos = torch.arange(length - num_queries, length)
            mask = torch.arange(length)[None, :] <= query_pos[:, None]
        attended = F.scaled_dot_product_attention(
            q,
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=query.shape[1] != keys.shape[0],
        )[0]
        out[start:end] = attended.transpose(0, 1)
    return out
