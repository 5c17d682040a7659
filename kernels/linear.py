"""Linear layers with weights prepared once at load time for the device's fastest matmul.

On the CPU the weight is reordered once into oneDNN's blocked layout, float32 and bfloat16 alike.
bench/linear_bench.py, SmolLM2 shapes, 2 threads, this project's AMD EPYC machines:
- float32: F.linear runs MKL's sgemm, which takes a slow path on these CPUs, worst at 2 to 16 rows.
  Packed oneDNN is about 2x faster from 2 rows up (64 rows: 163 -> 337 GFLOP/s for qkv, and
  117 -> 410 for the 49152-wide logits). At 1 row it is slower for the layer weights but 3x faster for
  the logits; a whole single-sequence decode step still got faster (38 -> 24 ms). It sums in another
  order than MKL (about 1e-6 relative); greedy output still equals HF transformers token for token
  (tests/test_engine_correctness.py).
- bfloat16: bit-equal to F.linear (oneDNN runs both), which reorders the weight on every call:
  1.1-1.3x at decode shapes, within 6% at 2048 rows.

oneDNN builds and caches a primitive per row count it meets, and each holds scratch memory that grows
with the rows: fed every row count from 1 to 2100 unbucketed, the process grew by gigabytes, and the CI
soak test's flat-memory check failed. So rows are padded up to one of a few buckets and longer inputs
run in chunks of CHUNK_ROWS: over every row count 1..2100 the process grows by about 120 MB once
(F.linear: 60 MB), then stays flat.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ROWS = 1024
# (up to this many rows, round up to a multiple of this): padding stays under 8 rows or a quarter of the rows.
_BUCKET_STEPS = ((2, 1), (4, 4), (64, 8), (128, 16), (256, 32), (512, 64), (CHUNK_ROWS, 128))


def bucket_rows(rows: int) -> int:
    """The row count a chunk of `rows` rows is padded to; every result is one of few."""
    for limit, step in _BUCKET_STEPS:
        if rows <= limit:
            return -(-rows // step) * step
    raise ValueError(f"{rows} rows is more than a chunk of {CHUNK_ROWS}")


def can_pack(weight: torch.Tensor) -> bool:
    if weight.is_cuda or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x @ weight.T + bias; `weight` is [out_features, in_features] as in the checkpoint."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rows_hint: int = 64) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight.contiguous()
        if can_pack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows_hint)
                self.weight = None  # the packed copy replaces it: no second copy of the weights in memory
            except RuntimeError:
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        if num_rows <= CHUNK_ROWS:
            out = self._packed_chunk(rows)
        else:
            out = torch.cat(
                [self._packed_chunk(rows[start : start + CHUNK_ROWS]) for start in range(0, num_rows, CHUNK_ROWS)]
            )
        return out.view(*x.shape[:-1], self.out_features)

    def _packed_chunk(self, rows: torch.Tensor) -> torch.Tensor:
        num_rows = rows.shape[0]
        padded_rows = bucket_rows(num_rows)
        if padded_rows != num_rows:
            padded = rows.new_empty(padded_rows, self.in_features)
            padded[:num_rows] = rows
            padded[num_rows:] = 0
            rows = padded
        elif not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out[:num_rows] if padded_rows != num_rows else out
