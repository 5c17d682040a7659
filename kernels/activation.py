"""SiLU(gate) * up over a fused [gate | up] projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:  # [tokens, 2 * ffn] -> [tokens, ffn]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
