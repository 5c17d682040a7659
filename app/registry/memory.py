"""Will a model fit? The memory a load takes, estimated from the weights' headers (no tensor is read),
against what this machine, or the container's cgroup, has available. A load that would not fit is
refused before it starts: otherwise the kernel's OOM killer takes the whole server, and every team's
traffic on it, down with the load.

A GGUF run quantized is read as stored: its estimate is the serving process's peak, measured part by part
(`stored_gguf_bytes`, `stored_gguf_runtime`): the server itself (python, torch, the tokenizer), the packed
weights' resident size (from each tensor's type: engine/gguf_repack.py's formats), then the larger of the
load's transient and the KV pool with a full step's activations. With its whole pool filled at once by prompts of
the longest context, in full steps (bench/realsize_bench.py --memory-only, `--max-step-seconds 0`: the largest
step the engine takes), a 1B / 3B Q4_K_M estimated at 2.73 / 4.11 GB peaked at 2.65-2.69 / 4.06 GB (2-core EPYC
Zen 4, 7 Dec). The pool's pages are resident only once written (kernels/huge_pages.py), so lighter use peaks
lower: 8 x 300-token prompts with default flags (a few hundred tokens a step on 2 cores) at 1.70 / 3.40 GB.
Otherwise the estimate is the load's peak: the checkpoint as read from disk, beside the weights in the serving
dtype (fused and packed copies are made while the read ones are alive), then the KV pool (its block
count or memory budget) and the CPU swap pool; or, the first time a GGUF is loaded, transformers'
float32 model and the copies it saves, if that is more; plus a margin. Measured on SmolLM2 loaded
beside another model: float32 with 128 / 4096 KV blocks peaked at 1.15 / 3.89 GiB (estimate before the
margin 1.09 / 3.81), bfloat16 at 0.75 / 1.96 GiB (estimate 0.80 / 2.16).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import psutil

from app.registry.files import open_regular
from app.registry.gguf_header import read_string, read_value
from app.registry.inspection import default_source_path
from app.registry.spec import DEFAULT_SOURCE, ModelSpec, RegistryError
from engine.config import DTYPES, EngineConfig
from engine.gguf_file import TensorEntry, read_header
from engine.gguf_repack import CHUNK_VALUES, is_packed_matrix, packed_linears
from engine.loader import converted_folder, resolve_quantization
from engine.models.decoder import MLP_ROWS
from kernels.cpu_attention import attention_piece_peak_bytes
from kernels.qlinear import BYTES_PER_VALUE

MARGIN = 1.1  # activations, the tokenizer, allocator slack
FLOAT32_BYTES = 4
GIB = 2**30


@dataclass(frozen=True)
class Footprint:
    parameters: int
    layers: int  # attention layers, counted by their key projections
    kv_width: int  # key (= value) features per token per layer: kv_heads x head_dim
    stored_bytes: int  # the tensors as stored (what reading them takes)


@dataclass(frozen=True)
class Estimate:
    read_bytes: int  # the checkpoint as read, before it becomes the serving weights (stored: the load's transient)
    weights_bytes: int
    kv_bytes: int
    conversion_bytes: int = 0  # a GGUF's first load: transformers' float32 model and what it saves
    # A GGUF run as stored is sized as the server's peak: the process itself (with the tokenizer) and the
    # largest step's activations, then no margin beyond STORED_MARGIN
    runtime_bytes: int = 0
    activation_bytes: int = 0
    stored: bool = False

    @property
    def total_bytes(self) -> int:
        if self.stored:  # the load's transient is gone before the KV pool is made
            serving = max(self.read_bytes, self.kv_bytes + self.activation_bytes)
            return math.ceil((self.runtime_bytes + self.weights_bytes + serving) * STORED_MARGIN)
        load = self.read_bytes + self.weights_bytes + self.kv_bytes
        return math.ceil(max(load, self.conversion_bytes) * MARGIN)

    def describe(self) -> str:
        if self.stored:
            return (
                f"about {self.total_bytes / GIB:.2f} GiB at its peak (the server and tokenizer "
                f"{self.runtime_bytes / GIB:.2f} GiB, the weights {self.weights_bytes / GIB:.2f} GiB, the KV cache "
                f"{self.kv_bytes / GIB:.2f} GiB, a full step's activations {self.activation_bytes / GIB:.2f} GiB, "
                f"plus {STORED_MARGIN - 1:.0%})"
            )
        parts = [
            f"the checkpoint as read {self.read_bytes / GIB:.2f} GiB",
            f"the weights {self.weights_bytes / GIB:.2f} GiB",
            f"the KV cache {self.kv_bytes / GIB:.2f} GiB",
        ]
        if self.conversion_bytes:
            parts.append(f"or converting the GGUF first {self.conversion_bytes / GIB:.2f} GiB")
        return f"about {self.total_bytes / GIB:.2f} GiB at its peak ({', '.join(parts)}, plus {MARGIN - 1:.0%})"


def safetensors_footprint(folder: Path) -> Footprint | None:
    """From the JSON headers of a folder's *.safetensors files; None when there are none or one is unreadable."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    parameters = layers = kv_width = stored = 0
    for path in files:
        try:
            with open_regular(path) as file:
                (length,) = struct.unpack("<Q", file.read(8))
                if length > 100 * 2**20:
                    return None
                header = json.loads(file.read(length))
        except (OSError, struct.error, ValueError):
            return None
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            parameters += math.prod(entry.get("shape", ()))
            start, end = entry.get("data_offsets", (0, 0))
            stored += end - start
            if name.endswith("self_attn.k_proj.weight"):
                layers += 1
                kv_width = entry["shape"][0]
    return Footprint(parameters, layers, kv_width, stored)


