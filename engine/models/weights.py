"""What a model's constructor reads: HF-named weights, each a plain torch tensor or a tensor still in the form
its file stores it (a GGUF tensor in its quantized blocks, `StoredTensor`).

Model code reads weights only through the helpers here (`dense`, `make_linear`, `concat_rows`), so one model
class runs a safetensors folder and a GGUF file alike, and the loader decides what a stored tensor becomes
(repacked for the int kernels, or dequantized) without the model knowing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from engine.gguf_file import GGUFTensor
from engine.gguf_repack import (
    GROUP,
    INT4_TYPES,
    K_QUANT_FORMATS,
    WIDE_TYPES,
    chunk_rows,
    linear_format,
    part_formats,
    stored_row_chunks,
)
from kernels.linear import Linear
from kernels.qlinear import (
    Format,
    PackedLinear,
    PackedWeight,
    QuantizedRows,
    pack_k_quant_blocks,
    pack_quantized_chunks,
    quantize_rows,
)


@runtime_checkable
class StoredTensor(Protocol):
    """A tensor as its file stores it (row-major blocks along the last axis). Rows are independent, so a model
    can take, reorder and stack rows (or experts of a 3-D tensor) without dequantizing anything."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def stored_type(self) -> str:
        """The file's name for the element type: "Q4_K", "Q8_0", "F16", ..."""
        ...

    def dequantize(self) -> torch.Tensor:
        """float32, of `shape`."""
        ...

    def select_rows(self, index: torch.Tensor) -> StoredTensor:
        """The rows (first axis of a 2-D tensor) at `index`, in that order."""
        ...

    def expert(self, number: int) -> StoredTensor:
        """A 3-D tensor's [number] slice (a mixture-of-experts layer's weights of one expert)."""
        ...


Weight = torch.Tensor | StoredTensor
LinearLayer = Linear | PackedLinear

# the packed format of the layers' linears, and of the logits head / tied embedding, per quantization
LAYER_FORMATS: dict[str, Format] = {"int8": "int8", "int4": "int4"}
HEAD_FORMATS: dict[str, tuple[Format, int | None]] = {"int8": ("int8", None), "int4": ("int8", 32)}


