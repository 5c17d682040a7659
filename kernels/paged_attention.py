"""Attention over a paged KV cache: decode (one query per sequence) and prefill (many, causal).

Both read keys and values through a block table: sequence i's token j lives in block
block_tables[i, j // block_size] at offset j % block_size. The torch references below define the result
(the Triton kernels and kernels/cpu_attention.py are tested against them); on CPU, kernels/__init__.py
runs them only for a cache that is not stored heads-major.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels._triton import lazy_jit, next_power_of_2

if TYPE_CHECKING:
    import triton.language as tl

DECODE_BLOCK_N = 64  # keys per tile; a tile may span several cache blocks
PREFILL_BLOCK_M = 32  # queries per program
PREFILL_BLOCK_N = 32


@lazy_jit
def _decode_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    query_seq_stride,
    query_head_stride,
    block_table_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    num_heads,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (sequence, kv head): the whole query group shares each key and value tile.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_GROUP)
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims[None, :] < head_dim
    heads = kv_head * group + rows
    q_mask = (rows[:, None] < group) & dim_mask
    q = tl.load(
        query_ptr + seq * query_seq_stride + heads[:, None] * query_head_stride + dims[None, :], mask=q_mask, other=0.0
    )

    running_max = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_GROUP], tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], tl.float32)
    for start in range(0, context_len, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < context_len
        blocks = tl.load(block_tables_ptr + seq * block_table_stride + positions // BLOCK_SIZE, mask=valid, other=0)
        slots = blocks.to(tl.int64) * cache_block_stride + (positions % BLOCK_SIZE) * cache_slot_stride
        kv_offsets = slots[:, None] + kv_head * cache_head_stride + dims[None, :]
        kv_mask = valid[:, None] & dim_mask
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max

    out = acc / running_sum[:, None]
    out_offsets = (seq * num_heads + heads[:, None]) * head_dim + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@lazy_jit
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    query_token_stride,
    query_head_stride,
    block_table_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    num_heads,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (query tile, sequence, head). A sequence's queries are its last positions, so
    # query row r sits at position prefix + r and attends to every key at or before it.
    query_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_tile * BLOCK_M >= num_queries:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - num_queries
    kv_head = head // group

    rows = query_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < num_queries
    query_positions = prefix + rows
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims[None, :] < head_dim
    q_mask = row_valid[:, None] & dim_mask
    tokens = query_start + rows
    q = tl.load(
        query_ptr + tokens[:, None] * query_token_stride + head * query_head_stride + dims[None, :],
        mask=q_mask,
        other=0.0,
    )

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DIM], tl.float32)
    keys_needed = prefix + tl.minimum((query_tile + 1) * BLOCK_M, num_queries)  # causal: up to the last row
    for start in range(0, keys_needed, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < keys_needed
        blocks = tl.load(block_tables_ptr + seq * block_table_stride + positions // BLOCK_SIZE, mask=valid, other=0)
        slots = blocks.to(tl.int64) * cache_block_stride + (positions % BLOCK_SIZE) * cache_slot_stride
        kv_offsets = slots[:, None] + kv_head * cache_head_stride + dims[None, :]
        kv_mask = valid[:, None] & dim_mask
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = valid[None, :] & (positions[None, :] <= query_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max

    out = acc / running_sum[:, None]
    out_offsets = tokens[:, None] * (num_heads * head_dim) + head * head_dim + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # Full fp32 products for fp32 inputs, so fp32 agrees with the reference; tf32 is the default.
    return "ieee" if dtype == torch.float32 else "tf32"


def _cache_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int]:
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.stride(-1) == 1
    return key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)


def paged_attention_decode_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    seqs, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if seqs == 0:
        return out
    _decode_kernel[(seqs, kv_heads)](
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        *_cache_strides(key_cache, value_cache),
        heads,
        group,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_GROUP=max(16, next_power_of_2(group)),
        BLOCK_DIM=max(16, next_power_of_2(head_dim)),
        BLOCK_N=DECODE_BLOCK_N,
        DOT_PRECISION=_dot_precision(query.dtype),
    )
    return out


def paged_attention_prefill_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    tokens, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    seqs = context_lens.shape[0]
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if tokens == 0 or seqs == 0:
        return out
    # One host sync sizes the grid to the longest sequence; the reference syncs too.
    max_queries = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = ((max_queries + PREFILL_BLOCK_M - 1) // PREFILL_BLOCK_M, seqs, heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        *_cache_strides(key_cache, value_cache),
        heads,
        heads // kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_DIM=max(16, next_power_of_2(head_dim)),
        BLOCK_N=PREFILL_BLOCK_N,
        DOT_PRECISION=_dot_precision(query.dtype),
    )
    return out


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, kv_heads, head_dim]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping, cap * tanh(scores / cap), in place; None leaves scores as they are."""
    if cap is None:
        return scores
    return scores.div_(cap).tanh_().mul_(cap)


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] True where a query sees a key: causal, and within the last `window` positions (the query's
    own included, as transformers' sliding_window_overlay: key > query - window) when there is a window."""
    visible = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - window
    return visible


def paged_attention_decode_reference(
    query: torch.Tensor,  # [seqs, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [seqs] int32, keys to attend to, the query's own included
    scale: float,
    window: int | None = None,  # attend to the last `window` keys only (sliding-window layers)
    softcap: float | None = None,  # cap * tanh(scores / cap) before the softmax
) -> torch.Tensor:
    seqs, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    num_blocks = (int(context_lens.max()) + block_size - 1) // block_size
    padded_len = num_blocks * block_size
    # Whole blocks are gathered (large rows copy fastest on the CPU); the tail is masked instead of cut.
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    # A cache narrower than the query (bfloat16 under float32 activations) is widened as it is gathered.
    keys = key_cache.index_select(0, blocks).view(seqs, padded_len, kv_heads, head_dim).to(query.dtype)
    values = value_cache.index_select(0, blocks).view(seqs, padded_len, kv_heads, head_dim).to(query.dtype)
    key_positions = torch.arange(padded_len, device=query.device)[None, None, :]
    padding = key_positions >= context_lens[:, None, None].long()
    if window is not None:
        padding |= key_positions <= context_lens[:, None, None].long() - 1 - window
    q = query.view(seqs, kv_heads, group, head_dim)
    out = torch.empty(seqs, kv_heads, group, head_dim, dtype=query.dtype, device=query.device)
    # One kv head at a time: its keys are a strided view that bmm reads without another copy.
    for head in range(kv_heads):
        scores = soft_cap(torch.bmm(q[:, head], keys[:, :, head].transpose(1, 2)).float().mul_(scale), softcap)
        scores.masked_fill_(padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out[:, head] = torch.bmm(probs, values[:, :, head]).to(query.dtype)
    return out.view(seqs, heads, head_dim)


def paged_attention_prefill_reference(
    query: torch.Tensor,  # [tokens, heads, head_dim], sequences back to back
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [seqs + 1] int32, offsets of each sequence's queries
    context_lens: torch.Tensor,  # [seqs] int32; a sequence's queries are its last positions
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
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
        if window is not None or softcap is not None:
            out[start:end] = masked_attention(q, keys, values, length, scale, window, softcap).transpose(0, 1)
            continue
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


def masked_attention(
    q: torch.Tensor,  # [heads, queries, head_dim]: a sequence's last positions
    keys: torch.Tensor,  # [kv_heads, length, head_dim]
    values: torch.Tensor,
    length: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Prefill attention spelled out (scores, cap, mask, softmax): SDPA has no soft-capping. [heads, queries, dim]"""
    heads, num_queries, head_dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    grouped = q.reshape(kv_heads, group * num_queries, head_dim)
    scores = torch.bmm(grouped, keys.to(q.dtype).transpose(1, 2)).float().mul_(scale)
    scores = soft_cap(scores, softcap).view(kv_heads, group, num_queries, length)
    query_positions = torch.arange(length - num_queries, length, device=q.device)
    visible = window_mask(query_positions, torch.arange(length, device=q.device), window)
    scores.masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kv_heads, group * num_queries, length)
    return torch.bmm(probs, values.to(q.dtype)).view(heads, num_queries, head_dim)
