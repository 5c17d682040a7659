"""SiLU(gate) * up over a fused [gate | up] projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels._triton import lazy_jit, next_power_of_2

if TYPE_CHECKING:
    import triton.language as tl


@lazy_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, ffn, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ffn
    x_row = x_ptr + row.to(tl.int64) * x_row_stride
    gate = tl.load(x_row + cols, mask=mask).to(tl.float32)
    up = tl.load(x_row + ffn + cols, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row.to(tl.int64) * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    ffn = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * ffn)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], ffn, dtype=x.dtype, device=x.device)
    block = min(next_power_of_2(ffn), 1024)
    grid = (rows.shape[0], (ffn + block - 1) // block)
    _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), ffn, BLOCK=block)
    return out.view(*x.shape[:-1], ffn)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:  # [tokens, 2 * ffn] -> [tokens, ffn]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
