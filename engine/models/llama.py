"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a flattened batch and a paged KV cache.

Plain PyTorch, gpt-fast style: q/k/v and gate/up are fused at load time; the hot ops go through
`kernels`, which picks Triton on a GPU and native kernels (or the torch references) on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from kernels.linear import Linear

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True)
class LlamaShape:
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

    @classmethod
    def from_hf_config(cls, config) -> LlamaShape:
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {config.model_type!r} is not supported; tokenmill runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"activation {config.hidden_act!r} is not supported (only silu)")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )


def rope_cos_sin_cache(config, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, 2, head_dim] cos and sin, computed exactly as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    elif rope_type in ("linear", "llama3", "yarn"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    else:
        raise UnsupportedModel(f"rope type {rope_type!r} is not supported")
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((angles.cos() * scaling, angles.sin() * scaling), dim=1)


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to. Decode tokens come first."""

    slot_mapping: torch.Tensor  # [tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [decodes] int32
    prefill_block_tables: torch.Tensor  # [prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [prefills + 1] int32, relative to the first prefill token
    prefill_context_lens: torch.Tensor  # [prefills] int32
    num_prefills: int


class LlamaLayer:
    def __init__(self, shape: LlamaShape, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.shape = shape
        q, k, v = (weights[f"{prefix}self_attn.{name}_proj.weight"] for name in "qkv")
        qkv_bias = None
        if shape.attention_bias and f"{prefix}self_attn.q_proj.bias" in weights:
            qkv_bias = torch.cat([weights[f"{prefix}self_attn.{name}_proj.bias"] for name in "qkv"]).contiguous()
        self.qkv_proj = Linear(torch.cat((q, k, v), dim=0), qkv_bias)
        self.o_proj = Linear(weights[f"{prefix}self_attn.o_proj.weight"])
        gate, up = weights[f"{prefix}mlp.gate_proj.weight"], weights[f"{prefix}mlp.up_proj.weight"]
        self.gate_up_proj = Linear(torch.cat((gate, up), dim=0))
        self.down_proj = Linear(weights[f"{prefix}mlp.down_proj.weight"])
        self.input_norm = weights[f"{prefix}input_layernorm.weight"]
        self.post_attention_norm = weights[f"{prefix}post_attention_layernorm.weight"]
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.scale = shape.head_dim**-0.5

    def attention(self, hidden, positions, cos_sin, key_cache, value_cache, meta: AttentionMetadata):
        shape = self.shape
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(-1, shape.num_heads, shape.head_dim)
        k = k.view(-1, shape.num_kv_heads, shape.head_dim)
        v = v.view(-1, shape.num_kv_heads, shape.head_dim)
        q, k = kernels.rotary_embedding(positions, q, k, cos_sin)
        kernels.store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        split = meta.num_decode_tokens
        parts = []
        if split:
            parts.append(kernels.paged_attention_decode(
                q[:split], key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale))
        if meta.num_prefills:
            parts.append(kernels.paged_attention_prefill(
                q[split:], key_cache, value_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                meta.prefill_context_lens, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.o_proj(out.reshape(-1, self.q_size))

    def mlp(self, hidden):
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(hidden)))


class LlamaForCausalLM:
    """Inference-only; weights are plain tensors taken from an HF-named state dict."""

    def __init__(self, shape: LlamaShape, weights: dict[str, torch.Tensor], cos_sin: torch.Tensor) -> None:
        self.shape = shape
        self.embed = weights["model.embed_tokens.weight"].contiguous()
        self.layers = [LlamaLayer(shape, weights, f"model.layers.{i}.") for i in range(shape.num_layers)]
        self.final_norm = weights["model.norm.weight"]
        head = weights.get("lm_head.weight")
        self.lm_head = Linear(self.embed if shape.tie_word_embeddings or head is None else head)
        self.cos_sin = cos_sin
        self.dtype = self.embed.dtype

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed)
        residual = None
        eps = self.shape.rms_norm_eps
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            normed, residual = kernels.rms_norm(hidden, layer.input_norm, eps, residual)
            hidden = layer.attention(normed, positions, self.cos_sin, key_cache, value_cache, meta)
            normed, residual = kernels.rms_norm(hidden, layer.post_attention_norm, eps, residual)
            hidden = layer.mlp(normed)
        normed, _ = kernels.rms_norm(hidden, self.final_norm, eps, residual)
        return normed

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
