"""Each Triton kernel against its torch reference, on awkward shapes.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, float32 only (its bf16
arithmetic is broken) and small, since every program instance costs about half a millisecond.
"""

import math
import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Triton reads TRITON_INTERPRET when it is first imported; `kernels` imports it only at a launch.
    if sys.modules.get("triton") is not None and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1",
            allow_module_level=True,
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.paged_attention import (
    paged_attention_decode_reference,
    paged_attention_decode_triton,
    paged_attention_prefill_reference,
    paged_attention_prefill_triton,
)
from kernels.rms_norm import rms_norm_reference, rms_norm_triton
from kernels.rotary import rotary_embedding_reference, rotary_embedding_triton
from kernels.store_kv import store_kv_reference, store_kv_triton

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every float buffer a launcher allocates starts as NaN, so an element it never writes shows."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def paged_cache(context_lens, block_size, kv_heads, head_dim, dtype, spare_blocks=3):
    """Random caches and a block table with scattered blocks; unused table entries point at live
    blocks of other sequences, so reading one changes the answer."""
    needed = [math.ceil(length / block_size) for length in context_lens]
    num_blocks = sum(needed) + spare_blocks
    key_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    ids = torch.randperm(num_blocks)
    width = max(needed) + 2
    table = ids[torch.randint(0, num_blocks, (len(context_lens), width))]
    start = 0
    for seq, count in enumerate(needed):
        table[seq, :count] = ids[start : start + count]
        start += count
    return key_cache, value_cache, table.to(torch.int32).to(DEVICE)


# --- store_kv ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,head_dim,tokens", [(16, 1, 64, 1), (32, 3, 128, 19), (16, 2, 64, 40)])
def test_store_kv_writes_each_token_at_its_slot(dtype, block_size, kv_heads, head_dim, tokens):
    key_cache = randn(4, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = randn(4, block_size, kv_heads, head_dim, dtype=dtype)
    fused = randn(tokens, 3, kv_heads, head_dim, dtype=dtype)  # key and value are strided views
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(4 * block_size, device=DEVICE)[:tokens]
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    store_kv_reference(key, value, expected_keys, expected_values, slots)
    store_kv_triton(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)


def test_store_kv_skips_padding_slots():
    key_cache, value_cache = randn(2, 16, 2, 64), randn(2, 16, 2, 64)
    before = key_cache.clone()
    key, value = randn(3, 2, 64), randn(3, 2, 64)
    store_kv_triton(key, value, key_cache, value_cache, torch.tensor([5, -1, 20], device=DEVICE))
    written = (key_cache != before).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert written == [5, 20]


# --- paged attention --------------------------------------------------------------------------

DECODE_CASES = [  # block_size, kv_heads, group, head_dim, context_lens
    (16, 2, 1, 64, [1]),
    (16, 1, 3, 128, [5, 37, 16]),
    (32, 1, 8, 64, [33, 100]),
    (32, 2, 3, 128, [70]),
    (16, 1, 8, 128, [17, 1, 64, 45]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim,context_lens", DECODE_CASES)
def test_paged_attention_decode_matches_reference(dtype, block_size, kv_heads, group, head_dim, context_lens):
    key_cache, value_cache, table = paged_cache(context_lens, block_size, kv_heads, head_dim, dtype)
    query = randn(len(context_lens), kv_heads * group, head_dim, dtype=dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = paged_attention_decode_reference(query, key_cache, value_cache, table, lens, scale)
    actual = paged_attention_decode_triton(query, key_cache, value_cache, table, lens, scale)
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])


PREFILL_CASES = [  # block_size, kv_heads, group, head_dim, (context_len, new queries) per sequence
    (16, 2, 1, 64, [(37, 37)]),  # a whole prompt
    (32, 1, 3, 128, [(70, 20), (5, 5), (33, 1)]),  # chunks after a cached prefix, and a decode
    (16, 1, 8, 64, [(50, 40), (20, 0), (9, 3)]),  # a sequence with nothing new this step
    (32, 2, 8, 128, [(45, 45), (90, 7)]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim,sequences", PREFILL_CASES)
def test_paged_attention_prefill_matches_reference(dtype, block_size, kv_heads, group, head_dim, sequences):
    context_lens = [length for length, _ in sequences]
    key_cache, value_cache, table = paged_cache(context_lens, block_size, kv_heads, head_dim, dtype)
    new_tokens = [count for _, count in sequences]
    query = randn(sum(new_tokens), kv_heads * group, head_dim, dtype=dtype)
    query_start_loc = torch.tensor([0] + new_tokens, device=DEVICE).cumsum(0).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = paged_attention_prefill_reference(query, key_cache, value_cache, table, query_start_loc, lens, scale)
    actual = paged_attention_prefill_triton(query, key_cache, value_cache, table, query_start_loc, lens, scale)
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])


def test_paged_attention_prefill_of_one_token_is_decode():
    key_cache, value_cache, table = paged_cache([21, 40], 16, 2, 64, torch.float32)
    query = randn(2, 6, 64)
    lens = torch.tensor([21, 40], dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    prefill = paged_attention_prefill_triton(query, key_cache, value_cache, table, query_start_loc, lens, 0.125)
    decode = paged_attention_decode_triton(query, key_cache, value_cache, table, lens, 0.125)
    torch.testing.assert_close(prefill, decode, **TOLERANCE[torch.float32])


# --- rms_norm, rotary, silu_and_mul -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 781), (3, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, tokens, hidden, with_residual):
    x = randn(tokens, hidden, dtype=dtype)
    weight = randn(hidden, dtype=dtype)
    residual = randn(tokens, hidden, dtype=dtype) if with_residual else None
    expected_normed, expected_residual = rms_norm_reference(x, weight, 1e-6, residual)
    normed, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])
    torch.testing.assert_close(new_residual, expected_residual, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 4, 64), (9, 6, 2, 128), (5, 24, 3, 64)])
def test_rotary_embedding_matches_reference(dtype, tokens, heads, kv_heads, head_dim):
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)  # q and k are views of it
    query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    max_positions = 50
    cos_sin_cache = randn(max_positions, 2, head_dim)
    positions = torch.randint(0, max_positions, (tokens,), device=DEVICE)
    positions[0] = max_positions - 1
    expected_query, expected_key = rotary_embedding_reference(positions, query, key, cos_sin_cache)
    actual_query, actual_key = rotary_embedding_triton(positions, query, key, cos_sin_cache)
    torch.testing.assert_close(actual_query, expected_query, **TOLERANCE[dtype])
    torch.testing.assert_close(actual_key, expected_key, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,ffn", [(1, 64), (13, 781), (3, 1100)])
def test_silu_and_mul_matches_reference(dtype, tokens, ffn):
    x = randn(tokens, 2 * ffn, dtype=dtype)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x), **TOLERANCE[dtype])
