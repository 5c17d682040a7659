"""Every family from a GGUF made by llama.cpp's own convert_hf_to_gguf.py runs as the checkpoint it was made
from: F32 files, read as stored and converted to safetensors, give transformers' float32 greedy tokens on that
checkpoint (the converted folder too, loaded by transformers); the same files quantized to Q8_0 by
llama-quantize, run as stored (int8), give transformers' tokens on their values up to int8's near-ties.

The checkpoints hold only what a GGUF can say (engine/gguf_config.py): a Gemma's query scale is its head size
and its layers follow the family's window pattern, Qwen3-MoE has no dense layer (llama.cpp's qwen3moe tensors
have no dense MLP: the converter stops with "Can not map tensor 'model.layers.1.mlp.down_proj.weight'"), and
Mistral's window is lost on the way (see `test_mistral_gguf_has_no_window`)."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.loader import LoadedModel, load_model, load_stored_gguf
from engine.sampling_params import SamplingParams
from tests.engine.test_architectures import FAMILIES, GEMMA_WINDOW, TINY, WINDOW
from tests.support.engine import QUESTIONS, chat_prompt, hf_greedy_tokens, make_engine, run_to_completion
from tests.support.gguf_files import llama_cpp_tools

NEW_TOKENS = 12
PROMPTS = [QUESTIONS[0], QUESTIONS[2], QUESTIONS[6]]  # the last longer than every window
LONGROPE = {  # Phi-3.5 / Phi-4-mini's LongRoPE, its factors over the 6 frequencies of 12 rotary dims
    "rope_type": "longrope",
    "rope_theta": 10_000.0,
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 256,  # the prompts stay under it: the short factors apply
    "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
}
# each family's tiny checkpoint (tests/engine/test_architectures.py's), changed where a GGUF can't say it
GGUF_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {},  # head_dim 24, not hidden / heads: read from attention.key_length
    "mistral": {},
    "gemma2": {"query_pre_attn_scalar": 16},  # the head size, as llama.cpp scales (no key holds it)
    # the family's pattern (5 sliding layers, then a global one with the scaled rope): no key holds layer_types
    "gemma3_text": {"num_hidden_layers": 6, "query_pre_attn_scalar": 16, "layer_types": None},
    "phi3": {"sliding_window": WINDOW, "rope_parameters": LONGROPE},  # partial rope, LongRoPE and a window
    "mixtral": {},
    "qwen2_moe": {},
    "qwen3_moe": {"mlp_only_layers": []},
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def sentencepiece_model(folder: Path, gemma: bool) -> Path:
    """A 512-piece SentencePiece BPE model trained on the test questions, with Gemma's special pieces (<pad> 0,
    <eos> 1, <bos> 2, <unk> 3) or Llama's (<unk> 0, <s> 1, </s> 2), byte fallback and the turn markers."""
    import sentencepiece

    path = folder / ("gemma.model" if gemma else "llama.model")
    if path.exists():
        return path
    specials = (
        {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3, "pad_piece": "<pad>", "eos_piece": "<eos>"}
        | {"bos_piece": "<bos>", "unk_piece": "<unk>"}
        if gemma
        else {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}
    )
    text = "\n".join([*QUESTIONS, " ".join(chr(code) for code in range(32, 127))] * 4)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_writer=model,
        vocab_size=512,
        model_type="bpe",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        byte_fallback=True,
        character_coverage=1.0,
        add_dummy_prefix=not gemma,  # Gemma's pieces take no leading space, Llama's (and Phi-3's) do
        num_threads=1,
        minloglevel=2,
        **specials,
    )
    path.write_bytes(model.getvalue())
    return path


def sentencepiece_tokenizer(folder: Path, model: Path, gemma: bool) -> Any:
    """transformers' Gemma (or Llama) tokenizer over `model`, to be saved in `folder` with its tokenizer.model
    (`save_tokenizer`)."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.read_bytes())
    tokenizer_class = "GemmaTokenizer" if gemma else "LlamaTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Saved with its special tokens listed in tokenizer_config.json's added_tokens_decoder too, as checkpoints
    on the Hub have them (transformers 5 keeps them in tokenizer.json only): llama.cpp's converter reads them
    there to mark them control tokens, which a GGUF's tokenizer then keeps whole."""
    tokenizer.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    specials = tokenizer.all_special_tokens
    config["added_tokens_decoder"] = {
        str(tokenizer.convert_tokens_to_ids(token)): {"content": token, "special": True} for token in specials
    }
    config_file.write_text(json.dumps(config))


