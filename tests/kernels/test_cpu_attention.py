"""The CPU fast paths of paged attention agree with the references, on awkward shapes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_attention
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


def test_a_kv_pool_takes_memory_only_as_its_blocks_are_written():
    """A server's 1 GiB pool was written with zeros at start-up: 1.6 s of a restart, and resident before any
    request. The kernel's fresh pages are zeros already; each 2 MB page becomes resident when first written."""

    def resident() -> int:
        return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024

    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc/self/status here")
    before = resident()
    cache = heads_major_cache(4096, 16, 8, 64, torch.float32)  # 128 MiB, 16 MiB per head
    assert resident() - before < 8 << 20
    cache[0] = 1.0  # block 0: a page in each head's 16 MiB
    assert 8 * 4096 <= resident() - before < 8 * HUGE_PAGE + (8 << 20)
    assert not cache[1:4].any() and not cache[-4:].any()


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


def naive_attention(query, keys, values, query_positions, scale, window, softcap):
    """Dense attention of one sequence spelled out: [queries, heads, dim] against [length, kv_heads, dim]."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, dim=1), values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    key_positions = torch.arange(keys.shape[0])
    visible = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (20, 3.0), (1, None)])
def test_window_and_soft_cap_match_dense_attention_in_every_path(window, softcap):
    g = torch.Generator().manual_seed(3)
    block_size, kv_heads, group, head_dim, num_blocks = 8, 2, 2, 16, 20
    keys_tm, keys_hm = filled_caches(num_blocks, block_size, kv_heads, head_dim, torch.float32, g)
    values_tm, values_hm = filled_caches(num_blocks, block_size, kv_heads, head_dim, torch.float32, g)
    lengths = torch.tensor([7, 40, 33], dtype=torch.int32)
    counts = [7, 9, 1]
    starts = torch.tensor([0, 7, 16, 17], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[:15].view(3, 5).int()
    query = torch.randn(sum(counts), kv_heads * group, head_dim, generator=g)
    scale = 0.3
    expected = []
    for i, length in enumerate(lengths.tolist()):
        slots = [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(length)]
        keys = keys_tm.flatten(0, 1)[slots]
        values = values_tm.flatten(0, 1)[slots]
        positions = torch.arange(length - counts[i], length)
        expected.append(
            naive_attention(query[starts[i] : starts[i + 1]], keys, values, positions, scale, window, softcap)
        )
    dense = torch.cat(expected)
    args = (tables, starts, lengths, scale, window, softcap)
    for got in (
        paged_attention_prefill_reference(query, keys_tm, values_tm, *args),
        paged_attention_prefill_cpu(query, keys_hm, values_hm, *args),
    ):
        torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    last_rows = starts[1:] - 1  # each sequence's last query, as a decode step would ask it
    for decode in (paged_attention_decode_reference, paged_attention_decode_cpu):
        cache = (keys_tm, values_tm) if decode is paged_attention_decode_reference else (keys_hm, values_hm)
        got = decode(query[last_rows.long()], *cache, tables, lengths, scale, window, softcap)
        torch.testing.assert_close(got, dense[last_rows.long()], atol=1e-5, rtol=1e-5)


PREFILL_PEAK_SCRIPT = """
import re, sys
from pathlib import Path
import torch
from kernels.cpu_attention import heads_major_cache, paged_attention_prefill_cpu

def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text())[1]) * 1024

softcap = float(sys.argv[1]) if sys.argv[1] != "none" else None
torch.set_num_threads(1)
block_size, kv_heads, group, head_dim, context, queries = 16, 4, 2, 64, 8192, 2048
blocks = context // block_size
keys = heads_major_cache(blocks, block_size, kv_heads, head_dim, torch.float32)
values = heads_major_cache(blocks, block_size, kv_heads, head_dim, torch.float32)
keys.normal_(), values.normal_()
query = torch.randn(queries, kv_heads * group, head_dim)
args = (torch.arange(blocks, dtype=torch.int32)[None], torch.tensor([0, queries], dtype=torch.int32),
        torch.tensor([context], dtype=torch.int32), 0.125, None, softcap)
paged_attention_prefill_cpu(query[:16], keys, values, args[0], torch.tensor([0, 16], dtype=torch.int32),
                            *args[2:])  # warm-up: what the first call allocates once
before = peak()
out = paged_attention_prefill_cpu(query, keys, values, *args)
print(peak() - before)
"""


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_long_contexts_last_chunk_attends_without_a_mask_or_scores_of_its_size(softcap):
    """The last 2,048-token chunk of an 8,192-token prompt: SDPA copied its causal mask to float (64 MiB a layer
    here) and a soft-capped model's spelled-out scores came to 512 MiB, twice over, on top of what the registry
    counts for a full step; in pieces of the chunk's queries the step's peak stays a few tens of MiB."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc/self/status here")
    done = subprocess.run(
        [sys.executable, "-c", PREFILL_PEAK_SCRIPT, "none" if softcap is None else str(softcap)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    grown = int(done.stdout.split()[-1])
    # the keys and values widened (8 MiB each), the output (4 MiB) and one piece's temporaries (16-48 MiB)
    assert grown < 56 << 20, f"peak grew {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 2.0)])
def test_a_chunk_attended_in_many_pieces_matches_the_reference(monkeypatch, window, softcap):
    """Pieces of a few queries each (the piece size shrunk to 1 KiB), each seeing the keys up to its own last
    query: the same attention as the reference's whole chunk, for a cached prefix, a whole prompt and one query."""
    monkeypatch.setattr(cpu_attention, "ATTENTION_PIECE_BYTES", 1024)
    g = torch.Generator().manual_seed(5)
    block_size, kv_heads, group, head_dim, num_blocks = 8, 2, 2, 16, 24
    keys_tm, keys_hm = filled_caches(num_blocks, block_size, kv_heads, head_dim, torch.float32, g)
    values_tm, values_hm = filled_caches(num_blocks, block_size, kv_heads, head_dim, torch.float32, g)
    lengths = torch.tensor([60, 37, 45], dtype=torch.int32)  # queries: the last 23 of 60, all 37, the last 1 of 45
    starts = torch.tensor([0, 23, 60, 61], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[:24].view(3, 8).int()
    query = torch.randn(61, kv_heads * group, head_dim, generator=g)
    args = (tables, starts, lengths, 0.3, window, softcap)
    expected = paged_attention_prefill_reference(query, keys_tm, values_tm, *args)
    got = paged_attention_prefill_cpu(query, keys_hm, values_hm, *args)
    assert cpu_attention.piece_rows(kv_heads * group * 60 * 4) < 23  # the first chunk went in several pieces
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
