"""A GGUF file's tensors as stored: read from the mapped file, block by block, never through a float copy of the
model.

`read_tensor_index` walks the header (skipping the metadata, whose tokenizer arrays gguf's own reader parses
value by value: seconds) to each tensor's type, shape and offset; `GGUFTensor` is a view of one tensor's raw
blocks (a numpy memmap) that implements engine/models/weights.py's `StoredTensor`. `hf_named_tensors` maps
GGUF names to the HF names the model code reads, undoing what llama.cpp's converter changed (llama's q/k rows
permuted for its rotary layout, gemma's norms stored + 1, mixture-of-experts weights stacked in 3-D).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

# The element types a load runs (quantized as stored, or dequantized for norms and biases).
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
QUANTIZED_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
SUPPORTED_TYPES = FLOAT_TYPES | QUANTIZED_TYPES
_ALIGNMENT_KEY = "general.alignment"
# GGUF metadata value types -> struct format: uint8, int8, uint16, int16, uint32, int32, float32, bool, (8: string,
# 9: array), uint64, int64, float64
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_SIZES = {kind: struct.calcsize(fmt) for kind, fmt in _SCALAR_FORMATS.items()}


class UnsupportedTensorType(ValueError):
    """A tensor stored in a type tokenmill can't run (IQ*, Q2_K, Q3_K, ...)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str
    shape: tuple[int, ...]  # rows first (torch order; the file lists dimensions innermost first)
    offset: int  # from the start of the file
    nbytes: int


def _read(file: BinaryIO, fmt: str) -> tuple[Any, ...]:
    return struct.unpack(fmt, file.read(struct.calcsize(fmt)))


def _read_string(file: BinaryIO) -> str:
    (length,) = _read(file, "<Q")
    return file.read(length).decode("utf-8", errors="replace")


def _skip_value(file: BinaryIO, kind: int) -> Any:
    """Reads a scalar (as its type: int, float or bool) or string value; skips over arrays (seeking past arrays
    of scalars) and returns None."""
    if kind == 6:  # float32, as the shortest decimal that reads back to it (1e-05, not 9.99999974738e-06)
        return float(str(np.float32(_read(file, "<f")[0])))
    if kind in _SCALAR_FORMATS:
        return _read(file, _SCALAR_FORMATS[kind])[0]
    if kind == 8:
        return _read_string(file)
    if kind == 9:
        item_kind, count = _read(file, "<IQ")
        if item_kind in _SCALAR_SIZES:
            file.seek(count * _SCALAR_SIZES[item_kind], 1)
        elif item_kind == 8:
            for _ in range(count):
                (length,) = _read(file, "<Q")
                file.seek(length, 1)
        else:
            for _ in range(count):
                _skip_value(file, item_kind)
        return None
    raise ValueError(f"unknown GGUF metadata value type {kind}")


def read_tensor_index(path: Path) -> list[TensorEntry]:
    """Every tensor's name, type, shape and place in the file, from the header alone."""
    return read_header(path)[1]


