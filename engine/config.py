"""Engine settings: read once at the edge (CLI / env), validated here, passed down frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZATIONS = ("none", "int8", "int4", "auto")  # weight-only: kernels/qlinear.py; auto: engine.loader
KV_LAYOUTS = ("auto", "heads_major", "token_major")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
SPECULATIONS = ("auto", "ngram", "off")  # engine/speculation.py


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when torch sees a GPU, else the CPU), 'cpu', 'cuda' or 'cuda:N'."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} was asked for, but torch {torch.__version__} sees no CUDA device "
            "(a CPU-only build of torch, or no GPU/driver); use --device cpu or auto"
        )
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} was asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return torch.device("cuda", index)


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
    # A step's budget also shrinks to about this many seconds of measured work (engine/step_budget.py): a
    # request arriving mid-step waits at most about this long before its prompt is scheduled. 0: tokens only.
    max_step_seconds: float = 1.0
    max_model_len: int | None = None  # default: the checkpoint's max positions
    max_waiting: int = 1024
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # fair: the least-served team's request goes first (engine/fair_share.py); fcfs: arrival order.
    scheduling: Literal["fair", "fcfs"] = "fair"
    # A request preempted so that another team gets its turn has run at least this many steps.
    fair_min_run_steps: int = 8
    fair_prompt_weight: float = 1.0  # service charged per prompt token ...
    fair_output_weight: float = 2.0  # ... and per generated token (VTC's weights)
    enable_prefix_caching: bool = True
    data_dir: str = ".tokenmill"  # where converted weights are cached
    num_threads: int | None = None
    served_model_name: str | None = None
    device: str = "auto"  # "auto" = cuda when available, else cpu; "cpu", "cuda", "cuda:N"
    enforce_eager: bool = False  # on CUDA: no CUDA-graph replay of decode steps
    kv_layout: Literal["auto", "heads_major", "token_major"] = "auto"  # auto: heads-major on the CPU
    # The KV cache's element type. "auto": the activations' (dtype), except bfloat16 under float32 activations
    # with int8/int4 weights on the CPU, where no token-exactness against HF is promised: half the bytes per
    # token, so twice the tokens fit in kv_cache_memory_gb, and decode steps at many sequences, which read
    # every sequence's whole cache, read half as much (kv_torch_dtype below).
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Weight-only quantization of the linears (and of a tied embedding), CPU only: "int8" per output
    # channel, "int4" in groups of 32 with the embedding as int8 per 32 (GGUF Q4_1 / Q8_0 style).
    # "auto" (the server's default): int4 where that loses nothing, else none (engine.loader).
    quantization: Literal["none", "int8", "int4", "auto"] = "none"
    # Prompt-lookup speculative decoding (engine/speculation.py): "ngram" drafts from each sequence's own
    # text and verifies the drafts in its decode step; "auto" does so in float32 except where decode steps
    # replay CUDA graphs (engine/speculation.py says why); "off".
    speculation: Literal["auto", "ngram", "off"] = "auto"
    num_speculative_tokens: int = 4  # drafts per sequence and step (k; the step verifies k + 1 rows)
    # LoRA adapters (engine/lora.py): at most this many resident at once (loaded on first use, the least
    # recently used idle one evicted), and the largest rank registration accepts.
    max_loras: int = 4
    max_lora_rank: int = 64
    speculation_max_batch: int = 4  # drafts only while at most this many sequences run: at larger
    # batches the linears are no longer bound by reading the weights, and extra rows stop being free

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
        if not self.max_step_seconds >= 0:
            raise ValueError("max_step_seconds must be at least 0")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError("preemption_mode must be 'recompute' or 'swap'")
        if self.scheduling not in ("fair", "fcfs"):
            raise ValueError("scheduling must be 'fair' or 'fcfs'")
        if self.fair_min_run_steps < 1:  # a request swapped in this step can't be swapped out in the same one
            raise ValueError("fair_min_run_steps must be at least 1")
        if not (self.fair_prompt_weight >= 0 and self.fair_output_weight > 0):
            raise ValueError("fair_prompt_weight must be at least 0 and fair_output_weight positive")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "float32" and self.dtype == "bfloat16":
            raise ValueError("kv_cache_dtype float32 under bfloat16 activations would only add bytes: use auto")
        if self.kv_cache_dtype not in ("auto", self.dtype) and self.torch_device.type != "cpu":
            raise ValueError("a KV cache dtype other than the activations' runs on the CPU kernels only")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization in ("int8", "int4") and self.torch_device.type != "cpu":
            raise ValueError("quantization int8/int4 runs on the CPU kernels only: use --quantization none on a GPU")
        if self.speculation not in SPECULATIONS:
            raise ValueError(f"speculation must be one of {SPECULATIONS}, got {self.speculation!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if not 1 <= self.max_lora_rank <= 256:
            raise ValueError("max_lora_rank must be between 1 and 256")
        if self.speculation_max_batch < 1:
            raise ValueError("speculation_max_batch must be at least 1")
        if self.torch_device.type == "cuda" and self.kv_layout == "heads_major":
            raise ValueError("the CUDA kernels read a token-major KV cache: kv_layout 'heads_major' is CPU-only")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def kv_torch_dtype(self, quantization: str) -> torch.dtype:
        """The KV pool's element type under the quantization a load applied (engine.loader.resolve_quantization).
        "auto" stores bfloat16 under float32 activations with packed (int8/int4) weights on the CPU: those are
        held to agreement and perplexity bounds against bf16, not to token-exactness against HF, and a decode
        step at 64 sequences of ~300 tokens reads ~0.9 GB of float32 keys and values (its attention took
        ~55 ms of a ~120 ms step on a 2-core EPYC; ~35-45 ms from bfloat16). Values are rounded once, as
        stored, and widened to float32 as read, so a sequence's cache holds the same bits whatever ran beside
        it. Unquantized float32 keeps float32: it is the mode that is exact against HF."""
        if self.kv_cache_dtype != "auto":
            return DTYPES[self.kv_cache_dtype]
        packed = quantization in ("int8", "int4")
        if packed and self.dtype == "float32" and self.torch_device.type == "cpu":
            return torch.bfloat16
        return self.torch_dtype

    @property
    def heads_major_kv(self) -> bool:
        """The CPU attention paths gather heads-major blocks without copies; the Triton kernels want token-major."""
        return self.kv_layout == "heads_major" or (self.kv_layout == "auto" and self.torch_device.type == "cpu")
