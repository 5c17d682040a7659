"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a flattened batch and a paged KV cache.

Plain PyTorch, gpt-fast style: q/k/v and gate/up are fused at load time; the hot ops go through
`kernels`, which picks Triton on a GPU and native kernels (or the torch references) on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from engine.config import EngineConfig
from engine.models.weights import LinearLayer, Weight, dense, make_embedding, make_head, make_linear
from kernels.cpu_attention import heads_major_cache
from kernels.decode_stack import DecoderLayerWeights, DecodeStack, StackShape
from kernels.linear import Linear
from kernels.qlinear import PackedLinear, PackedWeight, embedding_rows, place_together

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
    def __init__(
        self,
        shape: LlamaShape,
        weights: dict[str, Weight],
        prefix: str,
        dtype: torch.dtype | None = None,
        quantization: str = "none",
    ) -> None:
        self.shape = shape
        dtype = dtype or dense(weights[f"{prefix}input_layernorm.weight"]).dtype
        qkv = [weights[f"{prefix}self_attn.{name}_proj.weight"] for name in "qkv"]
        qkv_bias = None
        if shape.attention_bias and f"{prefix}self_attn.q_proj.bias" in weights:
            qkv_bias = torch.cat([dense(weights[f"{prefix}self_attn.{name}_proj.bias"]) for name in "qkv"]).contiguous()
        self.qkv_proj = make_linear(qkv, qkv_bias, dtype, quantization)
        self.o_proj = make_linear([weights[f"{prefix}self_attn.o_proj.weight"]], None, dtype, quantization)
        gate_up = [weights[f"{prefix}mlp.gate_proj.weight"], weights[f"{prefix}mlp.up_proj.weight"]]
        self.gate_up_proj = make_linear(gate_up, None, dtype, quantization)
        self.down_proj = make_linear([weights[f"{prefix}mlp.down_proj.weight"]], None, dtype, quantization)
        self.input_norm = dense(weights[f"{prefix}input_layernorm.weight"], dtype)
        self.post_attention_norm = dense(weights[f"{prefix}post_attention_layernorm.weight"], dtype)
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.scale = shape.head_dim**-0.5

    @property
    def linears(self) -> tuple[LinearLayer, LinearLayer, LinearLayer, LinearLayer]:
        """qkv, o, gate_up and down: in the order a step runs them."""
        return (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)

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
            parts.append(
                kernels.paged_attention_decode(
                    q[:split], key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
                )
            )
        if meta.num_prefills:
            parts.append(
                kernels.paged_attention_prefill(
                    q[split:],
                    key_cache,
                    value_cache,
                    meta.prefill_block_tables,
                    meta.prefill_query_start_loc,
                    meta.prefill_context_lens,
                    self.scale,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.o_proj(out.reshape(-1, self.q_size))

    def mlp(self, hidden):
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(hidden)))


