"""The one door the engine uses into kernels: CUDA tensors go to Triton, CPU tensors to native code.

On the CPU: the native kernels of kernels/csrc where a C++ compiler is at hand (kernels/cpu_native.py),
and for caches stored heads-major the faster torch attention of kernels/cpu_attention.py when not;
otherwise the torch references. `force_reference(True)` sends everything to the references and
`use_native_cpu(False)` skips the native kernels (both for checking the fast paths). Tests run the
`*_triton` launchers directly on CPU tensors under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import torch

from kernels import cpu_native_ops as native
from kernels import decode_stack, sampling
from kernels._triton import HAS_TRITON
from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.cpu_attention import is_heads_major, paged_attention_decode_cpu, paged_attention_prefill_cpu
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
_native_cpu = True


def force_reference(enabled: bool) -> None:
    global _force_reference
    _force_reference = enabled


def use_native_cpu(enabled: bool) -> None:
    global _native_cpu
    _native_cpu = enabled


def native_cpu_enabled() -> bool:
    """Whether CPU tensors may take the native kernels (neither switched off nor forced to the reference)."""
    return _native_cpu and not _force_reference


def _use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and HAS_TRITON and not _force_reference


def _use_native(tensor: torch.Tensor) -> bool:
    return not tensor.is_cuda and native_cpu_enabled()


def _cpu_fast_path(cache: torch.Tensor) -> bool:
    return not cache.is_cuda and not _force_reference and is_heads_major(cache)


def store_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    if _use_triton(key):
        op = store_kv_triton
    elif _use_native(key) and is_heads_major(key_cache) and native.store_kv_available(key, value, key_cache):
        op = native.store_kv_native
    else:
        op = store_kv_reference
    op(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`window`: a sliding-window layer's span (the last `window` keys); `softcap`: Gemma 2's logit cap. The
    Triton and native kernels take neither yet: such layers run the torch paths (heads-major, else reference)."""
    if window is not None or softcap is not None:
        if _cpu_fast_path(key_cache):
            return paged_attention_decode_cpu(
                query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap
            )
        return paged_attention_decode_reference(
            query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap
        )
    if _use_triton(query):
        op = paged_attention_decode_triton
    elif _cpu_fast_path(key_cache):
        use_native = _native_cpu and native.decode_available(query, key_cache)
        op = native.paged_attention_decode_native if use_native else paged_attention_decode_cpu
    else:
        op = paged_attention_decode_reference
    return op(query, key_cache, value_cache, block_tables, context_lens, scale)


def paged_attention_prefill(
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
    args = (query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale)
    if window is not None or softcap is not None:
        if _cpu_fast_path(key_cache):
            return paged_attention_prefill_cpu(*args, window, softcap)
        return paged_attention_prefill_reference(*args, window, softcap)
    if _use_triton(query):
        op = paged_attention_prefill_triton
    elif _cpu_fast_path(key_cache):
        op = paged_attention_prefill_cpu
    else:
        op = paged_attention_prefill_reference
    return op(*args)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        op = rms_norm_triton
    elif _use_native(x) and native.rms_norm_available(x, weight, residual):
        op = native.rms_norm_native
    else:
        op = rms_norm_reference
    return op(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the rotated (query, key); the native CPU path rotates them in place."""
    if _use_triton(query):
        op = rotary_embedding_triton
    elif _use_native(query) and native.rotary_available(query, key, cos_sin_cache):
        op = native.rotary_embedding_native
    else:
        op = rotary_embedding_reference
    return op(positions, query, key, cos_sin_cache)


def decode_stack_available(hidden: torch.Tensor, key_cache: torch.Tensor, heads: int) -> bool:
    """Whether a decode step's layers can run as one native call (kernels/decode_stack.py): CPU tensors,
    native kernels on, a heads-major cache, and a head shape the native attention takes."""
    if not (
        _use_native(hidden) and is_heads_major(key_cache) and decode_stack.available(hidden.dtype, key_cache.dtype)
    ):
        return False
    query_shape = torch.empty(0, heads, key_cache.shape[3], dtype=hidden.dtype)
    return native.decode_available(query_shape, key_cache)


def native_sampling_available(logits: torch.Tensor) -> bool:
    """Whether `sample_tokens` can draw these rows: float32 CPU logits and the native sampler built."""
    return _use_native(logits) and sampling.sample_available(logits)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) in one native pass per row; only where native_sampling_available."""
    return sampling.argmax_native(logits)


def sample_tokens(logits, temperature, top_k, top_p, min_p, uniform) -> torch.Tensor:
    """One token per row with temperature, top-k, top-p and min-p (kernels/sampling.py), drawn with the
    row's uniform in [0, 1). Only where native_sampling_available; engine/sampler.py has the torch path."""
    return sampling.sample_native(logits, temperature, top_k, top_p, min_p, uniform)[0]


def silu_and_mul(x):
    if _use_triton(x):
        op = silu_and_mul_triton
    elif _use_native(x) and native.silu_and_mul_available(x):
        op = native.silu_and_mul_native
    else:
        op = silu_and_mul_reference
    return op(x)


__all__ = [
    "decode_stack_available",
    "force_reference",
    "greedy_tokens",
    "native_sampling_available",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "rotary_embedding",
    "sample_tokens",
    "silu_and_mul",
    "store_kv",
    "use_native_cpu",
]
