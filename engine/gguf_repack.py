"""GGUF blocks into the int kernels' formats (kernels/qlinear.py `QuantizedRows`), one tensor at a time.

Which file values survive:
- Q4_0 (d * (q - 8)) and Q4_1 (d * q + m) are int4's own form: kept exactly (scale d, minimum -8d or m).
- Q4_K (d * sc * q - dmin * m per 32 inputs): int4 with scale d*sc and minimum -dmin*m rounded to float16,
  a relative change of at most 2^-11 per group (the codes q are kept).
- Q8_0 (d * q) and Q5_0 (d * (q - 16)) are int8 in groups of 32 with scale d: kept exactly. Q4_0 into int8
  (a linear fused with a wider part) likewise.
- Q5_1, Q5_K and Q6_K have offsets or 16-input scales int8 can't hold: re-quantized to int8 in groups of 32
  (8 bits where the file has 5 or 6: the change is a fraction of the file's own rounding).

The codes are read with gguf-py's own dequantizer on blocks whose headers are rewritten (d = 1, minimum 0,
sub-scales 1): what it returns is then q itself, so no bit layout is re-implemented here.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from gguf.quants import dequantize as gguf_dequantize

from engine.gguf_file import GGUFTensor
from kernels.qlinear import Format, QuantizedRows, concat_quantized_rows, quantize_rows

GROUP = 32
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # 4-bit codes: int4 holds them
WIDE_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"})  # more than 4 bits: int8, never fewer bits
EXACT_INT8_TYPES = frozenset({"Q8_0", "Q5_0", "Q4_0"})
_ONE_F16 = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
_ZERO_F16 = np.zeros(2, dtype=np.uint8)
# Q4_K's 12 bytes of 6-bit sub-scales and minimums with every scale 1 and every minimum 0
_Q4_K_UNIT_SCALES = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)


def _blocks(tensor: GGUFTensor) -> tuple[np.ndarray, int]:
    """[rows, blocks per row, block bytes] (a copy, so headers can be rewritten) and the inputs per block."""
    from gguf import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[tensor.qtype]
    rows = tensor.shape[0]
    return np.array(tensor.raw.reshape(rows, -1, block_bytes), copy=True), block


def _codes(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's dequantize of blocks whose headers now say scale 1, minimum 0: the integer codes, as float32."""
    rows = blocks.shape[0]
    return gguf_dequantize(blocks.reshape(rows, -1), qtype).reshape(rows, -1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, [rows, blocks]."""
    return np.ascontiguousarray(blocks[:, :, start : start + 2]).view(np.float16)[..., 0]


def _set(blocks: np.ndarray, start: int, value: np.ndarray) -> None:
    blocks[:, :, start : start + len(value)] = value


def exact_rows(tensor: GGUFTensor, fmt: Format) -> QuantizedRows | None:
    """The tensor's own codes and scales as `fmt` rows in groups of 32, or None where `fmt` can't hold them."""
    kind = tensor.type_name
    if len(tensor.shape) != 2:
        return None
    in_features = tensor.shape[1]
    if fmt == "int4" and kind in ("Q4_0", "Q4_1"):
        blocks, _ = _blocks(tensor)
        scales = _f16(blocks, 0)
        if kind == "Q4_0":
            mins = (-8 * scales.astype(np.float32)).astype(np.float16)
            _set(blocks, 0, _ONE_F16)
            codes = _codes(blocks, tensor.qtype) + 8
        else:
            mins = _f16(blocks, 2)
            _set(blocks, 0, _ONE_F16)
            _set(blocks, 2, _ZERO_F16)
            codes = _codes(blocks, tensor.qtype)
        return _rows("int4", codes, scales, mins, in_features)
    if fmt == "int4" and kind == "Q4_K":
        blocks, _ = _blocks(tensor)
        rows, count = blocks.shape[:2]
        d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
        sub_scales, sub_mins = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(-1, 12))
        scales = (d[..., None] * sub_scales.reshape(rows, count, 8)).astype(np.float16).reshape(rows, -1)
        mins = (-dmin[..., None] * sub_mins.reshape(rows, count, 8)).astype(np.float16).reshape(rows, -1)
        _set(blocks, 0, _ONE_F16)
        _set(blocks, 2, _ZERO_F16)
        _set(blocks, 4, _Q4_K_UNIT_SCALES)
        return _rows("int4", _codes(blocks, tensor.qtype), scales, mins, in_features)
    if fmt == "int8" and kind in EXACT_INT8_TYPES:
        blocks, _ = _blocks(tensor)
        scales = _f16(blocks, 0)
        _set(blocks, 0, _ONE_F16)
        codes = _codes(blocks, tensor.qtype)
        if kind == "Q8_0" and codes.min() < -127:  # int8 holds -127..127; llama.cpp's Q8_0 never writes -128
            return None
        return _rows("int8", codes, scales, None, in_features)
    return None


def _rows(
    fmt: Format, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, in_features: int
) -> QuantizedRows:
    values = torch.from_numpy(codes.astype(np.uint8 if fmt == "int4" else np.int8))  # whole numbers already
    return QuantizedRows(
        fmt,
        values,
        torch.from_numpy(np.ascontiguousarray(scales)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins)),
        in_features,
        GROUP,
    )


CHUNK_VALUES = 1 << 22  # values per chunk of rows: float32 intermediates of 16 MB, not of the whole tensor


def stored_rows(tensor: GGUFTensor, fmt: Format) -> tuple[QuantizedRows, bool]:
    """The tensor as `fmt` rows in groups of 32, and whether they are the file's own values (else re-quantized
    from its dequantized values). Done in chunks of rows, so a 49k-token embedding's float32 intermediates
    never exist whole."""
    rows = tensor.shape[0]
    step = max(1, CHUNK_VALUES // max(1, tensor.shape[-1]))
    parts = [tensor.row_range(start, min(rows, start + step)) for start in range(0, rows, step)]
    exact: list[QuantizedRows] = []
    for part in parts:
        kept = exact_rows(part, fmt)
        if kept is None:
            break
        exact.append(kept)
    else:
        return concat_quantized_rows(exact), True
    return concat_quantized_rows([quantize_rows(part.dequantize(), fmt, GROUP) for part in parts]), False
