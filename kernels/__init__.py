"""The one door the engine uses into kernels: CUDA tensors go to Triton, CPU tensors to the references.

CPU caches stored heads-major get a faster CPU attention (kernels/cpu_attention.py).
`force_reference(True)` sends everything to the references (for checking the fast path). Tests run
the `*_triton` launchers directly on CPU tensors under `TRITON_INTERPRET=1`.
"""
from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON
from kernels.cpu_attention import is_heads_major, paged_attention_decode_cpu, paged_attention_prefill_cpu
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

_force_reference = False


def force_reference(enabled: bool) -> None:
    global _force_reference
    _force_reference = enabled


def _use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and HAS_TRITON and not _force_reference


def store_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    op = store_kv_triton if _use_triton(key) else store_kv_reference
    op(key, value, key_cache, value_cache, slot_mapping)


def _cpu_fast_path(cache: torch.Tensor) -> bool:
    return not cache.is_cuda and not _force_reference and is_heads_major(cache)


def paged_attention_decode(query, key_cache, value_cache, block_tables, context_lens, scale):
    if _use_triton(query):
        op = paged_attention_decode_triton
    elif _cpu_fast_path(key_cache):
        op = paged_attention_decode_cpu
    else:
        op = paged_attention_decode_reference
    return op(query, key_cache, value_cache, block_tables, context_lens, scale)


def paged_attention_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale):
    if _use_triton(query):
        op = paged_attention_prefill_triton
    elif _cpu_fast_path(key_cache):
        op = paged_attention_prefill_cpu
    else:
        op = paged_attention_prefill_reference
    return op(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale)


def rms_norm(x, weight, eps, residual=None):
    op = rms_norm_triton if _use_triton(x) else rms_norm_reference
    return op(x, weight, eps, residual)


def rotary_embedding(positions, query, key, cos_sin_cache):
    op = rotary_embedding_triton if _use_triton(query) else rotary_embedding_reference
    return op(positions, query, key, cos_sin_cache)


def silu_and_mul(x):
    op = silu_and_mul_triton if _use_triton(x) else silu_and_mul_reference
    return op(x)


__all__ = [
    "force_reference",
    "store_kv",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
