"""The new families from a GGUF made by llama.cpp's convert_hf_to_gguf.py: run as stored (Q8_0 -> int8) and
converted (F32 -> float), greedy tokens equal transformers' on the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from tests.engine.test_architectures import FAMILIES, TINY
from tests.support.engine import QUESTIONS, chat_prompt, make_engine, run_to_completion
from tests.support.gguf_files import llama_cpp_tools

NEW_TOKENS = 12
# Not gemma2/gemma3: llama.cpp's converter wants a SentencePiece tokenizer.model for Gemma (SmolLM2's is BPE).
# Not qwen3_moe: the converter (0.3.36) failed in prepare_tensors on the tiny checkpoint with a dense layer.
GGUF_FAMILIES = ["qwen3"]


def tiny_checkpoint(folder: Path, family: str, tokenizer: Any) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    # std 0.1: the int kernels quantize activations; 0.5 blows them up into greedy near-ties (tests/support/gguf_files)
    settings = {**TINY, "vocab_size": len(tokenizer), **FAMILIES[family], "initializer_range": 0.1}
    # transformers reads a GGUF's config without its attention.key_length, so a head_dim other than
    # hidden / heads comes back as the family's default and neither it nor we can load the file: not tested here
    if family == "qwen3":
        settings.pop("head_dim")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **settings), dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.3 + (0.0 if family.startswith("gemma") else 1.0))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


@pytest.fixture(scope="module", params=GGUF_FAMILIES)
def family_checkpoint(request, tmp_path_factory, smollm2) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    return request.param, tiny_checkpoint(folder / "hf", request.param, smollm2.tokenizer)


@pytest.mark.parametrize(("outtype", "runs_as"), [("q8_0", "int8"), ("f32", "none")])
def test_a_converted_gguf_gives_transformers_greedy_tokens(family_checkpoint, tmp_path, outtype, runs_as):
    from transformers import AutoModelForCausalLM

    from bench.llama_cpp_tools import convert_to_gguf

    family, checkpoint = family_checkpoint
    tools = llama_cpp_tools()
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = convert_to_gguf(checkpoint, folder / f"tiny-{family}-{outtype}.gguf", outtype, tools)
    config = EngineConfig(model=str(path), quantization="auto", dtype="float32", data_dir=str(tmp_path / "data"))
    loaded = load_model(config)
    assert loaded.model.quantization == runs_as and loaded.shape.model_type == family
    prompts = [chat_prompt(loaded.tokenizer, question) for question in QUESTIONS[:3]]
    engine = make_engine(loaded, quantization=runs_as, num_kv_blocks=64)
    results = run_to_completion(engine, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32).eval()
    for number, prompt in enumerate(prompts):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=2,
            )
        assert results[f"r{number}"][0] == out[0, len(prompt) :].tolist(), f"{family} {outtype} prompt {number}"
