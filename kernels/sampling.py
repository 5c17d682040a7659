"""One sampled token per row (temperature, top-k, top-p, min-p, one inverse-CDF draw): the native CPU kernel
(kernels/csrc/sample_cpu.cpp) and the plain torch reference it is checked against.

The engine's sampler (engine/sampler.py) calls `sample_native` for rows without drafts when
`sample_available` says the kernel is built; its own torch path (the same semantics, vectorised over rows)
runs otherwise. `uniform` carries each row's draw in [0, 1), so seeded rows stay reproducible.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from functools import cache
from typing import cast

import torch

from kernels.cpu_native import library

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tokenmill_sample_f32": [_P, _I64, _I64, _I64, *([_P] * 7), _I],
    "tokenmill_argmax_f32": [_P, _I64, _I64, _I64, _P],
}


@cache
def _function(name: str) -> Callable[..., None] | None:
    native = library("sample_cpu")
    if native is None:
        return None
    function = getattr(native, name)
    function.restype = None
    function.argtypes = _SIGNATURES[name]
    return cast(Callable[..., None], function)


def argmax_native(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum, as torch.argmax(dim=-1) (NaNs are passed over, not taken)."""
    function = _function("tokenmill_argmax_f32")
    if function is None:
        raise RuntimeError("the native sampler is not built (kernels.sampling.sample_available)")
    logits, row_stride = _rows_in_place(logits)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    function(logits.data_ptr(), logits.shape[0], logits.shape[1], row_stride, tokens.data_ptr())
    return tokens


def _rows_in_place(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows as the kernels read them (unit stride inside a row, one stride between rows) and that stride."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or (rows > 1 and logits.stride(0) not in (0, vocab)):
        logits = logits.contiguous()
    return logits, logits.stride(0) if rows > 1 else vocab


def sample_available(logits: torch.Tensor) -> bool:
    return (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and not logits.is_cuda
        and logits.shape[1] < 2**31
        and _function("tokenmill_sample_f32") is not None
    )


def sample_native(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    uniform: torch.Tensor,
    with_probabilities: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [rows] int64, and with `with_probabilities` the distribution each row drew from [rows, vocab])."""
    function = _function("tokenmill_sample_f32")
    if function is None:
        raise RuntimeError("the native sampler is not built (kernels.sampling.sample_available)")
    rows, vocab = logits.shape
    logits, row_stride = _rows_in_place(logits)
    # ctypes arrays, not tensors: a step's small torch calls run with cold caches (~10-80 us each)
    settings = (
        (ctypes.c_float * rows)(*temperature),
        (ctypes.c_int64 * rows)(*top_k),
        (ctypes.c_float * rows)(*top_p),
        (ctypes.c_float * rows)(*min_p),
    )
    draws = uniform.to(torch.float32).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    probabilities = torch.empty(rows, vocab) if with_probabilities else None
    function(
        logits.data_ptr(),
        rows,
        vocab,
        row_stride,
        *settings,
        draws.data_ptr(),
        tokens.data_ptr(),
        probabilities.data_ptr() if probabilities is not None else None,
        torch.get_num_threads(),
    )
    return tokens, probabilities


def sample_reference(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The obvious version, a row at a time: sort everything, cut at k, at the nucleus and at min-p (ties at
    each edge kept), then the first token in vocabulary order whose cumulative probability reaches 1 - u."""
    tokens, distributions = [], []
    for row, temp, k, p, mp, u in zip(logits.float(), temperature, top_k, top_p, min_p, uniform.tolist()):
        scaled = (row - row.max()) / temp
        ordered = scaled.sort(descending=True).values
        floor = -math.inf
        if 0 < k < len(ordered):
            ordered = ordered[:k]
            floor = ordered[-1].item()
        if p < 1.0:
            # in double: a float running sum over a flat row's 49k tokens moves a p = 0.999 edge by dozens
            probs = ordered.double().softmax(dim=-1)
            kept = max(1, int(((probs.cumsum(dim=-1) - probs) < p).sum()))
            floor = max(floor, ordered[kept - 1].item())
        if mp > 0.0:
            floor = max(floor, math.log(mp))
        weights = torch.where(scaled >= floor, scaled.exp(), torch.zeros(()))
        distribution = weights / weights.sum()
        cumulative = distribution.cumsum(dim=0)
        chosen = int(torch.searchsorted(cumulative, torch.tensor([1.0 - u])).clamp(max=len(row) - 1))
        while distribution[chosen] == 0:  # rounding put the target past the last kept token
            chosen -= 1
        tokens.append(chosen)
        distributions.append(distribution)
    return torch.tensor(tokens, dtype=torch.int64), torch.stack(distributions)
