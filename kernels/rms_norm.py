"""RMSNorm with an optional fused residual add, computed in float32 like the HF Llama reference."""
from __future__ import annotations

import torch


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
