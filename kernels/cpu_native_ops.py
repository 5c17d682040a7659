"""torch-facing wrappers of the native CPU kernels (kernels/csrc), same contracts as the references.

The `*_available(...)` functions say whether a call can take the native path (a built library, float32 or bfloat16,
contiguous rows where the kernel needs them); kernels/__init__.py asks before dispatching here.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from kernels.cpu_native import library

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# (activations, KV cache) element types of the attention kernels beyond the matching pairs: bfloat16 caches
# under float32 activations (packed weights on the CPU, EngineConfig.kv_torch_dtype)
_KV_SUFFIX = {(torch.float32, torch.bfloat16): "f32_bf16kv"}
_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    ("paged_decode_cpu", "tokenmill_paged_decode"): [_P] * 6 + [_I64] * 8 + [_F, _I],
    ("elementwise_cpu", "tokenmill_rms_norm"): [_P] * 5 + [_I64, _I64, _F, _I],
    ("elementwise_cpu", "tokenmill_rotary"): [_P, _I64, _P, _P, _I64, _I64, _I64, _I],
    ("elementwise_cpu", "tokenmill_silu_and_mul"): [_P, _P, _I64, _I64, _I],
    ("elementwise_cpu", "tokenmill_store_kv"): [_P, _P, _I64, _I64, _P, _P, _P] + [_I64] * 5,
}
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # paged_decode_cpu.cpp's stack buffers


def kernel_suffix(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> str | None:
    """The exported name's suffix for activations of `dtype` (and a KV cache of `cache_dtype`), or None."""
    if cache_dtype is None or cache_dtype == dtype:
        return _SUFFIX.get(dtype)
    return _KV_SUFFIX.get((dtype, cache_dtype))


@cache
def _function(library_name: str, name: str, dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    native = library(library_name)
    if native is None:
        return None
    function = getattr(native, f"{name}_{kernel_suffix(dtype, cache_dtype)}")
    function.restype = None
    function.argtypes = _SIGNATURES[(library_name, name)]
    return function


def _ready(library_name: str, name: str, *tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX or any(t.dtype != dtype or t.is_cuda for t in tensors):
        return False
    return _function(library_name, name, dtype) is not None


def _attention_ready(name: str, library_name: str, activations: torch.Tensor, *caches: torch.Tensor) -> bool:
    """Activations of one type and caches of one type, a pair the kernel is built for."""
    dtype, cache_dtype = activations.dtype, caches[0].dtype
    if any(t.is_cuda for t in (activations, *caches)) or any(c.dtype != cache_dtype for c in caches):
        return False
    return (
        kernel_suffix(dtype, cache_dtype) is not None and _function(library_name, name, dtype, cache_dtype) is not None
    )


def _threads() -> int:
    return torch.get_num_threads()


# ---- paged attention decode ------------------------------------------------------------------------
def decode_available(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    heads, head_dim, kv_heads = query.shape[1], query.shape[2], key_cache.shape[2]
    shape_ok = heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
    return shape_ok and _attention_ready("tokenmill_paged_decode", "paged_decode_cpu", query, key_cache)


def paged_attention_decode_native(query, key_cache, value_cache, block_tables, context_lens, scale):
    """The caches must be heads-major (kernels.cpu_attention.heads_major_cache)."""
    seqs, heads, head_dim = query.shape
    pool_blocks, block_size, kv_heads = key_cache.shape[0], key_cache.shape[1], key_cache.shape[2]
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()  # rows at any stride are read in place (views into the fused qkv output)
    tables = block_tables.to(torch.int32).contiguous()
    lengths = context_lens.to(torch.int32).contiguous()
    out = torch.empty(seqs, heads, head_dim, dtype=query.dtype)
    _function("paged_decode_cpu", "tokenmill_paged_decode", query.dtype, key_cache.dtype)(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        tables.data_ptr(),
        lengths.data_ptr(),
        out.data_ptr(),
        seqs,
        heads,
        kv_heads,
        head_dim,
        block_size,
        pool_blocks,
        tables.shape[1],
        query.stride(0),
        scale,
        _threads(),
    )
    return out


# ---- RMSNorm ---------------------------------------------------------------------------------------
def rms_norm_available(x, weight, residual=None) -> bool:
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return x.dim() == 2 and _ready("elementwise_cpu", "tokenmill_rms_norm", *tensors)


def rms_norm_native(x, weight, eps, residual=None):
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        residual_address, new_residual = None, x
    else:
        residual = residual.contiguous()
        residual_address, new_residual = residual.data_ptr(), torch.empty_like(x)
    _function("elementwise_cpu", "tokenmill_rms_norm", x.dtype)(
        x.data_ptr(),
        residual_address,
        weight.data_ptr(),
        out.data_ptr(),
        new_residual.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        _threads(),
    )
    return out, new_residual


# ---- rotary embedding (in place) ---------------------------------------------------------------------
def rotary_available(query, key, cos_sin_cache) -> bool:
    def rows_ok(t):  # heads packed in each row, rows at any stride (views into the fused qkv output)
        return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]

    return (
        rows_ok(query)
        and rows_ok(key)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and _ready("elementwise_cpu", "tokenmill_rotary", query, key)
    )


def rotary_embedding_native(positions, query, key, cos_sin_cache):
    """Rotates query and key in place and returns them."""
    positions = positions.to(torch.int64).contiguous()
    rotate = _function("elementwise_cpu", "tokenmill_rotary", query.dtype)
    for x in (query, key):
        rotate(
            x.data_ptr(),
            x.stride(0),
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            x.shape[0],
            x.shape[1],
            x.shape[2],
            _threads(),
        )
    return query, key


# ---- SiLU and mul ------------------------------------------------------------------------------------
def silu_and_mul_available(x) -> bool:
    return x.dim() == 2 and _ready("elementwise_cpu", "tokenmill_silu_and_mul", x)


def silu_and_mul_native(x):
    x = x.contiguous()
    ffn = x.shape[1] // 2
    out = torch.empty(x.shape[0], ffn, dtype=x.dtype)
    _function("elementwise_cpu", "tokenmill_silu_and_mul", x.dtype)(
        x.data_ptr(), out.data_ptr(), x.shape[0], ffn, _threads()
    )
    return out


# ---- KV store into a heads-major pool ----------------------------------------------------------------
def store_kv_available(key, value, key_cache) -> bool:
    def rows_ok(t):
        return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]

    return (
        rows_ok(key)
        and rows_ok(value)
        and key.dtype == value.dtype
        and _attention_ready("tokenmill_store_kv", "elementwise_cpu", key, key_cache)
    )


def store_kv_native(key, value, key_cache, value_cache, slot_mapping) -> None:
    slots = slot_mapping.to(torch.int64).contiguous()
    pool_blocks, block_size, kv_heads, head_dim = key_cache.shape
    _function("elementwise_cpu", "tokenmill_store_kv", key.dtype, key_cache.dtype)(
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        value.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        kv_heads,
        head_dim,
        pool_blocks,
        block_size,
    )
