"""Linear layers for few rows: weights packed once, as bfloat16 or weight-only int8 / int4 with group scales.

At one to a few dozen rows (decode steps of 1 to 8 users) a linear is a read of its weights, and the
oneDNN path is built for many rows: on this project's 2-core VMs its bf16 GEMV read weights at ~10 GB/s.
kernels/csrc/qlinear_cpu.cpp streams a packed copy at memory speed and dequantizes in registers;
bench/qlinear_bench.py measures it against a plain read of as many bytes, in the same run.

Formats (`pack_weight`):
- "bf16": the weight as is, bfloat16.
- "int8": symmetric, one float16 scale per output row and `group` inputs (group None: the whole row,
  per-channel); GGUF's Q8_0 is group 32.
- "int4": asymmetric, q in 0..15 with a float16 scale and minimum per output row and 32 inputs, as in
  GGUF's Q4_1. SmolLM2's GGUF holds its layers as Q4_1 and its embedding as Q8_0, so re-quantizing the
  dequantized weights this way gives back those same values (within float16 rounding of the scales).
- "int4k", "int6k": GGUF's Q4_K and Q6_K as the file holds them (engine/gguf_repack.py), codes, 6-bit / 8-bit
  group scales and float16 super-block scales per 256 inputs: 4.625 and 6.5625 bits a weight, where int4 took
  5 and int8 8.5, and the file's values exactly. Made only from a GGUF's blocks, never from floats.

The int formats multiply in integers: x is quantized per row and block of 32 inputs to two int8 digits,
about 16-bit precision (`quantize_activations`). The torch reference (`qlinear_reference`: dequantize, then matmul in
float32, with x quantized the same way) defines the result; the kernel's integer sums are exact, so
outputs agree to float32 rounding before the cast to the activation dtype.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Literal, cast

import numpy as np
import torch

from kernels.cpu_native import library
from kernels.huge_pages import huge_page_buffer

Format = Literal["bf16", "int8", "int4", "int4k", "int6k"]
QUANTIZATIONS = ("none", "int8", "int4")
FORMAT_CODES: dict[str, int] = {"bf16": 0, "int8": 1, "int4": 2, "int4k": 3, "int6k": 4}
K_FORMATS = ("int4k", "int6k")  # super blocks of SUPER_GROUPS groups; `scales` holds all their scales as bytes
SUPER_GROUPS = 8
# packed bytes per weight value (before padding rows to a tile): codes, then group and super-block scales
BYTES_PER_VALUE: dict[str, float] = {
    "bf16": 2.0,
    "int8": 1 + 2 / 32,
    "int4": 0.5 + 4 / 32,
    "int4k": 0.5 + 2 / 32 + 4 / 256,
    "int6k": 0.75 + 1 / 16 + 2 / 256,
}
LANES = 16  # output rows per packed block: one float32 vector of 16 lanes
TILE_ROWS = 64  # the kernel works in tiles of 4 blocks; output rows are padded to a multiple
INT4_GROUP = 32
X_BLOCK = 32  # inputs per scale when the int kernels quantize x
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class PackedWeight:
    """A [out_features, in_features] weight in the kernel's layout (kernels/csrc/qlinear_cpu.cpp)."""

    format: Format
    out_features: int
    in_features: int
    group: int  # inputs per scale: a multiple of X_BLOCK (in_features for bf16)
    # bf16 [blocks, K, 16] | int8: uint8 [blocks, Kp/4, 16, 4] | int4, int4k: uint8 [blocks, Kp/32, 4, 16, 4]
    # | int6k: uint8 [blocks, Kp/32, 384] (the low nibbles as int4's, then the high bits)
    packed: torch.Tensor
    # float16 [blocks, groups, 16] | int4k: uint8 [blocks, Kp/256, 320] | int6k: uint8 [blocks, Kp/256, 288]
    scales: torch.Tensor | None
    mins: torch.Tensor | None  # float16 [blocks, groups, 16], int4 only

    @property
    def groups(self) -> int:
        return -(-self.in_features // self.group)

    @property
    def padded_in_features(self) -> int:
        return self.groups * self.group

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins) if t is not None)


