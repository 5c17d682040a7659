"""GGUF blocks into the int kernels' formats (kernels/qlinear.py `QuantizedRows`), one tensor at a time.

Which file values survive:
- Q4_0 (d * (q - 8)) and Q4_1 (d * q + m) are int4's own form: kept exactly (scale d, minimum -8d or m).
- Q4_K (d * sc * q - dmin * m per 32 inputs) and Q6_K (d * sc * (q - 32) per 16): int4k and int6k, the file's
  codes, 6-bit / 8-bit scales and float16 super-block scales as they are: kept exactly, in 4.625 and 6.5625 bits
  a weight. A Q4_K fused with a Q4_0/Q4_1 part goes to int4 instead: scale d*sc and minimum -dmin*m rounded to
  float16, a relative change of at most 2^-11 per group (the codes q are kept).
- Q8_0 (d * q) and Q5_0 (d * (q - 16)) are int8 in groups of 32 with scale d: kept exactly. Q4_0 into int8
  (a linear fused with a wider part) likewise.
- Q5_1 and Q5_K have offsets int8 can't hold, nor can it Q6_K's 16-input scales where a Q6_K is fused with
  another type (Q4_K_M's q/k/v where v is Q6_K): re-quantized to int8 in groups of 32 (8 bits where the file has
  5 or 6: the change is a fraction of the file's own rounding).

The codes of the plain layouts (Q4_0, Q4_1, Q4_K nibbles, Q8_0 bytes) are read straight from the bytes; Q5_0's,
whose fifth bits lie apart, with gguf-py's own dequantizer on blocks rewritten to scale 1 (it then returns q).
Scales and minimums come from the block headers (Q4_K's 6-bit ones through gguf-py's `get_scale_min`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from gguf.quants import dequantize as gguf_dequantize

from engine.gguf_file import GGUFTensor, TensorEntry
from kernels.qlinear import TILE_ROWS, Format, QuantizedRows, concat_quantized_rows, quantize_rows

GROUP = 32
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # 4-bit codes: int4 holds them
WIDE_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"})  # more than 4 bits: int8, never fewer bits
EXACT_INT8_TYPES = frozenset({"Q8_0", "Q5_0", "Q4_0"})
K_QUANT_FORMATS: dict[str, Format] = {"Q4_K": "int4k", "Q6_K": "int6k"}  # a linear all of one of these types
# the matrices a layer fuses into one linear (engine/models/decoder.py), by their GGUF names
FUSED_ROLES = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}


def linear_format(stored_types: Collection[str], quantization: str) -> Format:
    """The packed format of one linear (fused or not) whose parts the file stores as `stored_types`, under
    int4 (the file as stored) or int8: int4k / int6k where every part is Q4_K / Q6_K (their blocks as they
    are), int4 where every part has 4-bit codes, else int8 for the whole linear, so no stored value loses bits
    (Q4_K_M's q/k/v where v is Q6_K). A float part ("F32") packs as int4 under int4, as any float weight."""
    types = set(stored_types)
    if quantization == "int4":
        if len(types) == 1 and next(iter(types)) in K_QUANT_FORMATS:
            return K_QUANT_FORMATS[next(iter(types))]
        if not types & WIDE_TYPES:
            return "int4"
    return "int8"


def part_formats(part_types: Sequence[str], quantization: str) -> list[Format]:
    """Each part's packed format, in order, for a fused linear of parts stored as `part_types`: `linear_format`
    of them all, unless that is int8 re-quantizing a part that a format of its own keeps exactly, and the parts
    fall into two runs of one format each (Q4_K_M's q/k/v where v is Q6_K: q/k int4k, v int6k); the linear then
    runs as those two packed weights (kernels.qlinear.PackedLinear's `tail`)."""
    fused = linear_format(set(part_types), quantization)
    own = [linear_format({part_type}, quantization) for part_type in part_types]
    runs = 1 + sum(own[i] != own[i - 1] for i in range(1, len(own)))
    if quantization != "int4" or fused != "int8" or runs != 2:
        return [fused] * len(own)
    return own


def is_packed_matrix(entry: TensorEntry) -> bool:
    """A quantized matrix (or stack of experts' matrices): packed for the int kernels; the rest stays float."""
    return entry.type_name in INT4_TYPES | WIDE_TYPES and len(entry.shape) >= 2


def packed_linears(entries: Iterable[TensorEntry], quantization: str) -> list[tuple[Format, int]]:
    """(format, values) of each packed weight a GGUF's quantized matrices make: a layer's q/k/v and gate/up fused,
    as the model builds them (`part_formats`)."""
    groups: dict[str, list[tuple[int, str, int]]] = {}
    for entry in filter(is_packed_matrix, entries):
        block, _, role = entry.name.rpartition(".weight")[0].rpartition(".")
        place = list(FUSED_ROLES).index(role) if role in FUSED_ROLES else 0
        groups.setdefault(f"{block}.{FUSED_ROLES.get(role, role)}", []).append(
            (place, entry.type_name, math.prod(entry.shape))
        )
    packed: list[tuple[Format, int]] = []
    for members in groups.values():
        members.sort()  # q, k, v / gate, up: the order the model stacks them
        formats = part_formats([type_name for _, type_name, _ in members], quantization)
        runs: list[tuple[Format, int]] = []
        for fmt, (_, _, values) in zip(formats, members, strict=True):
            if runs and runs[-1][0] == fmt:
                runs[-1] = (fmt, runs[-1][1] + values)
            else:
                runs.append((fmt, values))
        packed.extend(runs)
    return packed


_ONE_F16 = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)