def tiny_checkpoint(folder: Path, family: str, tokenizer: Any, changes: dict[str, Any]) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    # std 0.1: the int kernels quantize activations; 0.5 blows them up into greedy near-ties (tests/support/gguf_files)
    settings = {**TINY, "vocab_size": len(tokenizer), **FAMILIES.get(family, {}), "initializer_range": 0.1, **changes}
    settings.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    settings.update(pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2)
    settings = {name: value for name, value in settings.items() if value is not None}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **settings), dtype=torch.float32)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.3 + (0.0 if gemma else 1.0))
            if gemma and name.endswith(("q_proj.weight", "k_proj.weight")):
                # sharper attention, so the query scale and soft-cap the file gives decide tokens (with std 0.1
                # alone, Gemma 2's with transformers' defaults for them, 2B's, gave the same tokens)
                parameter.mul_(6.0)
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


def checkpoint_for(tmp_path_factory, folder: Path, family: str, changes: dict[str, Any], smollm2: Any) -> Path:
    """The family's tiny checkpoint with a 512-piece SentencePiece tokenizer (Gemma's or Llama's specials), which
    the converters of Gemma and Phi-3 need and Llama's reads first; a small vocabulary keeps the runs quick (a
    GGUF's 49,152 tokens and merges take transformers ~10 s to read). Qwens have a byte-level BPE one, as the
    real ones do (the Qwen MoEs' converter reads no other, transformers decodes a Qwen GGUF's SentencePiece
    vocabulary piece by piece): SmolLM2's."""
    if family.startswith("qwen"):
        return tiny_checkpoint(folder, family, smollm2.tokenizer, changes)
    gemma = family.startswith("gemma")
    model = sentencepiece_model(tmp_path_factory.getbasetemp(), gemma)
    return tiny_checkpoint(folder, family, sentencepiece_tokenizer(folder, model, gemma), changes)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, smollm2) -> dict[str, tuple[Path, Path]]:
    """family -> (its checkpoint, its F32 GGUF): checkpoints made one by one, converted a few at a time (each
    conversion is a Python process, mostly its imports)."""
    from bench.llama_cpp_tools import convert_to_gguf

    tools = llama_cpp_tools()
    root = tmp_path_factory.mktemp("gguf-families")
    checkpoints = {
        family: checkpoint_for(tmp_path_factory, root / family / "hf", family, changes, smollm2)
        for family, changes in GGUF_FAMILIES.items()
    }

    def convert(family: str) -> Path:
        folder = root / family / "gguf"  # alone in its folder: transformers reads a GGUF's folder for tokenizer files
        folder.mkdir()
        return convert_to_gguf(checkpoints[family], folder / f"tiny-{family}-F32.gguf", "f32", tools)

    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = dict(zip(checkpoints, pool.map(convert, checkpoints), strict=True))
    return {family: (checkpoints[family], paths[family]) for family in checkpoints}


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    return hf_greedy_tokens(model, prompt, NEW_TOKENS, pad_token_id=model.config.pad_token_id)