def gguf_footprint(path: Path) -> Footprint | None:
    """From a GGUF file's tensor index (after its metadata); None when the file can't be read."""
    try:
        with open_regular(path) as file:
            magic, version = struct.unpack("<4sI", file.read(8))
            if magic != b"GGUF" or version < 2:
                return None
            tensors, kv_count = struct.unpack("<QQ", file.read(16))
            for _ in range(kv_count):
                read_string(file)
                read_value(file, struct.unpack("<I", file.read(4))[0])
            parameters = layers = kv_width = 0
            for _ in range(tensors):
                name = read_string(file)
                (dimensions,) = struct.unpack("<I", file.read(4))
                shape = struct.unpack(f"<{dimensions}Q", file.read(8 * dimensions))
                file.read(12)  # the element type and the data offset
                parameters += math.prod(shape)
                if name.endswith("attn_k.weight") and len(shape) == 2:
                    layers += 1
                    kv_width = shape[1]  # GGUF lists dimensions innermost first
    except (OSError, struct.error, ValueError):
        return None
    return Footprint(parameters, layers, kv_width, parameters * FLOAT32_BYTES)  # as converted: float32


# What a server holds besides the weights, the KV pool and its steps' activations: python, torch, the server's
# modules, the kernels' libraries, thread stacks and allocator slack (`tokenmill serve --model FILE`, 1B Q4_K_M,
# settled after its first start or a restart alike: RSS 2.14 GB less the packed weights 0.68 GB, the KV pool
# 1.07 GB and the tokenizer below, 0.28 GB on a 2-core EPYC Zen 3; the embedding model now loads on first use
# and transformers' model code stays in a child, engine/gguf_prepare.py), with ~40 MiB spare for machines whose
# libraries touch more pages; and the tokenizer per vocabulary entry (SmolLM2's 49,152-token BPE took 0.10
# GiB). Counted for every load (one beside another model shares the process: its check is that much cautious).
STORED_RUNTIME_BYTES = 300 * 2**20
TOKENIZER_BYTES_PER_TOKEN = 2200
# A step's activations, in elements of the activation dtype: ~8 x hidden a token (the residual, the normed
# input, q/k/v, the attention's output) and the MLP's 3 x FFN a row for MLP_ROWS rows at a time
# (engine/models/decoder.py; all of the step's rows for a mixture of experts); and what the allocator keeps of
# them between steps. Served, 8 x 300-token prompts at once in full 2048-token steps: +0.22 to +0.36 GB over
# the settled RSS at 1B (0.18 GB of it live in the step), +0.34 GB at 3B (+0.30 / +0.34 GB on 7 Dec).
ACTIVATION_KEPT = 1.75
ATTENTION_KEPT = 1.3
STORED_MARGIN = 1.02  # against a measured peak: never below it


