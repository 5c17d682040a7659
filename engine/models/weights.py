"""What a model's constructor reads: HF-named weights, each a plain torch tensor or a tensor still in the form
its file stores it (a GGUF tensor in its quantized blocks, `StoredTensor`).

Model code reads weights only through the helpers here (`dense`, `make_linear`, `concat_rows`), so one model
class runs a safetensors folder and a GGUF file alike, and the loader decides what a stored tensor becomes
(repacked for the int kernels, or dequantized) without the model knowing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kernels.linear import Linear
from kernels.qlinear import Format, PackedLinear


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
    weight = concat_rows(parts)
    if quantization == "none":
        return Linear(weight.to(dtype), None if bias is None else bias.to(dtype))
    return PackedLinear(weight, LAYER_FORMATS[quantization], bias)