def engine_greedy(loaded: LoadedModel, prompts: list[list[int]], quantization: str = "none") -> list[list[int]]:
    engine = make_engine(loaded, quantization=quantization, num_kv_blocks=64)
    results = run_to_completion(engine, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    return [results[f"r{number}"][0] for number in range(len(prompts))]


@pytest.fixture(scope="module", params=list(GGUF_FAMILIES))
def family(request, gguf_files) -> tuple[str, Any, Path, dict[tuple[int, ...], list[int]], Path]:
    """(family, the checkpoint's tokenizer, its F32 GGUF, {chat prompt: transformers' greedy tokens on the
    checkpoint}, a data dir for its loads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, path = gguf_files[request.param]
    # Mistral's GGUF has no window (test_mistral_gguf_has_no_window): its oracle attends over everything
    overrides = {"sliding_window": None} if request.param == "mistral" else {}
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **overrides).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [chat_prompt(tokenizer, question) for question in PROMPTS]
    expected = {tuple(prompt): hf_greedy(hf, prompt) for prompt in prompts}
    return request.param, tokenizer, path, expected, path.parent.parent / "data"


@pytest.mark.parametrize("read", ["stored", "converted"])
def test_an_f32_gguf_gives_its_checkpoints_greedy_tokens(family, read):
    """Read as stored (the mapped file's tensors under HF names, the config from its metadata) or converted to a
    safetensors folder once (what a float run loads), which transformers then loads as the same model."""
    name, tokenizer, path, expected, data_dir = family  # one data dir: both reads share the cached tokenizer
    config = EngineConfig(model=str(path), quantization="none", dtype="float32", data_dir=str(data_dir))
    if read == "stored":
        loaded = load_stored_gguf(config, path, path.stem, "none")
    else:
        loaded = load_model(config)
    assert loaded.shape.model_type == ("llama" if name == "mistral" else name)
    prompts = [list(prompt) for prompt in expected]
    # the file's tokenizer reads the ids as the checkpoint's does (how each splits text is transformers' matter:
    # its GGUF tokenizer for Phi-3 puts a space after each special token, as Phi-3's own tokenizer.json does)
    assert [loaded.tokenizer.decode(prompt) for prompt in prompts] == [tokenizer.decode(prompt) for prompt in prompts]
    assert max(len(prompt) for prompt in prompts) > WINDOW
    assert engine_greedy(loaded, prompts) == list(expected.values()), f"{name} read {read}"
    if read == "converted":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=torch.float32).eval()
        assert hf_greedy(hf, prompts[-1]) == expected[tuple(prompts[-1])]


LLAMA3_ROPE = {  # Llama 3.1's rope scaling, its original context small enough that it matters at short positions
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("read", ["stored", "converted"])
def test_a_llama3_ggufs_rope_freqs_scale_its_rope(tmp_path_factory, read):
    """The converter keeps Llama 3's rope scaling only as a rope_freqs tensor (each rotary frequency's divisor,
    as llama.cpp applies it): read as stored or converted, the file gives the checkpoint's greedy tokens over a
    ~200-token prompt (unscaled, it gave others), and the converted folder loads in transformers as that model."""
    from transformers import AutoModelForCausalLM

    from bench.llama_cpp_tools import convert_to_gguf

    root = tmp_path_factory.mktemp("gguf-llama3")
    model = sentencepiece_model(tmp_path_factory.getbasetemp(), gemma=False)
    tokenizer = sentencepiece_tokenizer(root / "hf", model, gemma=False)
    checkpoint = tiny_checkpoint(root / "hf", "llama", tokenizer, {"rope_parameters": LLAMA3_ROPE})
    (root / "gguf").mkdir()
    path = convert_to_gguf(checkpoint, root / "gguf" / "tiny-llama3-F32.gguf", "f32", llama_cpp_tools())
    prompt = chat_prompt(tokenizer, " ".join(QUESTIONS))
    assert 200 <= len(prompt) <= 400, len(prompt)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompt)
    config = EngineConfig(model=str(path), quantization="none", dtype="float32", data_dir=str(root / "data"))
    loaded = load_stored_gguf(config, path, path.stem, "none") if read == "stored" else load_model(config)
    assert engine_greedy(loaded, [prompt]) == [expected]
    if read == "converted":
        converted = AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=torch.float32).eval()
        assert hf_greedy(converted, prompt) == expected


def test_mistral_gguf_has_no_window(gguf_files, tmp_path):
    """llama.cpp's converter files Mistral under "llama" and writes no sliding window (llama.cpp runs it over
    the whole context): the file loads as a Llama whose layers all attend to everything, as llama.cpp runs it."""
    from engine.gguf_config import gguf_hf_config
    from engine.gguf_file import read_header

    checkpoint, path = gguf_files["mistral"]
    assert json.loads((checkpoint / "config.json").read_text())["sliding_window"] == WINDOW
    metadata, _ = read_header(path)
    assert metadata["general.architecture"] == "llama"
    assert not [key for key in metadata if "sliding_window" in key]
    assert getattr(gguf_hf_config(path), "sliding_window", None) is None


NEAR_TIE = 0.1  # logits apart: int8 activations (8 bits a row) move logits by a few hundredths (measured <= 0.06)


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_a_q8_0_gguf_runs_as_stored_and_gives_transformers_greedy_tokens(gguf_files, name):
    """The F32 file quantized by llama-quantize to Q8_0, run as int8 from the file's own codes, against
    transformers on the same file's values (the folder a float run converts it to, which the F32 test shows
    transformers loads as the checkpoint itself): the same tokens up to the first step whose top two logits
    are a near-tie (after it, the replies go separate ways), where int8 picks one of them. Measured: Mistral
    and Qwen3-MoE meet one (0.0 and 0.05 apart) in a prompt each, the rest none."""
    from transformers import AutoModelForCausalLM

    from bench.llama_cpp_tools import quantize

    _, f32 = gguf_files[name]
    folder = f32.parent.parent / "q8_0"  # alone in its folder, as transformers wants a GGUF
    folder.mkdir(exist_ok=True)
    path = quantize(f32, folder / f"tiny-{name}-Q8_0.gguf", "Q8_0", tools=llama_cpp_tools())
    data_dir = str(folder / "data")
    loaded = load_model(EngineConfig(model=str(path), quantization="auto", dtype="float32", data_dir=data_dir))
    assert loaded.model.quantization == "int8"
    prompts = [chat_prompt(loaded.tokenizer, question) for question in PROMPTS]
    converted = load_model(EngineConfig(model=str(path), quantization="none", dtype="float32", data_dir=data_dir))
    hf = AutoModelForCausalLM.from_pretrained(converted.folder, dtype=torch.float32).eval()
    agreed = 0
    for prompt, tokens in zip(prompts, engine_greedy(loaded, prompts, "int8"), strict=True):
        expected = hf_greedy(hf, prompt)
        same = next((step for step, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), len(tokens))
        agreed += same
        if same < len(tokens):
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + expected[:same]])).logits[0, -1]
            gap = float(logits[expected[same]] - logits[tokens[same]])
            assert gap < NEAR_TIE, (
                f"{name}: token {same} is {tokens[same]}, transformers' {expected[same]} leads by {gap}"
            )
    assert agreed >= len(prompts) * NEW_TOKENS // 2


def test_metadata_reads_as_its_types(gguf_files):
    """A GGUF's float32 keys read as floats (they read as their bits' integer value), int32 as signed."""
    from engine.gguf_file import read_header

    metadata, _ = read_header(gguf_files["gemma3_text"][1])
    assert metadata["gemma3.attention.layer_norm_rms_epsilon"] == 1e-5
    assert metadata["gemma3.rope.freq_base"] == 1_000_000.0 and metadata["gemma3.rope.scaling.factor"] == 8.0
    assert metadata["gemma3.attention.sliding_window"] == GEMMA_WINDOW
    assert metadata["gemma3.rope.scaling.type"] == "linear"


def test_gguf_files_of_one_name_keep_their_own_metadata(gguf_files, tmp_path):
    """Two files named alike in different folders (every model's "model.Q4_K_M.gguf") are cached apart: the
    metadata folder kept the part of the name before the quantization only, so the second read the first's."""
    from engine.loader import gguf_metadata

    configs = []
    for family in ("gemma2", "phi3"):
        folder = tmp_path / family
        folder.mkdir()
        path = folder / "model.F32.gguf"
        path.symlink_to(gguf_files[family][1])
        configs.append(gguf_metadata(path, tmp_path / "data")[0])
    assert [config.model_type for config in configs] == ["gemma2", "phi3"]


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_a_restart_reads_the_config_and_tokenizer_the_first_start_kept(gguf_files, family, tmp_path):
    """A GGUF's config comes back from its metadata folder in transformers' base config class (the family's
    class imports transformers' model-loading stack): the decoder's shape, its rope tables and the tensor names
    come out as from the family's class, and the tokenizer, loaded as the fast tokenizer it names, as
    AutoTokenizer gives it."""
    from transformers import AutoTokenizer

    from engine.gguf_config import gguf_hf_config
    from engine.gguf_file import gguf_architecture, hf_tensor_names
    from engine.loader import gguf_metadata
    from engine.models.rope import rope_tables
    from engine.models.shape import DecoderShape

    gguf = gguf_files[family][1]
    gguf_metadata(gguf, tmp_path)  # the first start fills the folder
    config, tokenizer, folder = gguf_metadata(gguf, tmp_path)
    family_config, auto_tokenizer = gguf_hf_config(gguf), AutoTokenizer.from_pretrained(folder)
    # the base class, of the family's model_type (a Mistral GGUF is filed as a Llama)
    assert not type(config).model_type and config.model_type == type(family_config).model_type != ""
    shape = DecoderShape.from_hf_config(config)
    assert shape == DecoderShape.from_hf_config(family_config)
    tables, family_tables = rope_tables(config, shape, 64), rope_tables(family_config, shape, 64)
    assert tables.keys() == family_tables.keys()
    assert all(torch.equal(tables[name], family_tables[name]) for name in tables)
    architecture = gguf_architecture(gguf)
    assert hf_tensor_names(config, architecture) == hf_tensor_names(family_config, architecture)
    assert type(tokenizer) is type(auto_tokenizer)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == auto_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert (tokenizer.eos_token_id, tokenizer.all_special_ids) == (
        auto_tokenizer.eos_token_id,
        auto_tokenizer.all_special_ids,
    )