def _blocks(tensor: GGUFTensor) -> tuple[np.ndarray, int]:
    """[rows, blocks per row, block bytes] (a view of the file) and the inputs per block."""
    from gguf import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[tensor.qtype]
    rows = tensor.shape[0]
    return tensor.raw.reshape(rows, -1, block_bytes), block


def _codes(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's dequantize of blocks whose headers now say scale 1, minimum 0: the integer codes, as float32."""
    rows = blocks.shape[0]
    return gguf_dequantize(blocks.reshape(rows, -1), qtype).reshape(rows, -1)


def _nibbles(packed: np.ndarray, run: int) -> np.ndarray:
    """4-bit codes from bytes [rows, blocks, n]: each run of `run` bytes holds `run` low nibbles, then the
    same bytes' `run` high nibbles (Q4_0/Q4_1: one run of 16 per block; Q4_K: four runs of 32)."""
    rows, count, n = packed.shape
    runs = packed.reshape(rows, count, n // run, 1, run)
    return np.concatenate((runs & 0x0F, runs >> 4), axis=3).reshape(rows, -1)


def _fast_codes(blocks: np.ndarray, kind: str) -> np.ndarray | None:
    """The codes read straight from the bytes where the layout is a plain one (no float32 round trip: 5x
    faster at 1B); None where gguf's dequantizer reads them (Q5_0's fifth bits)."""
    if kind == "Q4_0":
        return _nibbles(blocks[:, :, 2:], 16).astype(np.int16) - 8
    if kind == "Q4_1":
        return _nibbles(blocks[:, :, 4:], 16)
    if kind == "Q4_K":
        return _nibbles(blocks[:, :, 16:], 32)
    if kind == "Q8_0":
        return np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(blocks.shape[0], -1)
    return None


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, [rows, blocks]."""
    return np.ascontiguousarray(blocks[:, :, start : start + 2]).view(np.float16)[..., 0]


def _set(blocks: np.ndarray, start: int, value: np.ndarray) -> None:
    blocks[:, :, start : start + len(value)] = value


def _k_quant_rows(tensor: GGUFTensor, fmt: Format) -> QuantizedRows:
    """A Q4_K tensor as int4k rows, or a Q6_K one as int6k: the blocks' own fields, rearranged."""
    blocks, _ = _blocks(tensor)
    rows, count = blocks.shape[:2]
    if fmt == "int4k":
        sub_scales, sub_mins = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(-1, 12))
        supers = np.stack((_f16(blocks, 0), _f16(blocks, 2)), axis=-1)  # d, dmin
        codes = _nibbles(blocks[:, :, 16:], 32)
        scales, mins = sub_scales.reshape(rows, -1), sub_mins.reshape(rows, -1)
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, float16 d (gguf.quants.Q6_K)
        nibble_shifts = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        pair_shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        low = (blocks[:, :, :128].reshape(rows, count, 2, 1, 64) >> nibble_shifts) & 0x0F
        high = (blocks[:, :, 128:192].reshape(rows, count, 2, 1, 32) >> pair_shifts) & 3
        codes = (low.reshape(rows, count, 2, 128) | (high << 4).reshape(rows, count, 2, 128)).reshape(rows, -1)
        scales, mins = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(rows, -1), None
        supers = _f16(blocks, 208)[..., None]
    return QuantizedRows(
        fmt,
        torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins)),
        tensor.shape[1],
        GROUP,
        torch.from_numpy(np.ascontiguousarray(supers)),
    )


