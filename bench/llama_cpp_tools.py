"""llama.cpp's own tools, for benches and tests that need GGUFs as users download them.

A user's GGUF was made by llama.cpp's `convert_hf_to_gguf.py` and `llama-quantize`; so are ours:
- `find_tools()` builds (once, cached by bench/build_llama_server.sh from the pinned llama-cpp-python sdist)
  or finds llama-server, llama-quantize and the llama.cpp sources (the converter and its gguf-py);
- `make_random_checkpoint()` writes a random-weight transformers Llama checkpoint of a real shape (bf16), with
  SmolLM2's tokenizer and chat template (read from the embedded model's GGUF);
- `convert_to_gguf()` and `quantize()` turn it into F16 / Q4_K_M / Q8_0 / ... files;
- `gguf_for(shape, "Q4_K_M")` does all three, cached.
Every step skips work whose output exists and writes through a temporary name, so an interrupted run never
leaves a half-written file behind that a later run would take as done. Speed does not depend on the weights'
values, so random weights of the right shape measure what a real model of that shape would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / "bench" / "build_llama_server.sh"
CACHE = Path(os.environ.get("TOKENMILL_BENCH_CACHE", Path.home() / ".cache" / "tokenmill-bench"))
MODELS = CACHE / "models"
SMOLLM2_VOCAB = 49_152


class ToolsUnavailable(RuntimeError):
    """llama.cpp's tools can't be had here (no compiler, no network for the sdist, ...): the message says why."""


@dataclass(frozen=True)
class LlamaCppTools:
    server: Path  # llama-server
    quantize: Path  # llama-quantize
    source: Path  # the llama.cpp tree: convert_hf_to_gguf.py and gguf-py/

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture shape; vocabulary and tokenizer are SmolLM2's (49,152 tokens)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = SMOLLM2_VOCAB

    @property
    def parameters(self) -> int:
        """Parameter count with tied embeddings (as Llama-3.2 1B and 3B are)."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        per_layer = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden


LLAMA_1B = ModelShape("llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192)  # Llama-3.2-1B
LLAMA_3B = ModelShape("llama-3b", hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192)  # Llama-3.2-3B
LLAMA_8B = ModelShape("llama-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336)  # Llama-3.1-8B
# Small enough to make, convert and serve in seconds; widths multiples of 256 so every k-quant applies.
TINY = ModelShape("llama-tiny", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512)
SHAPES = {shape.name: shape for shape in (TINY, LLAMA_1B, LLAMA_3B, LLAMA_8B)}


def find_tools(jobs: int = 2) -> LlamaCppTools:
    """llama.cpp's tools, built on first use (minutes, cached outside the repository)."""
    try:
        done = subprocess.run(["bash", str(BUILD_SCRIPT), str(jobs)], capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ToolsUnavailable(f"the llama.cpp build did not finish: {error}") from error
    if done.returncode != 0:
        raise ToolsUnavailable((done.stderr.strip().splitlines() or ["the llama.cpp build failed"])[-1])
    server = Path(done.stdout.strip().splitlines()[-1])
    # The script's layout: ROOT/{src,build or build-avx2/bin/llama-server}
    tools = LlamaCppTools(server=server, quantize=server.with_name("llama-quantize"), source=server.parents[2] / "src")
    for needed in (tools.quantize, tools.converter, tools.source / "gguf-py"):
        if not needed.exists():
            raise ToolsUnavailable(f"the llama.cpp build has no {needed}")
    return tools


def make_random_checkpoint(folder: Path, shape: ModelShape, seed: int = 0) -> Path:
    """A transformers Llama checkpoint of `shape` with random weights (bf16) and SmolLM2's tokenizer."""
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.loader import default_model_path

    embedded = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(embedded.parent), gguf_file=embedded.name)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    # Made in bf16 directly: a 3B shape in float32 would be 13 GB on the way.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    del model
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def convert_to_gguf(folder: Path, out: Path, outtype: str = "f16", tools: LlamaCppTools | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a checkpoint folder (`outtype`: f16, bf16, f32, q8_0)."""
    if out.exists():
        return out
    tools = tools or find_tools()
    partial = out.with_name(out.name + ".partial")
    gguf_py = str(tools.source / "gguf-py")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([gguf_py, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(tools.converter), str(folder), "--outfile", str(partial), "--outtype", outtype]
    _run(command, environment, f"convert_hf_to_gguf.py on {folder}")
    partial.rename(out)
    return out


def quantize(source: Path, out: Path, kind: str, threads: int = 2, tools: LlamaCppTools | None = None) -> Path:
    """llama-quantize `source` (an F16/BF16/F32 GGUF) into `kind` (Q4_K_M, Q8_0, Q4_0, Q6_K, ...)."""
    if out.exists():
        return out
    tools = tools or find_tools()
    partial = out.with_name(out.name + ".partial")
    _run([str(tools.quantize), str(source), str(partial), kind, str(threads)], None, f"llama-quantize {kind}")
    partial.rename(out)
    return out


def gguf_for(shape: ModelShape, kind: str = "Q4_K_M", models: Path = MODELS, keep_checkpoint: bool = True) -> Path:
    """`models/<shape>-<kind>.gguf`, made (once) from a random checkpoint through F16 and llama-quantize."""
    models.mkdir(parents=True, exist_ok=True)
    out = models / f"{shape.name}-{kind}.gguf"
    if out.exists():
        return out
    tools = find_tools()
    checkpoint = models / f"{shape.name}-hf"
    f16 = convert_to_gguf(make_random_checkpoint(checkpoint, shape), models / f"{shape.name}-F16.gguf", "f16", tools)
    if not keep_checkpoint:
        shutil.rmtree(checkpoint, ignore_errors=True)
    return f16 if kind.upper() == "F16" else quantize(f16, out, kind, tools=tools)


def header_only_gguf(template: Path, shape: ModelShape, out: Path) -> Path:
    """A GGUF of `shape` with `template`'s metadata and its tensor types (layer i takes the types of the
    template's layer at the same depth, so Q4_K_M's Q6_K layers recur), whose tensor data is a hole: a
    sparse file of the right size that takes no disk and reads as zeros. For what reads only headers (the
    registry's memory estimate), where making the real file (an 8B: 16 GB in bf16 on the way) is too much."""
    if out.exists():
        return out
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(template)
    arch = str(reader.fields["general.architecture"].contents())

    def number(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].contents())

    head_dim = number("embedding_length") // number("attention.head_count")
    overrides: dict[str, int] = {
        f"{arch}.embedding_length": shape.hidden,
        f"{arch}.block_count": shape.layers,
        f"{arch}.feed_forward_length": shape.ffn,
        f"{arch}.attention.head_count": shape.heads,
        f"{arch}.attention.head_count_kv": shape.kv_heads,
    }
    # A tensor's dimensions in the template are one of these widths: each becomes the shape's.
    widths = {
        number("embedding_length"): shape.hidden,
        number("attention.head_count_kv") * head_dim: shape.kv_heads * (shape.hidden // shape.heads),
        number("feed_forward_length"): shape.ffn,
        number("vocab_size") if f"{arch}.vocab_size" in reader.fields else shape.vocab: shape.vocab,
    }
    if len(widths) != 4:
        raise ValueError(f"{template}: its widths are not distinct, a shape can't be mapped from them")
    partial = out.with_name(out.name + ".partial")
    writer = GGUFWriter(partial, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, overrides.get(field.name, field.contents()), field.types[0], sub_type)
    layers = number("block_count")
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    names = [name for name in by_name if not name.startswith("blk.")]
    names += [
        f"blk.{layer}.{name.split('.', 2)[2]}"
        for layer in range(shape.layers)
        for name in by_name
        if name.startswith(f"blk.{layer * layers // shape.layers}.")
    ]
    data_bytes = 0
    for name in names:
        parts = name.split(".")
        source = by_name[
            f"blk.{int(parts[1]) * layers // shape.layers}.{'.'.join(parts[2:])}" if parts[0] == "blk" else name
        ]
        dimensions = [widths[int(size)] for size in source.shape]  # GGUF order: innermost first
        block, block_bytes = GGML_QUANT_SIZES[source.tensor_type]
        nbytes = int(np.prod(dimensions)) // block * block_bytes
        writer.add_tensor_info(name, dimensions[::-1], np.dtype(np.float32), nbytes, raw_dtype=source.tensor_type)
        data_bytes += GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    header = GGUFWriter.ggml_pad(partial.stat().st_size, writer.data_alignment)
    os.truncate(partial, header + data_bytes)  # the data: a hole
    partial.rename(out)
    return out


def _run(command: list[str], environment: dict[str, str] | None, what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{tail}")


if __name__ == "__main__":  # python bench/llama_cpp_tools.py SHAPE KIND  -> prints the GGUF's path
    sys.path.insert(0, str(ROOT))
    print(gguf_for(SHAPES[sys.argv[1]], sys.argv[2] if len(sys.argv) > 2 else "Q4_K_M"))