class LlamaForCausalLM:
    """Inference-only; weights are plain tensors taken from an HF-named state dict.

    `dtype`: of the activations, KV cache and unquantized weights (default: the weights' own). With
    `quantization` int8/int4 the linears are packed (kernels/qlinear.py), and so is the logits head; a
    tied embedding then lives only in the head's packed form, its rows dequantized on lookup.
    """

    def __init__(
        self,
        shape: LlamaShape,
        weights: dict[str, Weight],
        cos_sin: torch.Tensor,
        dtype: torch.dtype | None = None,
        quantization: str = "none",
    ) -> None:
        self.shape = shape
        stored_embed = weights["model.embed_tokens.weight"]
        self.dtype = dtype or dense(weights["model.norm.weight"]).dtype
        self.quantization = quantization
        self.layers = [
            LlamaLayer(shape, weights, f"model.layers.{i}.", self.dtype, quantization) for i in range(shape.num_layers)
        ]
        self.final_norm = dense(weights["model.norm.weight"], self.dtype)
        stored_head = weights.get("lm_head.weight")
        tied = shape.tie_word_embeddings or stored_head is None
        self.embed: torch.Tensor | None = None
        self.packed_embed: PackedWeight | None = None  # an untied embedding kept quantized (a GGUF's blocks)
        self.lm_head: LinearLayer
        if quantization == "none":
            self.embed = dense(stored_embed, self.dtype).contiguous()
            self.lm_head = Linear(self.embed if tied else dense(stored_head, self.dtype))
        else:
            self.lm_head = make_head(stored_embed if tied or stored_head is None else stored_head, quantization)
            if not tied:
                embedding = make_embedding(stored_embed, self.dtype, quantization)
                if isinstance(embedding, torch.Tensor):
                    self.embed = embedding
                else:
                    self.packed_embed = embedding
            self._place_packed_weights_together()
        self.cos_sin = cos_sin
        self._decode_stack: DecodeStack | None = None

    def _place_packed_weights_together(self) -> None:
        """One buffer on huge pages for the packed weights, in the order a decode step reads them."""
        linears = [linear for layer in self.layers for linear in layer.linears]
        packed = [linear for linear in [*linears, self.lm_head] if isinstance(linear, PackedLinear)]
        for linear, weight in zip(packed, place_together([linear.weight for linear in packed]), strict=True):
            linear.weight = weight

    def weight_nbytes(self) -> int:
        """Bytes of the linears, logits head and embedding as held in memory (a tied embedding once)."""

        def linear_bytes(linear: LinearLayer) -> int:
            if isinstance(linear, PackedLinear):
                return linear.weight.nbytes()
            stored = linear.packed if linear.packed is not None else linear.weight
            assert stored is not None
            return linear.out_features * linear.in_features * stored.element_size()

        total = sum(linear_bytes(linear) for layer in self.layers for linear in layer.linears)
        total += linear_bytes(self.lm_head)
        head_is_embedding = self.shape.tie_word_embeddings and isinstance(self.lm_head, Linear)
        if self.embed is not None and not head_is_embedding:
            total += self.embed.numel() * self.embed.element_size()
        if self.packed_embed is not None:
            total += self.packed_embed.nbytes()
        return total

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return F.embedding(input_ids, self.embed)
        if self.packed_embed is not None:
            return embedding_rows(self.packed_embed, input_ids).to(self.dtype).view(*input_ids.shape, -1)
        assert isinstance(self.lm_head, PackedLinear)
        return embedding_rows(self.lm_head.weight, input_ids).to(self.dtype).view(*input_ids.shape, -1)

    def has_fused_decode(self, config: EngineConfig, kv_dtype: torch.dtype) -> bool:
        """Whether decode steps under `config`, over a KV cache of `kv_dtype`, run as one native call
        (`decode_stack`)."""
        if self.quantization == "none" or config.torch_device.type != "cpu" or not config.heads_major_kv:
            return False
        shape = self.shape
        probe_cache = heads_major_cache(1, config.block_size, shape.num_kv_heads, shape.head_dim, kv_dtype)
        return self.decode_stack_applies(torch.empty(0, shape.hidden_size, dtype=self.dtype), probe_cache)

    def decode_stack_applies(self, hidden: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (
            self.quantization != "none"
            and self.cos_sin.dtype == torch.float32
            and kernels.decode_stack_available(hidden, key_cache, self.shape.num_heads)
        )

    def decode_stack(self, hidden: torch.Tensor, kv_caches) -> DecodeStack | None:
        """The layers as one native call, for decode steps with packed weights on the CPU (None: per op).
        Built on first use for these caches (the runner allocates them once)."""
        built = self._decode_stack
        if built is not None and built.kv_caches is kv_caches and built.dtype == hidden.dtype:
            # what decode_stack_applies checked when it was built holds while the native kernels stay on (the
            # check is ~10 small torch calls, run cold after every step's weights have swept the caches)
            return built if kernels.native_cpu_enabled() else None
        if not self.decode_stack_applies(hidden, kv_caches[0][0]):
            return None
        weights = []
        for layer in self.layers:
            linears = layer.linears
            assert all(isinstance(linear, PackedLinear) for linear in linears)
            qkv, o, gate_up, down = (linear.weight for linear in linears if isinstance(linear, PackedLinear))
            bias = layer.qkv_proj.bias if isinstance(layer.qkv_proj, PackedLinear) else None
            weights.append(
                DecoderLayerWeights(layer.input_norm, layer.post_attention_norm, qkv, bias, o, gate_up, down)
            )
        shape = self.shape
        stack_shape = StackShape(
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.rms_norm_eps, self.layers[0].scale
        )
        self._decode_stack = DecodeStack(weights, self.final_norm, self.cos_sin, stack_shape, kv_caches)
        return self._decode_stack

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if meta.num_prefills == 0 and (stack := self.decode_stack(hidden, kv_caches)) is not None:
            return stack(hidden, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
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