def gguf_architecture(path: Path) -> str:
    """general.architecture: llama.cpp's name for the model family ("llama", "qwen2", "gemma3", ...)."""
    return str(read_header(path)[0].get("general.architecture", ""))


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorEntry]]:
    """The scalar and string metadata (arrays skipped) and the tensor index, from the header alone (read once
    per file version: a tokenizer's vocabulary takes a second to skip)."""
    stat = path.stat()
    return _read_header(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_header(path: Path, _size: int, _mtime_ns: int) -> tuple[dict[str, Any], list[TensorEntry]]:
    metadata: dict[str, Any] = {}
    with open(path, "rb") as file:
        magic, version = _read(file, "<4sI")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2+ file")
        tensor_count, kv_count = _read(file, "<QQ")
        alignment = 32
        for _ in range(kv_count):
            key = _read_string(file)
            (kind,) = _read(file, "<I")
            value = _skip_value(file, kind)
            if value is not None:
                metadata[key] = value
            if key == _ALIGNMENT_KEY and isinstance(value, int):
                alignment = value
        infos = []
        for _ in range(tensor_count):
            name = _read_string(file)
            (dimensions,) = _read(file, "<I")
            dims = _read(file, f"<{dimensions}Q")
            type_code, offset = _read(file, "<IQ")
            infos.append((name, type_code, tuple(reversed(dims)), offset))
        data_start = -(-file.tell() // alignment) * alignment
    entries = []
    for name, type_code, shape, offset in infos:
        try:
            type_name = GGMLQuantizationType(type_code).name
        except ValueError:
            type_name = f"type {type_code}"
        nbytes = 0
        if type_name in SUPPORTED_TYPES:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            nbytes = rows * shape[-1] // block * block_bytes
        entries.append(TensorEntry(name, type_name, shape, data_start + offset, nbytes))
    return metadata, entries


def check_types(entries: list[TensorEntry], path: Path) -> None:
    """Raises UnsupportedTensorType naming the first tensor tokenmill can't run, before anything is read."""
    for entry in entries:
        if entry.type_name not in SUPPORTED_TYPES:
            raise UnsupportedTensorType(
                f"{path.name}: tensor {entry.name!r} is stored as {entry.type_name}, which tokenmill can't run; "
                f"supported GGUF types: {', '.join(sorted(SUPPORTED_TYPES))} (re-quantize it with llama-quantize, "
                f"e.g. to Q4_K_M)"
            )


@dataclass
class MappedFile:
    """The file mapped once, read-only; `release` hands a range's pages back once it has been packed, so a
    load's resident memory holds one tensor of the file at a time, not the whole file beside its packed copy."""

    path: Path
    _map: mmap.mmap = field(init=False)

    def __post_init__(self) -> None:
        with open(self.path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)

    def array(self, entry: TensorEntry) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 array [rows..., bytes per row] over the mapping."""
        buffer = np.frombuffer(self._map, dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
        row_bytes = entry.nbytes // max(1, int(np.prod(entry.shape[:-1])))
        return buffer.reshape(*entry.shape[:-1], row_bytes)

    def release(self, offset: int, nbytes: int) -> None:
        page = mmap.PAGESIZE
        start = offset // page * page
        end = -(-(offset + nbytes) // page) * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, min(end, len(self._map)) - start)

    def release_all(self) -> None:
        self.release(0, len(self._map))


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the GGUF stores it: raw blocks, rows along the first axis (a `StoredTensor`)."""

    stored: np.ndarray  # uint8 [rows..., bytes per row], a view of the mapped file
    type_name: str
    shape: tuple[int, ...]
    offset: float = 0.0  # added after dequantizing: -1 undoes gemma's norms stored as 1 + weight
    source: MappedFile | None = None  # the mapping and byte range it was read from, to hand its pages back
    span: tuple[int, int] = (0, 0)
    # The rows of `stored` this tensor is, in order (None: all, as stored). Picked as they are read, so
    # llama's reordered q/k cost no copy until packed chunk by chunk (a copy of each, held through the load,
    # was 0.38 GB at 8B).
    order: np.ndarray | None = None

    @property
    def raw(self) -> np.ndarray:
        """The blocks, rows in this tensor's order (a view of the file, or a copy where rows are reordered)."""
        return self.stored if self.order is None else self.stored[self.order]

    @property
    def stored_type(self) -> str:
        return self.type_name

    @property
    def qtype(self) -> GGMLQuantizationType:
        return GGMLQuantizationType[self.type_name]

    def dequantize(self) -> torch.Tensor:
        if self.type_name == "F32":
            values = self.raw.view(np.float32).reshape(self.shape)
        elif self.type_name == "F16":
            values = self.raw.view(np.float16).reshape(self.shape).astype(np.float32)
        else:
            values = gguf_dequantize(self.raw, self.qtype).reshape(self.shape)
        tensor = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
        return tensor + self.offset if self.offset else tensor

    def select_rows(self, index: torch.Tensor) -> GGUFTensor:
        rows = np.asarray(index.cpu().numpy(), dtype=np.int64)
        order = rows if self.order is None else self.order[rows]
        return replace(self, order=order, shape=(len(rows), *self.shape[1:]))

    def row_range(self, start: int, stop: int) -> GGUFTensor:
        """Rows start..stop-1 (no copy); where rows are as stored, `release` hands back only their pages."""
        shape = (stop - start, *self.shape[1:])
        if self.order is not None:
            return replace(self, order=self.order[start:stop], shape=shape)
        row_bytes = self.stored[0].nbytes if len(self.stored) else 0
        span = (self.span[0] + start * row_bytes, (stop - start) * row_bytes)
        return replace(self, stored=self.stored[start:stop], shape=shape, span=span)

    def expert(self, number: int) -> GGUFTensor:
        stored = self.raw[number]
        span = self.span if self.order is not None else (self.span[0] + number * stored.nbytes, stored.nbytes)
        return replace(self, stored=stored, order=None, shape=self.shape[1:], span=span)

    def release(self) -> None:
        """Hands the file pages it was read from back (once packed, the model never reads them again)."""
        if self.source is not None:
            self.source.release(*self.span)


def llama_rotary_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (convert_hf_to_gguf's `permute`: each head's
    rows interleaved as (pairs, 2) -> (2, pairs)); transformers' reverse permute, applied to row numbers."""
    numbers = torch.arange(rows)
    half = rows // heads // 2
    return numbers.reshape(heads, half, 2).transpose(1, 2).reshape(rows)


_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<which>gate|up|down)_exps\.(?P<suffix>weight|bias)$")


def hf_tensor_names(hf_config: Any, architecture: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (HF name, HF shape): gguf-py's name map for the file's architecture, in reverse over
    the names the HF model of this config has (built on the meta device: no memory), as transformers' GGUF
    loader maps them (its own walk builds the map once per submodule: half a minute at 1B)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise UnsupportedTensorType(f"gguf-py has no tensor names for architecture {architecture!r}")
    if not type(hf_config).model_type:  # the base class (engine.loader.kept_config): the family's own builds the model
        from transformers import AutoConfig

        settings = hf_config.to_dict()
        settings.pop("model_type", None)  # the class's: ""
        hf_config = AutoConfig.for_model(hf_config.model_type, **settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    name_map = get_tensor_name_map(arch, int(hf_config.num_hidden_layers))
    names = {}
    for hf_name, parameter in model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base) if suffix in ("weight", "bias") else None
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = (hf_name, tuple(parameter.shape))
    return names


def hf_named_tensors(
    entries: list[TensorEntry],
    mapped: MappedFile,
    hf_config: Any,
    architecture: str,
    names: dict[str, tuple[str, tuple[int, ...]]] | None = None,
) -> Iterator[tuple[str, GGUFTensor]]:
    """(HF name, stored tensor) for every tensor the model reads, with llama.cpp's conversions undone:
    llama's q/k rows put back in HF's order (by row selection: no dequantizing), gemma's norms - 1, dropped
    size-1 dims restored, and 3-D expert stacks given per expert under the HF names of a per-expert
    checkpoint. `names`: `hf_tensor_names` of this config and architecture, where the caller kept them."""
    if names is None:
        names = hf_tensor_names(hf_config, architecture)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    for entry in entries:
        name, shape = names.get(entry.name, ("", entry.shape))
        stored = mapped.array(entry)
        if shape != entry.shape and _without_ones(shape) == _without_ones(entry.shape):
            # ggml drops a tensor's trailing size-1 dims: llama-quantize writes a Qwen MoE's shared-expert gate
            # [1, hidden] as [hidden]
            stored = stored.reshape(*shape[:-1], stored.shape[-1])
        tensor = GGUFTensor(stored, entry.type_name, shape, 0.0, mapped, (entry.offset, entry.nbytes))
        if match := _EXPERTS.match(entry.name):
            layer, which, suffix = match["layer"], match["which"], match["suffix"]
            for number in range(entry.shape[0]):
                yield f"model.layers.{layer}.mlp.experts.{number}.{which}_proj.{suffix}", tensor.expert(number)
            continue
        if not name:
            continue
        if architecture == "llama" and entry.name.endswith((".attn_q.weight", ".attn_k.weight")):
            tensor = tensor.select_rows(
                llama_rotary_rows(entry.shape[0], heads if ".attn_q." in entry.name else kv_heads)
            )
        if architecture in ("gemma2", "gemma3", "nemotron") and "norm.weight" in entry.name:
            tensor = replace(tensor, offset=-1.0)
        yield name, tensor


def _without_ones(shape: tuple[int, ...]) -> list[int]:
    return [size for size in shape if size != 1]


_M_MMAP_THRESHOLD = -3  # <malloc.h> mallopt parameter


@contextlib.contextmanager
def freed_memory_returned() -> Iterator[None]:
    """While a load packs tensor after tensor, glibc gives every allocation over 256 KB its own mapping, so a
    freed intermediate goes back to the system at once instead of staying in the heap: the packed copies, the
    float32 chunks and the huge-page copy otherwise piled up to ~2x the packed model (1B Q4_K_M: RSS 2.2 GB
    for 0.76 GB of weights). Afterwards the threshold is glibc's dynamic ceiling (32 MB) and the heap is
    trimmed. A no-op off glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, 256 << 10)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        malloc_trim(0)
