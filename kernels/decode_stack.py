"""A decode step's decoder layers in one native call (kernels/csrc/decode_stack_cpu.cpp), for packed weights.

At one to a few streams, the ~300 small calls of a step around its matmuls cost about as much as the matmuls
(Python wrappers, allocations, ctypes crossings). `DecodeStack` runs the same kernels in the same order from
C++, so its output equals the per-op path bit for bit; engine/models/llama.py uses it for decode-only steps
on the CPU when every linear is packed (`--quantization int8|int4`) and the native kernels are built.

The weights, norms and cache pointers are gathered once (`DecodeStack(...)`); a call passes only the step's
rows. The stack holds references to every tensor it points into, so they live as long as it does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import cast

import torch

from kernels import lora as lora_kernel
from kernels.cpu_native import library
from kernels.cpu_native_ops import kernel_suffix
from kernels.lora import LoraStep
from kernels.qlinear import FORMAT_CODES, PackedWeight

_KERNELS = (  # (field, library, function) in TokenmillKernels' order
    ("qlinear", "qlinear_cpu", "tokenmill_qlinear"),
    ("rms_norm", "elementwise_cpu", "tokenmill_rms_norm"),
    ("rotary", "elementwise_cpu", "tokenmill_rotary"),
    ("silu_and_mul", "elementwise_cpu", "tokenmill_silu_and_mul"),
    ("store_kv", "elementwise_cpu", "tokenmill_store_kv"),
    ("paged_decode", "paged_decode_cpu", "tokenmill_paged_decode"),
)
_CACHE_KERNELS = ("store_kv", "paged_decode")  # built per (activations, KV cache) pair of element types
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name, _, _ in _KERNELS]


class _Linear(ctypes.Structure):
    _fields_ = [("packed", _P), ("scales", _P), ("mins", _P), ("bias", _P)] + [
        (name, _I64) for name in ("in_features", "out_features", "group", "format")
    ]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "post_attention_norm", "key_cache", "value_cache")] + [
        (name, _Linear) for name in ("qkv", "o", "gate_up", "down", "qkv_tail")
    ]


_MODEL_SIZES = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "block_size", "pool_blocks")


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in _MODEL_SIZES),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("cos_sin", _P),
        ("final_norm", _P),
        ("layer", ctypes.POINTER(_Layer)),
        ("kernels", _Kernels),
    ]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("table_stride", _I64)] + [
        (name, _P) for name in ("positions", "slots", "block_tables", "context_lens", "lora_add", "lora")
    ]


@dataclass(frozen=True)
class DecoderLayerWeights:
    input_norm: torch.Tensor  # [hidden], the activation dtype
    post_attention_norm: torch.Tensor
    # q/k/v as one packed weight, or two whose outputs follow one another (kernels.qlinear.PackedLinear's tail)
    qkv: list[PackedWeight]
    qkv_bias: list[torch.Tensor | None]  # float32, each weight's outputs, or None
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight


@dataclass(frozen=True)
class StackShape:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float


@cache
def _kernel_addresses(dtype: torch.dtype, cache_dtype: torch.dtype) -> _Kernels | None:
    """The kernels for activations of `dtype`; the two that touch the KV cache for a cache of `cache_dtype`."""
    addresses = {}
    for field, library_name, function in _KERNELS:
        native = library(library_name)
        suffix = kernel_suffix(dtype, cache_dtype if field in _CACHE_KERNELS else None)
        if native is None or suffix is None:
            return None
        addresses[field] = ctypes.cast(getattr(native, f"{function}_{suffix}"), _P).value
    return _Kernels(**addresses)


@cache
def _entry(dtype: torch.dtype) -> Callable[..., None] | None:
    native = library("decode_stack_cpu")
    if native is None:
        return None
    function = getattr(native, f"tokenmill_decode_stack_{kernel_suffix(dtype)}")
    function.restype = None
    function.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), _P, _P, ctypes.c_int]
    return cast(Callable[..., None], function)


def available(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the native libraries for a fused decode in `dtype` (over a KV cache of `cache_dtype`, by default
    the same) are built."""
    if kernel_suffix(dtype) is None:
        return False
    return _entry(dtype) is not None and _kernel_addresses(dtype, cache_dtype or dtype) is not None


def _linear(weight: PackedWeight | None, bias: torch.Tensor | None = None) -> _Linear:
    if weight is None:
        return _Linear()  # all zero: no such linear

    def address(tensor: torch.Tensor | None) -> int | None:
        return None if tensor is None else tensor.data_ptr()

    return _Linear(
        address(weight.packed),
        address(weight.scales),
        address(weight.mins),
        address(bias),
        weight.in_features,
        weight.out_features,
        weight.group,
        FORMAT_CODES[weight.format],
    )


class DecodeStack:
    """Every decoder layer of a decode-only step, then the final norm, over heads-major KV caches."""

    def __init__(
        self,
        layers: list[DecoderLayerWeights],
        final_norm: torch.Tensor,
        cos_sin: torch.Tensor,
        shape: StackShape,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        dtype, cache_dtype = final_norm.dtype, kv_caches[0][0].dtype
        kernels = _kernel_addresses(dtype, cache_dtype)
        if not available(dtype, cache_dtype) or kernels is None:
            raise RuntimeError("the native decode stack is not built for this dtype (check `available` first)")
        self.dtype = dtype
        self.kv_caches = kv_caches
        self._keep = (layers, final_norm, cos_sin, kv_caches)
        pool_blocks, block_size = kv_caches[0][0].shape[0], kv_caches[0][0].shape[1]
        self._layers = (_Layer * len(layers))(
            *(
                _Layer(
                    weights.input_norm.data_ptr(),
                    weights.post_attention_norm.data_ptr(),
                    key_cache.data_ptr(),
                    value_cache.data_ptr(),
                    _linear(weights.qkv[0], weights.qkv_bias[0]),
                    _linear(weights.o),
                    _linear(weights.gate_up),
                    _linear(weights.down),
                    _linear(weights.qkv[1], weights.qkv_bias[1]) if len(weights.qkv) > 1 else _linear(None),
                )
                for weights, (key_cache, value_cache) in zip(layers, kv_caches, strict=True)
            )
        )
        self.hidden = final_norm.shape[0]
        self._model = _Model(
            len(layers),
            self.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            layers[0].down.in_features,
            block_size,
            pool_blocks,
            shape.eps,
            shape.scale,
            cos_sin.data_ptr(),
            final_norm.data_ptr(),
            self._layers,
            kernels,
        )

    def __call__(
        self,
        embedded: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """embedded [rows, hidden] in the stack's dtype, one row per sequence -> final-normed [rows, hidden].
        `lora`: the step's LoRA adapters, their deltas added to each linear's output (kernels/lora.py)."""
        embedded = embedded.contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lengths = context_lens.to(torch.int32).contiguous()
        rows = embedded.shape[0]
        out = torch.empty(rows, self.hidden, dtype=self.dtype)
        lora_add = None
        if lora is not None:
            lora_add = lora_kernel.entry_address(self.dtype)
            if lora_add is None or lora.dtype != self.dtype or lora.rows > rows:
                raise ValueError("the LoRA step does not fit this decode step (its dtype, its rows)")
        step = _Step(
            rows,
            tables.shape[1],
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            lengths.data_ptr(),
            lora_add,
            None if lora is None else lora.address,
        )
        entry = _entry(self.dtype)
        assert entry is not None
        entry(
            ctypes.byref(self._model), ctypes.byref(step), embedded.data_ptr(), out.data_ptr(), torch.get_num_threads()
        )
        return out
