"""The CPU fast paths of paged attention agree with the references, on awkward shapes."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_attention import heads_major_cache, paged_attention_decode_cpu, paged_attention_prefill_cpu
from kernels.huge_pages import HUGE_PAGE
from kernels.paged_attention import paged_attention_decode_reference, paged_attention_prefill_reference
from kernels.store_kv import store_kv_reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (activations, KV cache): the matching pairs, and bfloat16 caches under float32 activations (packed weights)
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


def filled_caches(num_blocks, block_size, kv_heads, head_dim, dtype, generator):
    token_major = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    heads_major = heads_major_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    heads_major.copy_(token_major)
    return token_major, heads_major


@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim", [(16, 3, 3, 64), (32, 1, 8, 128), (16, 8, 1, 64)])
def test_decode_matches_reference(dtype, cache_dtype, block_size, kv_heads, group, head_dim):
    g = torch.Generator().manual_seed(block_size * kv_heads + group)
    num_blocks = 40
    keys_tm, keys_hm = filled_caches(num_blocks, block_size, kv_heads, head_dim, cache_dtype, g)
    values_tm, values_hm = filled_caches(num_blocks, block_size, kv_heads, head_dim, cache_dtype, g)
    lengths = torch.tensor([1, block_size, block_size + 3, 5 * block_size - 1], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[:24].view(4, 6).int()
    query = torch.randn(4, kv_heads * group, head_dim, generator=g).to(dtype)
    expected = paged_attention_decode_reference(query, keys_tm, values_tm, tables, lengths, head_dim**-0.5)
    got = paged_attention_decode_cpu(query, keys_hm, values_hm, tables, lengths, head_dim**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
def test_prefill_with_cached_prefix_matches_reference(dtype, cache_dtype):
    g = torch.Generator().manual_seed(1)
    block_size, kv_heads, group, head_dim, num_blocks = 16, 3, 3, 64, 30
    keys_tm, keys_hm = filled_caches(num_blocks, block_size, kv_heads, head_dim, cache_dtype, g)
    values_tm, values_hm = filled_caches(num_blocks, block_size, kv_heads, head_dim, cache_dtype, g)
    lengths = torch.tensor([7, 40, 33], dtype=torch.int32)  # queries: all 7, last 9 of 40, last 1 of 33
    counts = [7, 9, 1]
    starts = torch.tensor([0, 7, 16, 17], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[:9].view(3, 3).int()
    query = torch.randn(sum(counts), kv_heads * group, head_dim, generator=g).to(dtype)
    expected = paged_attention_prefill_reference(query, keys_tm, values_tm, tables, starts, lengths, 0.125)
    got = paged_attention_prefill_cpu(query, keys_hm, values_hm, tables, starts, lengths, 0.125)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_big_heads_major_cache_starts_zeroed_on_a_huge_page_boundary():
    """The decode attention reads each sequence's blocks from anywhere in the pool: on 2 MB pages (advised at
    allocation) it no longer pays a TLB walk per block. The pool still starts as zeros."""
    cache = heads_major_cache(600, 16, 3, 64, torch.bfloat16)  # 3.5 MB
    assert cache.shape == (600, 16, 3, 64) and cache.dtype == torch.bfloat16
    assert cache.data_ptr() % HUGE_PAGE == 0
    assert not cache.any()


def test_store_kv_writes_the_same_slots_in_either_layout():
    g = torch.Generator().manual_seed(2)
    token_major = torch.full((6, 16, 3, 64), float("nan"))
    heads_major = heads_major_cache(6, 16, 3, 64, torch.float32).fill_(float("nan"))
    key, value = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    slots = torch.tensor([0, 17, 18, 95, 40])
    store_kv_reference(key, value, token_major, token_major.clone(), slots)
    store_kv_reference(key, value, heads_major, heads_major.clone(), slots)
    torch.testing.assert_close(heads_major, token_major, equal_nan=True)
    assert torch.equal(token_major.view(-1, 3, 64)[slots], key)
