"""Loading a registered model into memory, and the specs of models loaded some other way: blocking
work the pool runs in threads, kept apart from its bookkeeping."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from app.registry.inspection import default_source_path, inspect_source
from app.registry.spec import DEFAULT_SOURCE, ModelSpec, RegistryError
from engine.config import DTYPES, EngineConfig

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine


def start_serving(spec: ModelSpec, base: EngineConfig) -> dict[str, Any]:
    """Blocking: start a chat engine, or load an embedding model; ServedModel's keyword arguments."""
    if spec.kind == "chat":
        from engine.async_engine import AsyncEngine

        return {"engine": AsyncEngine.start(spec.engine_config(base))}
    from engine.embeddings import EmbeddingModel

    path = default_source_path("embedding") if spec.source == DEFAULT_SOURCE else spec.source
    return {"embedder": EmbeddingModel.load(path, dtype=DTYPES.get(spec.dtype, torch.float32), name=spec.name)}


def preloaded_spec(engine: AsyncEngine) -> ModelSpec:
    """The registry entry for an engine started outside the pool, from its own settings."""
    config = engine.config
    source = config.model if config.model == DEFAULT_SOURCE else str(Path(config.model).expanduser().resolve())
    try:
        facts = inspect_source("chat", source)
        architecture, sampling_defaults = facts.architecture, facts.sampling_defaults
    except RegistryError:
        architecture, sampling_defaults = "unknown", {}
    return ModelSpec(
        name=engine.model_name,
        kind="chat",
        source=source,
        architecture=architecture,
        dtype=config.dtype,
        max_model_len=engine.max_model_len,
        sampling_defaults=sampling_defaults,
    )


def loads_on_first_use(spec: ModelSpec) -> bool:
    """The embedded embedding model loads when a request first names it, not at start: registered on first
    start without anyone asking, loaded at start it cost every server ~0.16 GB (most of it transformers'
    model code: torch._dynamo, triton, scipy; a 1B Q4_K_M server on 2 cores settled at 2.37 GB with it,
    2.21 GB without) and ~1.5 s of imports, whether or not anyone embeds. Its first request waits for the
    load (1.1 s on that server). Every model an admin registers loads at start."""
    return spec.kind == "embedding" and spec.source == DEFAULT_SOURCE


def embedded_defaults() -> tuple[dict[str, Any], ...]:
    """Registered on first start beside --model: the embedded embedding model, when its wheel is here."""
    try:
        from engine.embeddings import DEFAULT_EMBEDDING_MODEL_NAME

        default_source_path("embedding")
    except (ImportError, FileNotFoundError):
        return ()
    return ({"name": DEFAULT_EMBEDDING_MODEL_NAME, "kind": "embedding", "path": DEFAULT_SOURCE},)


def return_memory_to_os() -> None:
    """After an unload: glibc keeps freed weights in its arenas (measured: ~500 MB of SmolLM2's 850 stay
    resident without this), and torch keeps freed GPU blocks in its cache; hand both back."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
