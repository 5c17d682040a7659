"""A model that is loaded in this process: its engine (chat) or encoder (embedding), its own latency
metrics, and how many requests are using it, so that unloading can wait for them (drain)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from app.observability.metrics import ModelMetrics
from app.registry.spec import ModelSpec
from app.serving.token_text import TokenTexts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.async_engine import AsyncEngine
    from engine.embeddings import EmbeddingModel

LOADED, DRAINING = "loaded", "draining"


def tokenizer_of(engine: AsyncEngine) -> PreTrainedTokenizerBase:
    """The engine's tokenizer: a transformers one, which engine.loader types as object."""
    return cast("PreTrainedTokenizerBase", engine.tokenizer)


class ServedModel:
    def __init__(
        self,
        spec: ModelSpec,
        *,
        engine: AsyncEngine | None = None,
        embedder: EmbeddingModel | None = None,
        owned: bool = True,
    ) -> None:
        self.spec = spec  # replaced when the registry row changes (aliases, prices); the weights stay
        self.engine = engine  # engine.async_engine.AsyncEngine for kind "chat"
        self.embedder = embedder  # engine.embeddings.EmbeddingModel for kind "embedding"
        self.owned = owned  # the pool started it, so the pool shuts it down when the server stops
        self.metrics = ModelMetrics(spec.name)
        self.token_texts = TokenTexts(tokenizer_of(engine)) if engine is not None else None
        self.state = LOADED
        self.in_flight = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def record(self) -> ModelSpec:
        return self.spec

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def shutdown(self) -> None:
        """Blocking: stop the engine thread. Memory goes when the last reference does."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def forget(self) -> None:
        self.engine = None
        self.embedder = None
        self.token_texts = None
