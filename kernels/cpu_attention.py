"""Faster CPU paths for paged attention, for a cache stored heads-major.

The runner keeps the CPU cache as [kv_heads, blocks, block_size, head_dim] memory behind the usual
[blocks, block_size, kv_heads, head_dim] view. Whole blocks of one head are then contiguous, so one
gather yields [kv_heads * seqs, len, head_dim] keys that bmm reads directly; in the token-major layout
bmm has to copy strided keys again, which costs more than the matmul (measured: bench/engine_bench.py).
The references in paged_attention.py stay the definition; tests hold these to them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kernels.huge_pages import zeroed_huge_page_buffer
from kernels.paged_attention import masked_attention, soft_cap

FLOAT32_BYTES = 4
# A chunk's queries attend in pieces whose float scores (SDPA's float copy of the mask, or the spelled-out scores of a
# window or a soft cap) stay near this size. Whole, a full step's chunk of 2,048 queries over an 8,192-token context
# had SDPA copy a 64 MiB mask per layer, and Gemma 2's scores (8 heads) took 512 MiB, then as much again for the
# softmax: memory the registry's estimate must reserve for every model it loads. Each piece attends the keys up to
# its own last query, so a piece costs no more work than its rows did in the whole.
ATTENTION_PIECE_BYTES = 16 * 2**20


def attention_piece_peak_bytes(queries: int, heads: int, context: int) -> int:
    """The most one piece's temporaries take (the registry's estimate) for a chunk of `queries` over `context`
    positions: where a window or a soft cap spells the scores out, the scores, their softmax and its cast to the
    activations' type; SDPA's float mask and its bool source take less."""
    per_query = heads * context * FLOAT32_BYTES
    return 3 * min(queries, piece_rows(per_query)) * per_query


def piece_rows(bytes_per_query: int) -> int:
    return max(1, ATTENTION_PIECE_BYTES // bytes_per_query)


def query_pieces(first: int, num_queries: int, bytes_per_query: int) -> Iterator[tuple[int, int, int]]:
    """(a, b, seen) per piece of a chunk whose queries sit at positions first..first + num_queries - 1: the piece's
    queries a..b-1 of the chunk, and the keys it sees (later ones are masked for all of it)."""
    rows = piece_rows(bytes_per_query)
    for a in range(0, num_queries, rows):
        b = min(a + rows, num_queries)
        yield a, b, first + b


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
        first = length - num_queries  # the chunk's first position: its queries are the context's last
        if window is not None or softcap is not None:
            q_heads = query[start:end].transpose(0, 1)
            for a, b, seen in query_pieces(first, num_queries, q_heads.shape[0] * length * FLOAT32_BYTES):
                attended = masked_attention(
                    q_heads[:, a:b], keys[:, :seen], values[:, :seen], seen, scale, window, softcap
                )
                out[start + a : start + b] = attended.transpose(0, 1)
            continue
        # 4-D inputs: with 3-D ones SDPA on the CPU falls back to its math path (bmm, masks, softmax),
        # measured 2.5-3.5x slower at 512 tokens in bfloat16 and float32; 4-D takes the flash kernel,
        # which also handles the GQA groups without repeating the kv heads.
        q = query[start:end].transpose(0, 1)[None]
        gqa = query.shape[1] != keys.shape[0]
        if first == 0:  # a whole prompt: causal, no mask to copy
            attended = F.scaled_dot_product_attention(
                q, keys[None], values[None], is_causal=True, scale=scale, enable_gqa=gqa
            )[0]
            out[start:end] = attended.transpose(0, 1)
            continue
        for a, b, seen in query_pieces(first, num_queries, length * FLOAT32_BYTES):
            mask = torch.arange(seen)[None, :] <= torch.arange(first + a, seen)[:, None]
            attended = F.scaled_dot_product_attention(
                q[:, :, a:b],
                keys[None, :, :seen],
                values[None, :, :seen],
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )[0]
            out[start + a : start + b] = attended.transpose(0, 1)
    return out