def dense(weight: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight as a plain tensor (norms, biases, small weights): a stored one dequantized."""
    tensor = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
    return tensor if dtype is None else tensor.to(dtype)


def concat_rows(parts: Sequence[Weight]) -> torch.Tensor:
    """Parts stacked along the output rows, as float tensors (a fused q/k/v or gate/up weight)."""
    tensors = [dense(part) for part in parts]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def make_linear(
    parts: Sequence[Weight], bias: torch.Tensor | None, dtype: torch.dtype, quantization: str
) -> LinearLayer:
    """One linear over `parts` stacked along their output rows (q/k/v fused, gate/up fused): oneDNN on `dtype`
    weights, or packed int8/int4, quantized from the weights as read, before any cast, so float32 checkpoints
    lose nothing to bf16 on the way."""
    if quantization == "none":
        weight = concat_rows(parts)
        return Linear(weight.to(dtype), None if bias is None else bias.to(dtype))
    if not any_stored(parts):
        return PackedLinear(concat_rows(parts), LAYER_FORMATS[quantization], bias)
    formats = part_formats([stored_type(part) for part in parts], LAYER_FORMATS[quantization])
    split = next((i for i in range(1, len(parts)) if formats[i] != formats[0]), len(parts))
    tail = pack_stored(parts[split:], formats[-1]) if split < len(parts) else None
    return PackedLinear(pack_stored(parts[:split], formats[0]), bias=bias, tail=tail)


def make_head(weight: Weight, quantization: str) -> PackedLinear:
    """The logits head (or a tied embedding, kept only in this form) packed for `quantization`: int8 (in groups
    of 32 under int4: the head decides the token, so it keeps more bits), or a GGUF's own 4-bit codes where
    the file stores it so under int4."""
    head_format, head_group = HEAD_FORMATS[quantization]
    if not isinstance(weight, torch.Tensor) and is_gguf(weight):
        fmt: Format = stored_format([weight], "int4") if quantization == "int4" else "int8"
        return PackedLinear(pack_stored([weight], fmt))
    return PackedLinear(dense(weight), head_format, group=head_group)


def make_embedding(weight: Weight, dtype: torch.dtype, quantization: str) -> torch.Tensor | PackedWeight:
    """An untied embedding: a `dtype` tensor, or, for a quantized GGUF run, packed like a linear (its rows
    dequantized on lookup with kernels.qlinear.embedding_rows), so it costs what the file's blocks cost."""
    if quantization != "none" and not isinstance(weight, torch.Tensor) and is_gguf(weight):
        return pack_stored([weight], stored_format([weight], LAYER_FORMATS[quantization]))
    return dense(weight, dtype).contiguous()


def any_stored(parts: Sequence[Weight]) -> bool:
    return any(not isinstance(part, torch.Tensor) and is_gguf(part) for part in parts)


def is_gguf(weight: StoredTensor) -> bool:
    """A quantized GGUF tensor (float GGUF tensors are packed from their values like any float weight)."""
    return weight.stored_type in INT4_TYPES | WIDE_TYPES


def stored_type(part: Weight) -> str:
    """The file's type of a stored part; "F32" for a float tensor (packed from its values like any float weight)."""
    return "F32" if isinstance(part, torch.Tensor) else part.stored_type


def stored_format(parts: Sequence[Weight], fmt: Format) -> Format:
    """The packed format of a (fused) linear of `parts` under int4 (a GGUF as stored) or int8
    (engine.gguf_repack.linear_format: int4k / int6k / int4 where the file's values fit, else int8)."""
    return linear_format({stored_type(part) for part in parts}, fmt) if fmt in ("int4", "int8") else fmt


def pack_stored(parts: Sequence[Weight], fmt: Format) -> PackedWeight:
    """Parts stacked along the output rows as `fmt` in groups of 32: a GGUF part from its own codes where the
    format holds them (engine/gguf_repack.py), else re-quantized from its values; packed chunk of rows by
    chunk, each GGUF part's file pages handed back once it is packed."""
    out_features = sum(part.shape[0] for part in parts)
    stored = _stored_blocks(parts, fmt)
    if stored is not None:
        packed = pack_k_quant_blocks(_block_chunks(stored), fmt, stored[0].shape[1], out_features)
        if packed is not None:
            return packed
    return pack_quantized_chunks(_row_chunks(parts, fmt), out_features)


def _stored_blocks(parts: Sequence[Weight], fmt: Format) -> list[GGUFTensor] | None:
    """The parts, where every one is a 2-D GGUF tensor of the block type `fmt` keeps (Q4_K for int4k, Q6_K for
    int6k), in whole blocks of 16 rows (kernels.qlinear.pack_k_quant_blocks packs those from the file's bytes);
    else None."""
    stored = [part for part in parts if isinstance(part, GGUFTensor)]
    whole = all(len(part.shape) == 2 and part.shape[0] % 16 == 0 for part in stored)
    if len(stored) != len(parts) or not whole or any(K_QUANT_FORMATS.get(p.type_name) != fmt for p in stored):
        return None
    return stored


def _block_chunks(parts: Sequence[GGUFTensor]) -> Iterator[np.ndarray]:
    """Each part's blocks, a chunk of rows at a time, each chunk's file pages handed back once it is packed."""
    for part in parts:
        rows, step = part.shape[0], chunk_rows(part)
        for start in range(0, rows, step):
            piece = part.row_range(start, min(rows, start + step))
            yield piece.raw
            piece.release()
        part.release()


def _row_chunks(parts: Sequence[Weight], fmt: Format) -> Iterator[QuantizedRows]:
    for part in parts:
        if isinstance(part, GGUFTensor):
            yield from (rows for rows, _ in stored_row_chunks(part, fmt))
            part.release()
        else:
            yield quantize_rows(dense(part), fmt, GROUP)
