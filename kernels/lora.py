"""LoRA adapters' low-rank deltas, one native call per fused linear of a step (kernels/csrc/lora_cpu.cpp).

engine/lora.py lays each resident adapter out once, at load, as an `AdapterTable`: per layer and fused linear
(LINEARS_PER_LAYER of them: qkv, o, gate_up, down), the modules' lora_A rows stacked ([rank, in_features])
and each module's scaled B transposed with the output columns it adds into. A step's segments (rows run
under one adapter) become one `LoraStep`, built once per step; `LoraStep.add(linear, x, out)` then adds every
segment's delta to the rows of `out` in place, rows of no segment (the base model's) untouched.
kernels/decode_stack.py hands the same step to the fused native decode stack, which calls the kernel itself.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, cast

import torch

from kernels.cpu_native import library

LINEARS_PER_LAYER = 4
MAX_PIECES = 3  # modules per fused linear: q, k, v
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64

# One module of a fused linear: (rank start, rank end, output column start, column end, its B.T, scaled)
Piece = tuple[int, int, int, int, torch.Tensor]


class _Piece(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("rank_start", "rank_end", "col_start", "col_end")] + [("b_t", _P)]


class _Linear(ctypes.Structure):
    _fields_ = (
        [("a", _P)] + [(name, _I64) for name in ("rank", "in_features", "pieces")] + [("piece", _Piece * MAX_PIECES)]
    )


class _Step(ctypes.Structure):
    _fields_ = [("segments", _I64), ("starts", _P), ("ends", _P), ("tables", _P)]


def _native_function(dtype: torch.dtype) -> Any:
    native = library("lora_cpu")
    if native is None or dtype not in _SUFFIX:
        return None
    return getattr(native, f"tokenmill_lora_add_{_SUFFIX[dtype]}")


@cache
def _entry(dtype: torch.dtype) -> Callable[..., int] | None:
    function = _native_function(dtype)
    if function is None:
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.POINTER(_Step), _I64, _P, _I64, _I64, _P, _I64, _I64, ctypes.c_int]
    return cast(Callable[..., int], function)


def available(dtype: torch.dtype) -> bool:
    """Whether the native kernel is built for activations (and adapters) of `dtype` on the CPU."""
    return _entry(dtype) is not None


@cache
def entry_address(dtype: torch.dtype) -> int | None:
    """The kernel's address, for the fused decode stack to call it (None where it is not built)."""
    function = _native_function(dtype)
    return None if function is None else ctypes.cast(function, _P).value


class AdapterTable:
    """One adapter's matrices for every fused linear of every layer, as the kernel reads them.

    `linears`: per layer, then per fused linear in LINEARS_PER_LAYER order, None (the adapter does not touch
    it) or (A [rank, in_features], pieces). Every tensor must be contiguous, on the CPU, in `dtype`."""

    def __init__(self, linears: Sequence[tuple[torch.Tensor, Sequence[Piece]] | None], dtype: torch.dtype) -> None:
        self.dtype = dtype
        entries = []
        keep: list[torch.Tensor] = []
        for entry in linears:
            if entry is None:
                entries.append(_Linear())
                continue
            a, pieces = entry
            if len(pieces) > MAX_PIECES:
                raise ValueError(f"a fused linear of at most {MAX_PIECES} modules, got {len(pieces)}")
            for tensor in (a, *(piece[4] for piece in pieces)):
                if tensor.dtype != dtype or tensor.is_cuda or not tensor.is_contiguous():
                    raise ValueError("adapter matrices must be contiguous CPU tensors of the activations' dtype")
            keep.extend([a, *(piece[4] for piece in pieces)])
            native_pieces = (_Piece * MAX_PIECES)(*(_Piece(*piece[:4], piece[4].data_ptr()) for piece in pieces))
            entries.append(_Linear(a.data_ptr(), a.shape[0], a.shape[1], len(pieces), native_pieces))
        self._keep = keep
        self.linears = (_Linear * len(entries))(*entries)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.linears)


class LoraStep:
    """A step's segments for the kernel: rows [start, end) run under `table`'s adapter."""

    def __init__(self, segments: Sequence[tuple[int, int, AdapterTable]]) -> None:
        count = len(segments)
        self.dtype = segments[0][2].dtype
        self._tables = [table for _, _, table in segments]  # the step holds its adapters' tables alive
        self._starts = (_I64 * count)(*(start for start, _, _ in segments))
        self._ends = (_I64 * count)(*(end for _, end, _ in segments))
        self._addresses = (_P * count)(*(table.address for table in self._tables))
        self.native = _Step(
            count,
            ctypes.addressof(self._starts),
            ctypes.addressof(self._ends),
            ctypes.addressof(self._addresses),
        )
        self.rows = max(end for _, end, _ in segments)
        entry = _entry(self.dtype)
        if entry is None:
            raise RuntimeError("the native LoRA kernel is not built for this dtype (check `available` first)")
        self._entry = entry
        self._pointer = ctypes.byref(self.native)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.native)

    def add(self, linear: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds to the rows of each segment its adapter's delta for `linear` (layer * LINEARS_PER_LAYER + which
        fused linear) of x [rows, in_features]; returns out [rows, out_features], changed in place (or, where out
        was not contiguous, a contiguous copy)."""
        if not x.is_contiguous():
            x = x.contiguous()
        if not out.is_contiguous():
            out = out.contiguous()
        rows = self.rows
        if x.dtype != self.dtype or out.dtype != self.dtype or x.shape[0] < rows or out.shape[0] < rows:
            raise ValueError("x and out must hold every segment's rows, in the adapters' dtype")
        in_features, out_features = x.shape[1], out.shape[1]
        threads = torch.get_num_threads()
        status = self._entry(
            self._pointer,
            linear,
            x.data_ptr(),
            in_features,
            in_features,
            out.data_ptr(),
            out_features,
            out_features,
            threads,
        )
        if status != 0:
            raise ValueError(f"linear {linear}: an adapter's matrices do not fit {in_features} in, {out_features} out")
        return out