def stored_gguf_bytes(entries: list[TensorEntry], quantization: str) -> tuple[int, int]:
    """(resident bytes of the packed weights, the load's transient bytes) for a GGUF run as stored
    (engine/gguf_repack.py): each fused linear in its packed format (int4k / int6k for Q4_K / Q6_K as stored, int4
    for other 4-bit types under int4, else int8 in groups of 32); float tensors (norms) in float32. Each linear
    is packed chunk of rows by chunk (no whole tensor's codes or float32 intermediates exist), the file's pages
    handed back as it goes; then every packed linear is copied into one buffer (kernels.qlinear.move_together),
    one at a time: the transient is the largest linear's copy and a chunk's intermediates (1B Q4_K_M: its tied
    head, 0.08 GB, and ~0.04 GB)."""
    resident = sum(math.prod(entry.shape) * FLOAT32_BYTES for entry in entries if not is_packed_matrix(entry))
    largest = 0
    for fmt, values in packed_linears(entries, quantization):
        packed = math.ceil(values * BYTES_PER_VALUE[fmt])
        resident += packed
        largest = max(largest, packed)
    return resident, largest + 40 * CHUNK_VALUES


def stored_gguf_runtime(entries: list[TensorEntry], config: EngineConfig) -> tuple[int, int]:
    """(the server and its tokenizer, the largest step's activations) for a GGUF run as stored, from its
    shapes: the vocabulary and hidden width from the embedding, the MLP's width from its up projection."""
    shapes = {entry.name: entry.shape for entry in entries}
    vocab, hidden = shapes.get("token_embd.weight", (0, 0))[:2]
    ups = [shape for name, shape in shapes.items() if ".ffn_up" in name and len(shape) >= 2]
    ffn = max((shape[-2] for shape in ups), default=4 * hidden)
    tokens = config.max_num_batched_tokens
    mlp_rows = tokens if any(len(shape) == 3 for shape in ups) else min(tokens, MLP_ROWS)  # experts: unchunked
    elements = tokens * 8 * hidden + mlp_rows * 3 * ffn
    activations = math.ceil(elements * DTYPES[config.dtype].itemsize * ACTIVATION_KEPT)
    return STORED_RUNTIME_BYTES + vocab * TOKENIZER_BYTES_PER_TOKEN, activations


def longest_attention_bytes(
    context: int, heads: int, kv_width: int, kv_element: int, element: int, config: EngineConfig
) -> int:
    """A full step's chunk of a prompt attending the longest context (kernels/cpu_attention.py), one layer at a
    time: the context's keys and values gathered from the pool and widened to the activations' type, and one
    piece of the chunk's queries' float scores or mask; and what the allocator keeps of them. In process, full
    steps of 8,000- and 2,040-token prompts peaked 0.13-0.15 GB above those of 8 x 300-token ones at 1B Q4_K_M,
    when the whole chunk's mask was copied to float (bench/realsize_bench.py --memory-only fills the pool with the
    longest)."""
    queries = min(config.max_num_batched_tokens, context)
    tensors = 2 * context * kv_width * (kv_element + element) + attention_piece_peak_bytes(queries, heads, context)
    return math.ceil(tensors * ATTENTION_KEPT)


