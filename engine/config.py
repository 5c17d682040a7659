"""Engine settings: read once at the edge (CLI / env), validated here, passed down frozen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # "default" = embedded SmolLM2, else a HF folder or a .gguf file
    dtype: Literal["float32", "bfloat16"] = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; wins over kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    num_cpu_blocks: int | None = None  # swap pool; default = same as the device pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the checkpoint's max positions
    max_waiting: int = 1024
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    enable_prefix_caching: bool = True
    data_dir: str = ".tokenmill"  # where converted weights are cached
    num_threads: int | None = None
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be one of 8, 16, 32, 64, 128")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError("preemption_mode must be 'recompute' or 'swap'")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