def exact_rows(tensor: GGUFTensor, fmt: Format) -> QuantizedRows | None:
    """The tensor's own codes and scales as `fmt` rows in groups of 32, or None where `fmt` can't hold them."""
    kind = tensor.type_name
    if len(tensor.shape) != 2:
        return None
    in_features = tensor.shape[1]
    if (fmt, kind) in (("int4k", "Q4_K"), ("int6k", "Q6_K")):
        return _k_quant_rows(tensor, fmt)
    if fmt == "int4" and kind in ("Q4_0", "Q4_1"):
        blocks, _ = _blocks(tensor)
        scales = _f16(blocks, 0)
        mins = (-8 * scales.astype(np.float32)).astype(np.float16) if kind == "Q4_0" else _f16(blocks, 2)
        codes = _nibbles(blocks[:, :, 2 if kind == "Q4_0" else 4 :], 16)
        return _rows("int4", codes, scales, mins, in_features)
    if fmt == "int4" and kind == "Q4_K":
        blocks, _ = _blocks(tensor)
        rows, count = blocks.shape[:2]
        d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
        sub_scales, sub_mins = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(-1, 12))
        scales = (d[..., None] * sub_scales.reshape(rows, count, 8)).astype(np.float16).reshape(rows, -1)
        mins = (-dmin[..., None] * sub_mins.reshape(rows, count, 8)).astype(np.float16).reshape(rows, -1)
        return _rows("int4", _nibbles(blocks[:, :, 16:], 32), scales, mins, in_features)
    if fmt == "int8" and kind in EXACT_INT8_TYPES:
        blocks, _ = _blocks(tensor)
        scales = _f16(blocks, 0)
        fast = _fast_codes(blocks, kind)
        if fast is None:  # Q5_0: gguf's dequantizer reads the fifth bits, from blocks rewritten to scale 1
            blocks = blocks.copy()
            _set(blocks, 0, _ONE_F16)
        codes = _codes(blocks, tensor.qtype) if fast is None else fast
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


CHUNK_VALUES = 1 << 20  # values per chunk of rows: float32 intermediates of 4 MB, not of the whole tensor


def chunk_rows(tensor: GGUFTensor) -> int:
    """Rows per chunk: about CHUNK_VALUES values, a whole number of the kernel's 64-row tiles."""
    tiles = max(1, CHUNK_VALUES // max(1, tensor.shape[-1]) // TILE_ROWS)
    return tiles * TILE_ROWS


def stored_row_chunks(tensor: GGUFTensor, fmt: Format) -> Iterator[tuple[QuantizedRows, bool]]:
    """The tensor as `fmt` rows in groups of 32, chunk of rows by chunk (kernels.qlinear.pack_quantized_chunks
    packs them as they come), each with whether it holds the file's own values (else re-quantized from its
    dequantized values). Neither the codes nor the float32 intermediates of a whole tensor ever exist: a
    49k-token embedding is read 512 rows at a time."""
    rows = tensor.shape[0]
    step = chunk_rows(tensor)
    for start in range(0, rows, step):
        part = tensor.row_range(start, min(rows, start + step))
        kept = exact_rows(part, fmt)
        yield (kept, True) if kept is not None else (quantize_rows(part.dequantize(), fmt, GROUP), False)
        part.release()  # its file pages, once packed (rows in file order: else the whole tensor's, at its end)


def stored_rows(tensor: GGUFTensor, fmt: Format) -> tuple[QuantizedRows, bool]:
    """The whole tensor as `fmt` rows, and whether every value is the file's own (`stored_row_chunks` joined)."""
    chunks = list(stored_row_chunks(tensor, fmt))
    return concat_quantized_rows([rows for rows, _ in chunks]), all(exact for _, exact in chunks)
