"""GGUFs made as users' downloads are made: a tiny random Llama converted by llama.cpp's convert_hf_to_gguf.py
and quantized by its llama-quantize (bench/llama_cpp_tools.py builds or finds them), cached per test session.

Widths are multiples of 256, so every k-quant applies; weights are drawn at std 0.1: wider (0.5) blows the
activations up until the int kernels' 16-bit quantization of x flips greedy near-ties against float32."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.llama_cpp_tools import LlamaCppTools, ToolsUnavailable, convert_to_gguf, find_tools
from tests.support.engine import tiny_llama_checkpoint


def llama_cpp_tools() -> LlamaCppTools:
    """llama.cpp's tools, or the test skipped saying why they can't be had (.ci/run builds them)."""
    try:
        return find_tools()
    except ToolsUnavailable as error:
        pytest.skip(f"llama.cpp's converter and llama-quantize can't be had here: {error}")


class GGUFMaker:
    """`path(kind)`: the tiny Llama as a GGUF of llama-quantize's `kind` (Q4_K_M, Q8_0, ...), made once."""

    def __init__(self, root: Path, tools: LlamaCppTools, tokenizer: object) -> None:
        self.root = root
        self.tools = tools
        checkpoint = tiny_llama_checkpoint(
            root / "tiny-llama-hf",
            tokenizer,
            hidden_size=256,
            intermediate_size=512,
            tie_word_embeddings=False,  # an untied head: the embedding and the head both read from the file
            initializer_range=0.1,  # activations in a range the int kernels quantize x finely in (0.5 blew up)
        )
        self.f32 = convert_to_gguf(checkpoint, root / "tiny-llama-F32.gguf", "f32", tools)

    def path(self, kind: str, pure: bool = True) -> Path:
        """`pure`: every matrix in `kind`'s type (llama-quantize --pure), else its usual mixture (Q4_K_M keeps
        attn_v, half of ffn_down and the head in Q6_K)."""
        if kind == "F32":
            return self.f32
        name = f"{kind}-pure" if pure else kind
        folder = self.root / name  # one file per folder: transformers loads a GGUF by folder and file name
        out = folder / f"tiny-llama-{name}.gguf"
        if not out.exists():
            folder.mkdir(exist_ok=True)
            options = ["--pure"] if pure else []
            command = [str(self.tools.quantize), *options, str(self.f32), str(out), kind, "2"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-2000:]
        return out