def _blocked(rows_major: torch.Tensor) -> torch.Tensor:
    """[Np, C] -> [Np/16, C, 16]: 16 output rows side by side along the last axis."""
    padded_rows, columns = rows_major.shape
    return rows_major.reshape(padded_rows // LANES, LANES, columns).transpose(1, 2).contiguous()


def _padded(weight: torch.Tensor, columns: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    rows = -(-out_features // TILE_ROWS) * TILE_ROWS
    padded = torch.zeros(rows, columns, dtype=torch.float32)
    padded[:out_features, :in_features] = weight.float()
    return padded


@dataclass(frozen=True)
class QuantizedRows:
    """A weight quantized row by row, before packing: the codes, scales and minimums the kernel multiplies with.

    int8: `values` int8 in [-127, 127], value = scale * q; int4: `values` uint8 in 0..15, value = scale * q + min.
    One float16 scale (and minimum) per row and `group` inputs. A GGUF tensor's blocks give these directly
    (engine/gguf_repack.py), so packing them keeps the file's values; `quantize_rows` makes them from floats.
    int4k (Q4_K): `values` 0..15, `scales` / `mins` uint8 sc, m per 32 inputs, `supers` float16 [rows, K/256, 2]
    (d, dmin): value = d * sc * q - dmin * m. int6k (Q6_K): `values` 0..63, `scales` int8 sc per 16 inputs,
    `supers` float16 [rows, K/256, 1] (d): value = d * sc * (q - 32)."""

    format: Format
    values: torch.Tensor  # [out_features, groups * group]
    scales: torch.Tensor  # float16 [out_features, groups] (int4k: uint8; int6k: int8 [out_features, 2 * groups])
    mins: torch.Tensor | None  # float16 [out_features, groups], int4 only (int4k: uint8)
    in_features: int
    group: int
    supers: torch.Tensor | None = None  # int4k, int6k: float16 [out_features, groups / 8, 2 or 1]

    @property
    def out_features(self) -> int:
        return int(self.values.shape[0])


def concat_quantized_rows(parts: Sequence[QuantizedRows]) -> QuantizedRows:
    """Parts (of one format and group) stacked along the output rows: a fused q/k/v or gate/up weight."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(
        (part.format, part.group, part.in_features) != (first.format, first.group, first.in_features) for part in parts
    ):
        raise ValueError("fused parts must share format, group and in_features")
    mins = None if first.mins is None else torch.cat([cast(torch.Tensor, part.mins) for part in parts])
    supers = None if first.supers is None else torch.cat([cast(torch.Tensor, part.supers) for part in parts])
    return replace(
        first,
        values=torch.cat([part.values for part in parts]),
        scales=torch.cat([part.scales for part in parts]),
        mins=mins,
        supers=supers,
    )


def row_slice(rows: QuantizedRows, start: int, stop: int) -> QuantizedRows:
    """Output rows start..stop-1 (views)."""
    mins = None if rows.mins is None else rows.mins[start:stop]
    supers = None if rows.supers is None else rows.supers[start:stop]
    return replace(rows, values=rows.values[start:stop], scales=rows.scales[start:stop], mins=mins, supers=supers)


def quantize_rows(weight: torch.Tensor, fmt: Format, group: int | None = None) -> QuantizedRows:
    """Quantizes a float [out_features, in_features] weight to int8 (symmetric) or int4 (scale and minimum).

    `group`: inputs per scale, a multiple of 32; int8 defaults to the whole row (per-channel), int4 to 32.
    """
    out_features, in_features = weight.shape
    if fmt not in ("int8", "int4"):
        raise ValueError(f"unknown weight format {fmt!r}")
    group = group or (-(-in_features // X_BLOCK) * X_BLOCK if fmt == "int8" else INT4_GROUP)
    if group % X_BLOCK or (fmt == "int4" and group != INT4_GROUP):
        raise ValueError(f"{fmt} groups must be a multiple of {X_BLOCK} inputs (int4: exactly {INT4_GROUP})")
    groups = -(-in_features // group)
    padded_in = groups * group
    padded = torch.zeros(out_features, padded_in, dtype=torch.float32)
    padded[:, :in_features] = weight.float()
    grouped = padded.view(out_features, groups, group)
    if fmt == "int8":
        scales = (grouped.abs().amax(-1) / 127).half()
        divisor = torch.where(scales == 0, 1.0, scales.float()).unsqueeze(-1)
        quantized = torch.round(grouped / divisor).clamp_(-127, 127).to(torch.int8)
        return QuantizedRows("int8", quantized.view(out_features, padded_in), scales, None, in_features, group)
    minimums = grouped.amin(-1).half()
    scales = ((grouped.amax(-1) - minimums.float()) / 15).half()
    divisor = torch.where(scales == 0, 1.0, scales.float()).unsqueeze(-1)
    quantized = torch.round((grouped - minimums.float().unsqueeze(-1)) / divisor).clamp_(0, 15).to(torch.uint8)
    return QuantizedRows("int4", quantized.view(out_features, padded_in), scales, minimums, in_features, group)


def _padded_rows(tensor: torch.Tensor) -> torch.Tensor:
    rows = tensor.shape[0]
    padded_rows = -(-rows // TILE_ROWS) * TILE_ROWS
    if padded_rows == rows:
        return tensor.contiguous()
    padded = torch.zeros(padded_rows, *tensor.shape[1:], dtype=tensor.dtype)
    padded[:rows] = tensor
    return padded


def _nibble_chunks(values: torch.Tensor, groups: int) -> torch.Tensor:
    """uint8 [Np, groups * 32] codes' low 4 bits in int4's layout, [Np/16, groups, 4, 16, 4]: byte (c, lane, j)
    holds input 4c + j of a group in its low nibble and input 16 + 4c + j in its high one."""
    padded_rows = values.shape[0]
    halves = (values & 15).view(padded_rows, groups, 2, 4, 4)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(padded_rows // LANES, LANES, groups, 4, 4)
    return nibbles.permute(0, 2, 3, 1, 4).contiguous()


def _super_bytes(*parts: torch.Tensor) -> torch.Tensor:
    """Per-row tensors [Np, supers, n] (any dtype) as the kernel's bytes per block and super block,
    [Np/16, supers, total]: each part's values lane by lane ([n][16]), the parts one after another."""
    laid = []
    for part in parts:
        rows, supers, count = part.shape
        lanes = part.reshape(rows // LANES, LANES, supers, count).permute(0, 2, 3, 1).contiguous()
        laid.append(lanes.view(torch.uint8).reshape(rows // LANES, supers, -1))
    return torch.cat(laid, dim=2)


def _pack_k_quant(rows: QuantizedRows) -> PackedWeight:
    """int4k / int6k rows in the kernel's layout (kernels/csrc/qlinear_cpu.cpp describes it)."""
    assert rows.supers is not None
    groups = rows.values.shape[1] // X_BLOCK
    supers = groups // SUPER_GROUPS
    values = _padded_rows(rows.values)
    padded_rows = values.shape[0]
    d = _padded_rows(rows.supers)
    if rows.format == "int4k":
        assert rows.mins is not None
        sc = _padded_rows(rows.scales).view(padded_rows, supers, SUPER_GROUPS)
        m = _padded_rows(rows.mins).view(padded_rows, supers, SUPER_GROUPS)
        scales = _super_bytes(sc, m, d[:, :, :1].contiguous(), d[:, :, 1:].contiguous())
        return PackedWeight(
            "int4k", rows.out_features, rows.in_features, X_BLOCK, _nibble_chunks(values, groups), scales, None
        )
    sc = _padded_rows(rows.scales).view(padded_rows, supers, 2 * SUPER_GROUPS)
    scales = _super_bytes(sc, d)
    # the high 2 bits of inputs 16h + 4c + j at bits 4-5, 6-7, 0-1, 2-3 for c = 0..3 of byte (h, lane, j)
    high = ((values >> 4) & 3).view(padded_rows, groups, 2, 4, 4)
    shifted = high[:, :, :, 0] << 4 | high[:, :, :, 1] << 6 | high[:, :, :, 2] | high[:, :, :, 3] << 2
    high_bytes = shifted.view(padded_rows // LANES, LANES, groups, 2, 4).permute(0, 2, 3, 1, 4)
    low = _nibble_chunks(values, groups).view(padded_rows // LANES, groups, 256)
    packed = torch.cat((low, high_bytes.reshape(padded_rows // LANES, groups, 128)), dim=2).contiguous()
    return PackedWeight("int6k", rows.out_features, rows.in_features, X_BLOCK, packed, scales, None)


def pack_quantized(rows: QuantizedRows) -> PackedWeight:
    """QuantizedRows in the kernel's layout (output rows padded to a tile with zero rows)."""
    if rows.format in K_FORMATS:
        return _pack_k_quant(rows)
    out_features, group = rows.out_features, rows.group
    padded_in = rows.values.shape[1]
    groups = padded_in // group
    values = _padded_rows(rows.values)
    padded_rows = values.shape[0]
    scales = _blocked(_padded_rows(rows.scales))
    if rows.format == "int8":
        # q + 128 as a byte: flipping the sign bit of q's two's complement byte
        offset = (values.view(torch.uint8) ^ 0x80).view(padded_rows // LANES, LANES, padded_in // 4, 4)
        packed = offset.permute(0, 2, 1, 3).contiguous()
        return PackedWeight("int8", out_features, rows.in_features, group, packed, scales, None)
    assert rows.mins is not None
    packed = _nibble_chunks(values, groups)
    return PackedWeight(
        "int4", out_features, rows.in_features, group, packed, scales, _blocked(_padded_rows(rows.mins))
    )


def pack_quantized_chunks(chunks: Iterable[QuantizedRows], out_features: int) -> PackedWeight:
    """Rows arriving chunk by chunk (one format, group and width; `out_features` in all), packed as they come
    into one PackedWeight, the same as `pack_quantized` of them all concatenated. A load then holds the packed
    weight and one chunk, not the whole weight's codes (and their packing's copies) beside it: a 1B's tied
    Q6_K head re-quantized whole took 0.40 GB on the way to its 0.11 GB. Chunks whose rows end off a tile
    (64 rows) carry the rest into the next."""
    packed: PackedWeight | None = None
    done = 0  # rows packed
    carried: list[QuantizedRows] = []

    def write(rows: QuantizedRows) -> None:
        nonlocal packed, done
        part = pack_quantized(rows)
        if packed is None:
            blocks = -(-out_features // TILE_ROWS) * TILE_ROWS // LANES

            def grown(tensor: torch.Tensor) -> torch.Tensor:
                return tensor.new_empty(blocks, *tensor.shape[1:])

            packed = replace(
                part,
                out_features=out_features,
                packed=grown(part.packed),
                scales=None if part.scales is None else grown(part.scales),
                mins=None if part.mins is None else grown(part.mins),
            )
        first = done // LANES
        for target, source in ((packed.packed, part.packed), (packed.scales, part.scales), (packed.mins, part.mins)):
            if target is not None and source is not None:
                target[first : first + source.shape[0]] = source
        done += rows.out_features

    for chunk in chunks:
        carried.append(chunk)
        count = sum(part.out_features for part in carried)
        if count < TILE_ROWS:
            continue
        rows = concat_quantized_rows(carried)
        whole = count // TILE_ROWS * TILE_ROWS
        write(row_slice(rows, 0, whole))
        carried = [row_slice(rows, whole, count)] if whole < count else []
        del rows
    if carried:
        write(concat_quantized_rows(carried))  # the last rows, padded to a tile by pack_quantized
    if packed is None or done != out_features:
        raise ValueError(f"the chunks held {done} rows, not {out_features}")
    return packed


# bytes per GGUF block of 256 inputs: llama.cpp's block_q4_K and block_q6_K
_K_QUANT_BLOCK_BYTES = {"int4k": 144, "int6k": 210}
_K_QUANT_PACKED_BYTES = {"int4k": (256, 320), "int6k": (384, 288)}  # per block of lanes: a group's, a super block's


def _k_quant_blocks_kernel() -> Callable[..., object] | None:
    return _native_function(
        "tokenmill_pack_k_quant_blocks", ctypes.c_int, (_INT, _VOID, _I64, _I64, _VOID, _VOID, _INT)
    )


def pack_k_quant_blocks(
    chunks: Iterable[np.ndarray], fmt: Format, in_features: int, out_features: int
) -> PackedWeight | None:
    """GGUF Q4_K blocks as int4k, or Q6_K as int6k, packed by the native library as they come: each chunk a uint8
    array [rows, in_features / 256 * block bytes] (a read-only view of the mapped file will do), its rows a
    multiple of 16, the chunks `out_features` rows in all.
    The same bytes as `pack_quantized_chunks` of the blocks' QuantizedRows (engine/gguf_repack.py), without
    them: a 1B Q4_K_M's 113 Q4_K / Q6_K tensors (667 MB) in 0.64 s where the rows took 3.32 s (2-core EPYC
    Zen 2). None where the native library isn't built (nothing of `chunks` is read then)."""
    kernel = _k_quant_blocks_kernel()
    if kernel is None:
        return None
    group_bytes, super_bytes = _K_QUANT_PACKED_BYTES[fmt]
    blocks = -(-out_features // TILE_ROWS) * TILE_ROWS // LANES
    codes = torch.zeros(blocks, in_features // X_BLOCK, group_bytes, dtype=torch.uint8)  # padded rows: zero
    scales = torch.zeros(blocks, in_features // (SUPER_GROUPS * X_BLOCK), super_bytes, dtype=torch.uint8)
    done = 0
    for chunk in chunks:
        rows = chunk.shape[0]
        if (
            rows % LANES
            or chunk.shape[1] != in_features // (SUPER_GROUPS * X_BLOCK) * _K_QUANT_BLOCK_BYTES[fmt]
            or done + rows > out_features
        ):
            raise ValueError(f"a chunk of {tuple(chunk.shape)} {fmt} blocks at row {done} of {out_features}")
        chunk = np.ascontiguousarray(chunk, dtype=np.uint8)  # a view where it is one already
        first = done // LANES
        status = kernel(
            FORMAT_CODES[fmt],
            chunk.ctypes.data,
            rows,
            in_features,
            codes[first].data_ptr(),
            scales[first].data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"{fmt} blocks of {in_features} inputs can't be packed natively")
        done += rows
    if done != out_features:
        raise ValueError(f"the chunks held {done} rows, not {out_features}")
    if fmt == "int4k":
        codes = codes.view(blocks, in_features // X_BLOCK, 4, LANES, 4)
    return PackedWeight(fmt, out_features, in_features, X_BLOCK, codes, scales, None)


def pack_weight(weight: torch.Tensor, fmt: Format, group: int | None = None) -> PackedWeight:
    """Packs (and for int8/int4 quantizes) a [out_features, in_features] weight.

    `group`: inputs per scale, a multiple of 32; int8 defaults to the whole row (per-channel), int4 to 32.
    """
    out_features, in_features = weight.shape
    if fmt == "bf16":
        packed = _blocked(_padded(weight, in_features).to(torch.bfloat16))
        return PackedWeight("bf16", out_features, in_features, in_features, packed, None, None)
    return pack_quantized(quantize_rows(weight, fmt, group))


_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def place_together(weights: Sequence[PackedWeight]) -> list[PackedWeight]:
    """Copies of `weights`, laid out one after another in the order given (a decode step's order) in one buffer
    on huge pages.

    Why: a decode step at one row reads ~100 MB of packed weights once, and with each linear a tensor of its own
    (4 KB pages, scattered) the reads crossed a page, and a TLB walk, every 4 KB. On 2 MB pages a step's matmuls
    ran ~10% faster (2-core EPYC, decode step at one row, the same bits)."""
    tensors = [t for weight in weights for t in (weight.packed, weight.scales, weight.mins) if t is not None]
    total = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
    buffer = huge_page_buffer(max(total, 1))
    offset = 0

    def copied(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        nbytes = tensor.numel() * tensor.element_size()
        view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        offset += _aligned(nbytes)
        return view

    placed = []
    for weight in weights:
        packed = copied(weight.packed)  # in this order: a weight's scales and minimums follow its values
        scales = None if weight.scales is None else copied(weight.scales)
        mins = None if weight.mins is None else copied(weight.mins)
        placed.append(replace(weight, packed=packed, scales=scales, mins=mins))
    return placed


def move_together(linears: Sequence[PackedLinear]) -> None:
    """`place_together` for the linears' own weights, each swapped for its copy as soon as it is made: the
    original is freed then, so a load holds one copy of the packed model (plus one weight), not two."""
    tensors = [
        t for linear in linears for weight in linear.weights for t in (weight.packed, weight.scales, weight.mins)
    ]
    total = sum(_aligned(t.numel() * t.element_size()) for t in tensors if t is not None)
    buffer = huge_page_buffer(max(total, 1))
    offset = 0

    def copied(tensor: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal offset
        if tensor is None:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        offset += _aligned(nbytes)
        return view

    def moved(weight: PackedWeight) -> PackedWeight:
        packed = copied(weight.packed)
        assert packed is not None
        return replace(weight, packed=packed, scales=copied(weight.scales), mins=copied(weight.mins))

    del tensors
    for linear in linears:
        linear.weight = moved(linear.weight)
        if linear.tail is not None:
            linear.tail = moved(linear.tail)


def _k_quant_rows(weight: PackedWeight, blocks: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """int4k / int6k rows as float32 [rows, Kp] (the packed rows kernel's values and roundings)."""
    count, groups = len(blocks), weight.groups
    supers, each = groups // SUPER_GROUPS, torch.arange(count)
    assert weight.scales is not None
    bytes_ = weight.scales[blocks]  # [rows, supers, 320 | 288]
    small_rows = 2 * SUPER_GROUPS  # sc and m (int4k) or the halves' sc (int6k): 16 rows of 16 lanes' bytes
    small = bytes_[:, :, : small_rows * LANES].reshape(count, supers, small_rows, LANES)[each, :, :, lanes]
    halves = bytes_[:, :, small_rows * LANES :].contiguous().view(torch.float16)
    d = halves.reshape(count, supers, -1, LANES)[each, :, :, lanes].float()  # [rows, supers, 2 | 1]
    if weight.format == "int4k":
        nibbles = weight.packed[blocks, :, :, lanes, :]  # [rows, groups, 4, 4]
        q = torch.stack((nibbles & 15, nibbles >> 4), dim=2).reshape(count, groups, 32).float()
        sc, m = small[:, :, :SUPER_GROUPS].float(), small[:, :, SUPER_GROUPS:].float()
        scale = (d[:, :, :1] * sc).reshape(count, groups, 1)
        minimum = -(d[:, :, 1:] * m).reshape(count, groups, 1)
        return (q * scale + minimum).reshape(count, -1)
    group_bytes = weight.packed[blocks].view(count, groups, 6, LANES, 4)[each, :, :, lanes]  # [rows, groups, 6, 4]
    nibbles, high = group_bytes[:, :, :4], group_bytes[:, :, 4:]
    shifts = torch.tensor([4, 6, 0, 2], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    high_bits = (high.unsqueeze(3) >> shifts) & 3  # [rows, groups, half, c, j]: input 16 * half + 4c + j
    low = torch.stack((nibbles & 15, nibbles >> 4), dim=2)
    q = (low | (high_bits << 4)).reshape(count, groups, 2, 16).float() - 32
    sc = small.contiguous().view(torch.int8).float().view(count, supers, SUPER_GROUPS, 2)
    scale = (d.view(count, supers, 1, 1) * sc).reshape(count, groups, 2, 1)
    return (q * scale).reshape(count, -1)


def _dequantized_rows(weight: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), in_features]: the given output rows (weight rows) from the packed form."""
    blocks, lanes = rows // LANES, rows % LANES
    count = len(rows)
    if weight.format in K_FORMATS:
        return _k_quant_rows(weight, blocks, lanes)[:, : weight.in_features]
    if weight.format == "bf16":
        return weight.packed[blocks, :, lanes].float()
    if weight.format == "int8":
        values = weight.packed[blocks, :, lanes, :].reshape(count, -1).to(torch.int16) - 128
    else:
        nibbles = weight.packed[blocks, :, :, lanes, :]  # [rows, groups, 4, 4]
        values = torch.stack((nibbles & 15, nibbles >> 4), dim=2).reshape(count, -1)
    assert weight.scales is not None
    out = values.float() * weight.scales[blocks, :, lanes].float().repeat_interleave(weight.group, dim=1)
    if weight.mins is not None:
        out += weight.mins[blocks, :, lanes].float().repeat_interleave(weight.group, dim=1)
    return out[:, : weight.in_features]


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """The float32 [out_features, in_features] weight the kernel computes with."""
    return _dequantized_rows(weight, torch.arange(weight.out_features))


def _native_arguments(weight: PackedWeight) -> tuple[int, int, int | None, int | None]:
    """The format code and the packed values', scales' and minimums' addresses, as the native calls take them."""
    return (
        FORMAT_CODES[weight.format],
        weight.packed.data_ptr(),
        None if weight.scales is None else weight.scales.data_ptr(),
        None if weight.mins is None else weight.mins.data_ptr(),
    )


def embedding_rows(weight: PackedWeight, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows of a (tied) embedding kept only in packed form: float32 [tokens, in_features], the values of
    `_dequantized_rows`, in one native call where built (one call, not eight torch ops a decode step)."""
    ids = token_ids.reshape(-1).long()
    lookup = _rows_kernel()
    if lookup is None or ids.is_cuda or weight.packed.is_cuda:
        return _dequantized_rows(weight, ids)
    ids = ids.contiguous()
    out = torch.empty(len(ids), weight.in_features)
    padded = weight.packed.shape[1] if weight.format == "bf16" else weight.padded_in_features
    status = lookup(
        ids.data_ptr(),
        len(ids),
        weight.out_features,
        *_native_arguments(weight),
        weight.in_features,
        padded,
        weight.group,
        out.data_ptr(),
    )
    if status != 0:
        raise IndexError(f"token ids must lie in [0, {weight.out_features})")
    return out


_VOID, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@cache
def _native_function(name: str, restype: type | None, argtypes: tuple[type, ...]) -> Callable[..., object] | None:
    """`name` from the qlinear_cpu library with its ctypes signature set, or None where it isn't built."""
    native = library("qlinear_cpu")
    if native is None:
        return None
    function = getattr(native, name)
    function.restype = restype
    function.argtypes = list(argtypes)
    return cast(Callable[..., object], function)


def _rows_kernel() -> Callable[..., object] | None:
    return _native_function(
        "tokenmill_packed_rows", ctypes.c_int, (_VOID, _I64, _I64, _INT, _VOID, _VOID, _VOID, _I64, _I64, _I64, _VOID)
    )


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int kernels see it, in float32: each row, per block of 32 inputs, as two int8 digits
    x ~ s * (hi + lo / 256), s = max|x| / 127 (about 16-bit precision); a low digit of 128 carries into hi."""
    rows = x.reshape(-1, x.shape[-1]).float()
    in_features = rows.shape[1]
    padded = torch.zeros(rows.shape[0], -(-in_features // X_BLOCK) * X_BLOCK)
    padded[:, :in_features] = rows
    blocks = padded.view(rows.shape[0], -1, X_BLOCK)
    scales = blocks.abs().amax(-1, keepdim=True) / 127
    divisor = torch.where(scales == 0, 1.0, scales)
    high = torch.round(blocks / divisor)
    low = torch.round((blocks - high * scales) / (divisor / 256))
    carry = low > 127
    high += carry
    low = torch.where(carry, low - 256, low).clamp_(-128, 127)
    restored = (high * 256 + low) * (scales / 256)
    return restored.view(rows.shape[0], -1)[:, :in_features].reshape(x.shape)


def qlinear_reference(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then matmul in float32 (with x quantized as the int kernels quantize it)."""
    inputs = x.float() if weight.format == "bf16" else quantize_activations(x)
    out = inputs @ dequantize(weight).to(x.device).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def _kernel(dtype: torch.dtype) -> Callable[..., object] | None:
    return _native_function(
        f"tokenmill_qlinear_{_SUFFIX[dtype]}",
        None,
        (_VOID, _VOID, _I64, _I64, _I64, _INT, _VOID, _VOID, _VOID, _I64, _VOID, _INT),
    )


def vector_unit() -> str | None:
    """Which vector code the native kernel was built with ("avx512", "avx2", "scalar"), None if not built."""
    function = _native_function("tokenmill_qlinear_vector_unit", ctypes.c_char_p, ())
    return None if function is None else str(cast(bytes, function()).decode())


def matrix_unit(enable: bool | None = None) -> str | None:
    """ "amx" where the int4k / int6k kernels run their many-row products on AMX tiles (Intel from Sapphire Rapids,
    where the kernel grants the tile state), else None. `enable` False keeps them on the vector unit (True: back)."""
    function = _native_function("tokenmill_qlinear_amx", ctypes.c_int, (_INT,))
    if function is None:
        return None
    return "amx" if function(-1 if enable is None else int(enable)) else None


def native_available(x: torch.Tensor) -> bool:
    return not x.is_cuda and x.dtype in _SUFFIX and _kernel(x.dtype) is not None


def qlinear_native(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, threads: int | None = None
) -> torch.Tensor:
    """x [..., in_features] float32 or bfloat16; `bias` float32 [out_features] or None."""
    rows = x.reshape(-1, weight.in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
    kernel = _kernel(x.dtype)
    assert kernel is not None, "qlinear_native needs the native library (native_available)"
    kernel(
        rows.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        weight.in_features,
        weight.out_features,
        *_native_arguments(weight),
        weight.group,
        None if bias is None else bias.data_ptr(),
        threads or torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], weight.out_features)


class PackedLinear:
    """y = x @ weight.T + bias through the native kernel (the reference where there is none).

    `tail`: a second packed weight of the same inputs whose outputs follow `weight`'s (a fused linear whose parts
    keep different formats: Q4_K_M's q/k in int4k beside its Q6_K v in int6k, engine/gguf_repack.part_formats)."""

    def __init__(
        self,
        weight: torch.Tensor | PackedWeight,
        fmt: Format = "int8",
        bias: torch.Tensor | None = None,
        group: int | None = None,
        tail: PackedWeight | None = None,
    ) -> None:
        """`weight`: a float weight, packed here as `fmt` (`group`), or one already packed (fmt is then its own)."""
        self.weight = weight if isinstance(weight, PackedWeight) else pack_weight(weight, fmt, group)
        self.tail = tail
        if tail is not None and tail.in_features != self.weight.in_features:
            raise ValueError("a tail weight must take the same inputs")
        self.out_features = self.weight.out_features + (0 if tail is None else tail.out_features)
        self.in_features = self.weight.in_features
        self.bias = None if bias is None else bias.float().contiguous()

    @property
    def weights(self) -> list[PackedWeight]:
        return [self.weight] if self.tail is None else [self.weight, self.tail]

    def nbytes(self) -> int:
        return sum(weight.nbytes() for weight in self.weights)

    def biases(self) -> list[torch.Tensor | None]:
        """The bias of each of `weights`' outputs."""
        if self.bias is None:
            return [None] * len(self.weights)
        first = self.weight.out_features
        return [self.bias] if self.tail is None else [self.bias[:first], self.bias[first:]]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        run = qlinear_native if native_available(x) else qlinear_reference
        outputs = [run(x, weight, bias) for weight, bias in zip(self.weights, self.biases(), strict=True)]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
