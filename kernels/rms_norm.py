"""RMSNorm with an optional fused residual add, computed in float32 like the HF Llama reference."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels._triton import lazy_jit, next_power_of_2

if TYPE_CHECKING:
    import triton.language as tl


@lazy_jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    x_row_stride,
    residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype first: the reference normalises the stored residual.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=mask)
    hidden_f32 = x.to(tl.float32)
    variance = tl.sum(hidden_f32 * hidden_f32, axis=0) / hidden
    normed = (hidden_f32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        residual_rows, new_residual = rows, x
    else:
        residual_rows = residual.reshape(-1, hidden)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        residual_rows,
        weight.contiguous(),
        out,
        new_residual,
        rows.stride(0),
        residual_rows.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )
    return out, new_residual


def rms_norm_reference(
    x: torch.Tensor,  # [tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual); new_residual = x + residual (or x when there is none)."""
    if residual is not None:
        x = x + residual
    hidden = x.float()
    variance = hidden.pow(2).mean(-1, keepdim=True)
    normed = weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed, x
