"""What a decoder-only checkpoint is, as data: one `DecoderShape` per model, read from its HF config.

The families differ in a handful of facts (norm placement and offset, activation, q/k norms, soft-caps, an
embedding scale, which layers slide a window, which rope each layer uses, whether the MLP is a mixture of
experts); the one decoder in engine/models/decoder.py runs them all from these fields, with no per-family
code paths. Where a config is silent, the values are transformers' (and so vLLM's and llama.cpp's) defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type (a config.json's) -> what the family needs beyond Llama's defaults
FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3_text",
        "phi3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
    }
)
SUPPORTED_ARCHITECTURES = FAMILIES
GATED_GELU = frozenset({"gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"})  # all tanh-approximate GELU
GEMMA = frozenset({"gemma2", "gemma3_text"})


class UnsupportedModel(ValueError):
    pass


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_ARCHITECTURES))


@dataclass(frozen=True)
class MoEShape:
    """A sparse MLP: `num_experts` experts of `intermediate_size`, `top_k` of them per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool  # renormalise the chosen experts' softmax weights to sum to 1
    shared_intermediate_size: int  # Qwen2-MoE's always-on expert (0: none)


@dataclass(frozen=True)
class DecoderShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    model_type: str = "llama"
    activation: str = "silu"  # "silu" or "gelu_tanh", gating the up projection
    attention_scale: float | None = None  # None: head_dim ** -0.5
    qk_norm: bool = False  # RMSNorm per head on q and k before rope (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # norms scale by (offset + weight): Gemma's (1 + w)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 2/3)
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    attention_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window span, None for full attention
    layer_rope: tuple[str, ...] = ()  # per layer: the rope cache it uses ("default" or a layer type)
    rotary_dim: int | None = None  # the leading dims of each head rope rotates (Phi-4-mini: 3/4); None: all
    moe: MoEShape | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: its MLP is the sparse one

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each q/k head rope rotates (NeoX style, over their halves)."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def runs_as_llama(self) -> bool:
        """Layers exactly as Llama's: what the fused native decode stack (kernels/decode_stack.py) implements."""
        return (
            self.activation == "silu"
            and self.attention_scale is None
            and not self.qk_norm
            and not self.sandwich_norms
            and self.attention_softcap is None
            and self.final_softcap is None
            and all(window is None for window in self.layer_windows)
            and self.moe is None
            and len(set(self.layer_rope)) <= 1
            and self.rotary_dims == self.head_dim
        )

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderShape:
        model_type = config.model_type
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(f"architecture {model_type!r} is not supported; tokenmill runs {supported_list()}")
        activation = _activation(config)
        rope = dict(getattr(config, "rope_parameters", None) or {})
        layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_dim = int(head_dim * partial_rotary_factor(config))  # as transformers truncates it
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise UnsupportedModel(f"rope over {rotary_dim} of {head_dim} head dims: an even count is needed")
        gemma = model_type in GEMMA
        layer_types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None) or None
        if layer_types:
            windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        else:
            windows = tuple(window for _ in range(layers))  # Mistral / Phi-3: every layer slides when set
        per_type_rope = bool(layer_types) and set(layer_types) <= set(rope)  # Gemma 3: rope_parameters by type
        layer_rope = tuple(kind if per_type_rope else "default" for kind in (layer_types or ["default"] * layers))
        moe, moe_layers = _moe(config, layers)
        query_scalar = getattr(config, "query_pre_attn_scalar", None)
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=model_type in ("qwen2", "qwen2_moe")
            or bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)),
            activation=activation,
            attention_scale=float(query_scalar) ** -0.5 if gemma and query_scalar else None,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embedding_scale=config.hidden_size**0.5 if gemma else None,
            attention_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            layer_windows=windows,
            layer_rope=layer_rope,
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            moe=moe,
            moe_layers=moe_layers,
        )


def partial_rotary_factor(config: Any) -> float:
    """The share of each head's dims rope rotates (1.0: all), wherever the config keeps it: rope_parameters
    (transformers 5), the top level (older configs), or per layer type (Gemma 3's; one share for all)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    entries = [entry for entry in rope.values() if isinstance(entry, dict)] or [rope]
    shares = {
        float(entry.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
        for entry in entries
    }
    if len(shares) > 1:
        raise UnsupportedModel(f"rope rotates different shares of the head per layer type: {sorted(shares)}")
    return shares.pop()


def _activation(config: Any) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
    if name == "silu":
        return "silu"
    if name in GATED_GELU:
        return "gelu_tanh"
    raise UnsupportedModel(f"activation {name!r} is not supported (silu or tanh-approximate gelu)")


def _moe(config: Any, layers: int) -> tuple[MoEShape | None, tuple[bool, ...]]:
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    if config.model_type not in ("mixtral", "qwen2_moe", "qwen3_moe") or not experts:
        return None, tuple(False for _ in range(layers))
    mixtral = config.model_type == "mixtral"
    moe = MoEShape(
        num_experts=experts,
        top_k=config.num_experts_per_tok,
        # Mixtral's experts are intermediate_size wide; the Qwen MoEs' moe_intermediate_size
        intermediate_size=config.intermediate_size if mixtral else config.moe_intermediate_size,
        normalize_top_k=True if mixtral else bool(config.norm_topk_prob),
        shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )
    if mixtral:
        return moe, tuple(True for _ in range(layers))
    dense_only = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return moe, tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))


ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "longrope"})  # engine/models/rope.py computes these
# a GGUF's general.architecture -> the config model_type its weights load as (the rest are spelled alike)
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def model_type_of_gguf(architecture: str) -> str:
    return GGUF_ARCHITECTURES.get(architecture, architecture)


def unsupported_reason(config: dict[str, Any]) -> str | None:
    """Why a config.json (as a dict) describes a model the decoder can't run, or None: what the registry checks
    before loading anything, the same facts `DecoderShape.from_hf_config` refuses."""
    model_type = str(config.get("model_type"))
    if model_type not in SUPPORTED_ARCHITECTURES:
        return f"architecture {model_type!r} is not supported for chat; tokenmill runs {supported_list()}"
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if activation != "silu" and activation not in GATED_GELU:
        return f"activation {activation!r} is not supported (silu or tanh-approximate gelu)"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    entries = [entry for entry in rope.values() if isinstance(entry, dict)] or [rope]
    for entry in entries:
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            return f"rope type {rope_type!r} is not supported ({', '.join(sorted(ROPE_TYPES))})"
    return None