def estimate(spec: ModelSpec, base: EngineConfig) -> Estimate | None:
    """What loading `spec` takes, or None where the weights' size can't be told from their headers."""
    if spec.kind == "embedding":
        folder = default_source_path("embedding") if spec.source == DEFAULT_SOURCE else Path(spec.source)
        footprint = safetensors_footprint(folder)
        if footprint is None:
            return None
        return Estimate(footprint.stored_bytes, footprint.parameters * DTYPES[spec.dtype].itemsize, 0)

    config = spec.engine_config(base)
    quantization = resolve_quantization(config)
    source = default_source_path("chat") if spec.source == DEFAULT_SOURCE else Path(spec.source)
    stored: tuple[int, int] | None = None
    if source.is_file() and quantization != "none":  # a GGUF run as stored: never converted
        try:
            metadata, entries = read_header(source)
        except (OSError, ValueError, struct.error):
            return None
        stored = stored_gguf_bytes(entries, quantization)
        runtime, activations = stored_gguf_runtime(entries, config)
        footprint = gguf_footprint(source)
    conversion = 0
    if stored is None:
        converted = converted_folder(config)
        if converted is not None:
            footprint = safetensors_footprint(converted)
        else:  # a GGUF converted on this load: transformers holds it in float32 meanwhile
            footprint = gguf_footprint(source)
            if footprint is not None:
                conversion = 2 * footprint.parameters * FLOAT32_BYTES
    if footprint is None:
        return None
    element = DTYPES[config.dtype].itemsize
    kv_element = config.kv_torch_dtype(quantization).itemsize
    bytes_per_block = 2 * footprint.layers * footprint.kv_width * config.block_size * kv_element
    # As engine/runner.py sizes them: a block count wins over the budget; swap mode adds a CPU pool.
    device_blocks = config.num_kv_blocks or max(2, int(config.kv_cache_memory_gb * GIB // max(bytes_per_block, 1)))
    kv = device_blocks * bytes_per_block
    if config.preemption_mode == "swap":
        kv += (config.num_cpu_blocks or device_blocks) * bytes_per_block
    if stored is not None:
        architecture = metadata.get("general.architecture")
        context = int(metadata.get(f"{architecture}.context_length") or 4096)
        context = min(config.max_model_len or context, context, device_blocks * config.block_size)
        # the query heads (absent: kv_width, more than any model has)
        heads = int(metadata.get(f"{architecture}.attention.head_count") or footprint.kv_width)
        activations += longest_attention_bytes(context, heads, footprint.kv_width, kv_element, element, config)
        return Estimate(stored[1], stored[0], kv, runtime_bytes=runtime, activation_bytes=activations, stored=True)
    return Estimate(footprint.stored_bytes, footprint.parameters * element, kv, conversion)


def available_bytes() -> int:
    """Memory a load may still take: the machine's available memory, or less where a cgroup caps us."""
    available: int = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def check_memory_fits(spec: ModelSpec, base: EngineConfig) -> Estimate | None:
    """Refuses (insufficient_memory) a load that would not fit; TOKENMILL_SKIP_MEMORY_CHECK=1 skips it."""
    if os.environ.get("TOKENMILL_SKIP_MEMORY_CHECK") == "1" or _on_gpu(spec, base):
        return None
    needed = estimate(spec, base)
    if needed is None:
        return None
    available = available_bytes()
    if needed.total_bytes > available:
        raise RegistryError(
            f"not enough memory to load {spec.name!r}: it needs {needed.describe()}, and "
            f"{available / GIB:.2f} GiB is available. Unload a model, lower its num_kv_blocks or "
            f"kv_cache_memory_gb, or serve it in bfloat16.",
            param="engine_settings",
            code="insufficient_memory",
        )
    return needed


def _on_gpu(spec: ModelSpec, base: EngineConfig) -> bool:
    if spec.kind != "chat" or base.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()  # the weights and the KV pool go to the GPU, not this RAM
