"""The one door the engine uses into kernels: CUDA tensors go to Triton, CPU tensors to the references.

`force_reference(True)` sends everything to the references (for checking the fast path).
"""
from __future__ import annotations

from kernels.activation import silu_and_mul_reference
from kernels.paged_attention import paged_attention_decode_reference, paged_attention_prefill_reference
from kernels.rms_norm import rms_norm_reference
from kernels.rotary import rotary_embedding_reference
from kernels.store_kv import store_kv_reference

_force_reference = False


def force_reference(enabled: bool) -> None:
    global _force_reference
    _force_reference = enabled


store_kv = store_kv_reference
paged_attention_decode = paged_attention_decode_reference
paged_attention_prefill = paged_attention_prefill_reference
rms_norm = rms_norm_reference
rotary_embedding = rotary_embedding_reference
silu_and_mul = silu_and_mul_reference

__all__ = [
    "force_reference",
    "store_kv",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
