"""A GGUF's metadata as the transformers config the decoder reads, for every family tokenmill runs.

llama.cpp's convert_hf_to_gguf.py keeps a checkpoint's hyperparameters as `<arch>.*` keys and its tensors under
llama.cpp's names. transformers' own GGUF config reader maps only some keys per architecture and leaves the rest
at its config classes' defaults, which are another model's values: a tiny Gemma 2 came back with the 2B's
soft-caps and query scale, a Qwen MoE with the 57B's expert widths, a Qwen3 with hidden / heads for its head
size (attention.key_length unread), a Mixtral as a dense Llama (llama.cpp files Mixtral under "llama"), a
Gemma 3 without its linear rope scaling, a Phi-3 without its partial rope. Here each fact the decoder needs is
read from the file: its keys, and where a key is absent, what its tensors say (the vocabulary, a tied head,
which layers are sparse) or the value llama.cpp itself runs the file with (a Gemma's window pattern and query
scale, a Qwen MoE's top-k normalisation), so a GGUF runs as the checkpoint it was made from, where the file
can say what that was.

What no GGUF records: Mistral's sliding window (the converter files Mistral under "llama" without it, and
llama.cpp attends over the whole context), a Gemma's explicit layer_types other than its family's pattern,
and Llama 3's rope scaling as such: the converter bakes it into a rope_freqs tensor, each rotary frequency's
divisor, which is read here as the same divisors under LongRoPE's name (transformers' GGUF reader ignores it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.gguf_file import GGUFTensor, MappedFile, TensorEntry, read_header
from engine.models.shape import SUPPORTED_ARCHITECTURES, UnsupportedModel, model_type_of_gguf, supported_list

# llama.cpp's sliding-window layer pattern when the file has no attention.sliding_window_pattern: of each
# `pattern` layers, all but the last slide (src/models/gemma2.cpp, gemma3.cpp; llama_hparams::set_swa_pattern)
SWA_PATTERNS = {"gemma2": 2, "gemma3_text": 6}
# Gemma's 27B models scale queries by hidden / heads, the others by the head size: llama.cpp tells them apart by
# their layer count alone (the files keep no query_pre_attn_scalar)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def gguf_hf_config(path: Path) -> Any:
    """The transformers config (a PretrainedConfig of the family's model_type) of a GGUF file."""
    from transformers import AutoConfig

    metadata, entries = read_header(path)
    model_type, settings = config_settings(metadata, entries, lambda entry: _values(path, entry))
    return AutoConfig.for_model(model_type, **settings)


def _values(path: Path, entry: TensorEntry) -> list[float]:
    tensor = GGUFTensor(MappedFile(path).array(entry), entry.type_name, entry.shape)
    return [float(value) for value in tensor.dequantize().reshape(-1)]


def config_settings(
    metadata: dict[str, Any], entries: list[TensorEntry], values: Callable[[TensorEntry], list[float]]
) -> tuple[str, dict[str, Any]]:
    """(model_type, config settings) from a GGUF's scalar metadata and tensor index; `values` reads a small
    tensor's numbers (Phi-3's LongRoPE factors)."""
    arch = str(metadata.get("general.architecture", ""))
    model_type = model_type_of_gguf(arch)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported; tokenmill runs {supported_list()}")
    tensors = {entry.name: entry for entry in entries}

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}")
        return default if value is None else value

    experts = int(key("expert_count", 0))
    if model_type == "llama" and experts:
        model_type = "mixtral"  # llama.cpp's "llama" with experts: Mixtral's layers
    layers = int(key("block_count"))
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModel(f"{arch}: keys and values of different sizes are not supported")
    settings: dict[str, Any] = {
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        # an array (per layer) is not read: the header reader skips arrays
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for name, setting in (("bos", "bos_token_id"), ("eos", "eos_token_id")):
        token = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            settings[setting] = int(token)
    pad = metadata.get("tokenizer.ggml.padding_token_id")  # none, rather than a config class's (Phi-3's 32000)
    settings["pad_token_id"] = None if pad is None else int(pad)
    rope = _rope(key, tensors, values, head_dim)
    window = int(key("attention.sliding_window", 0)) or None
    if model_type in SWA_PATTERNS:
        settings.update(_gemma(model_type, key, layers, hidden, heads, head_dim, window, rope))
    else:
        settings["rope_parameters"] = rope
    if model_type == "phi3":
        # llama.cpp runs Phi-3 without its window (a warning says so); transformers, like the checkpoint the
        # file was made from, slides it
        settings["sliding_window"] = window
        original = key("rope.scaling.original_context_length")
        if original is not None:
            settings["original_max_position_embeddings"] = int(original)
    if experts:
        settings.update(_moe(model_type, key, tensors, layers, experts))
    return model_type, settings


def _rope(
    key: Callable[..., Any],
    tensors: dict[str, TensorEntry],
    values: Callable[[TensorEntry], list[float]],
    head_dim: int,
) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10_000.0))}
    scaling = key("rope.scaling.type")
    factor = key("rope.scaling.factor")
    original = key("rope.scaling.original_context_length")
    if scaling == "linear" and factor:
        rope.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn" and factor and original:
        rope.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(original))
        for gguf_name, name in (
            ("yarn_attn_factor", "attention_factor"),
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
        ):
            if key(f"rope.scaling.{gguf_name}") is not None:
                rope[name] = float(key(f"rope.scaling.{gguf_name}"))
    elif "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors and original:
        # Phi-3's LongRoPE: the factors are tensors
        rope.update(
            rope_type="longrope",
            long_factor=values(tensors["rope_factors_long.weight"]),
            short_factor=values(tensors["rope_factors_short.weight"]),
            original_max_position_embeddings=int(original),
        )
    elif "rope_freqs.weight" in tensors and scaling in (None, "none"):
        # Llama 3's rope scaling, which the converter keeps only as each rotary frequency's divisor (llama.cpp
        # divides by it at every position): as LongRoPE with those divisors for both lengths and no attention
        # factor, which is exactly that, in transformers' terms too (a converted folder loads as the model)
        factors = values(tensors["rope_freqs.weight"])
        rope.update(
            rope_type="longrope",
            long_factor=factors,
            short_factor=factors,
            attention_factor=1.0,
            original_max_position_embeddings=int(key("context_length", 4096)),
        )
    elif scaling not in (None, "none") or "rope_factors_long.weight" in tensors:
        raise UnsupportedModel(
            f"a GGUF's rope scaling {scaling!r} without what it needs (a factor, the original context length, "
            f"LongRoPE's factor tensors) is not supported"
        )
    rotary = key("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        rope["partial_rotary_factor"] = _share(int(rotary), head_dim)
    return rope


def _share(rotary: int, head_dim: int) -> float:
    """rotary / head_dim, nudged up where float rounding would make transformers' int(head_dim * share) one
    dim short."""
    share = rotary / head_dim
    while int(head_dim * share) < rotary:
        share = math.nextafter(share, 1.0)
    return share


def _gemma(
    model_type: str,
    key: Callable[..., Any],
    layers: int,
    hidden: int,
    heads: int,
    head_dim: int,
    window: int | None,
    rope: dict[str, Any],
) -> dict[str, Any]:
    gemma2 = model_type == "gemma2"
    if gemma2 and window is None:
        window = 4096  # llama.cpp's Gemma 2 default
    pattern = int(key("attention.sliding_window_pattern", SWA_PATTERNS[model_type]))
    sliding = [window is not None and (pattern == 0 or i % pattern < pattern - 1) for i in range(layers)]
    settings: dict[str, Any] = {
        "sliding_window": window,
        "layer_types": ["sliding_attention" if slides else "full_attention" for slides in sliding],
        "query_pre_attn_scalar": hidden // heads if layers == GEMMA_27B_LAYERS[model_type] else head_dim,
    }
    final_cap = key("final_logit_softcapping", 30.0 if gemma2 else None)
    settings["final_logit_softcapping"] = None if final_cap is None else float(final_cap)
    if gemma2:
        settings["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0))
        settings["rope_parameters"] = rope
    else:  # Gemma 3: the global layers' rope (scaled) and the local layers' own base
        local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10_000.0))}
        settings["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    return settings


def _moe(
    model_type: str, key: Callable[..., Any], tensors: dict[str, TensorEntry], layers: int, experts: int
) -> dict[str, Any]:
    settings: dict[str, Any] = {"num_experts_per_tok": int(key("expert_used_count"))}
    if model_type == "mixtral":
        settings["num_local_experts"] = experts
        return settings
    gate = tensors.get("blk.0.ffn_gate_exps.weight") or next(
        entry for name, entry in tensors.items() if name.endswith(".ffn_gate_exps.weight")
    )
    settings.update(
        num_experts=experts,
        moe_intermediate_size=int(key("expert_feed_forward_length", gate.shape[1])),
        # the layers with a router are sparse, the rest dense (llama.cpp's Qwen MoEs have no dense layers)
        mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
        decoder_sparse_step=1,
        # llama.cpp normalises the chosen experts' weights for Qwen3-MoE, not for Qwen2-MoE
        norm_topk_prob=bool(key("expert_weights_norm", model_type == "qwen3_moe")),
    )
    if model_type == "qwen2_moe":
        shared = tensors.get("blk.0.ffn_up_shexp.weight")
        width = key("expert_shared_feed_forward_length", shared.shape[0] if shared is not None else 0)
        settings["shared_expert_intermediate_size"] = int(width)
    return settings
