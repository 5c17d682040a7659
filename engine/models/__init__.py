"""The decoder families tokenmill runs, and the one call a loader makes to build one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.models.decoder import DecoderForCausalLM
from engine.models.rope import rope_tables
from engine.models.shape import SUPPORTED_ARCHITECTURES, DecoderShape, UnsupportedModel, supported_list
from engine.models.weights import Weight


def model_for(
    hf_config: Any,
    weights: Mapping[str, Weight],
    dtype: torch.dtype | None = None,
    quantization: str = "none",
    device: torch.device | None = None,
) -> DecoderForCausalLM:
    """The model a config describes (UnsupportedModel, naming the architecture, for one tokenmill can't run)."""
    shape = DecoderShape.from_hf_config(hf_config)
    tables = {name: table.to(device or "cpu") for name, table in rope_tables(hf_config, shape).items()}
    return DecoderForCausalLM(shape, weights, tables, dtype=dtype, quantization=quantization)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DecoderForCausalLM",
    "DecoderShape",
    "UnsupportedModel",
    "model_for",
    "supported_list",
]
