"""One decoder for every family tokenmill runs (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, and the MoEs
Mixtral, Qwen2-MoE, Qwen3-MoE), over a flattened batch and a paged KV cache.

Plain PyTorch, gpt-fast style: q/k/v and gate/up are fused at load time; the hot ops go through `kernels`,
which picks Triton on a GPU and native kernels (or the torch references) on the CPU. What differs between
families is data in `DecoderShape` (engine/models/shape.py): which norms a layer has and their offset, the
activation, q/k norms, soft-caps, the embedding scale, each layer's window and rope, dense or sparse MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from engine.config import EngineConfig
from engine.models.moe import SparseMoE
from engine.models.shape import DecoderShape
from engine.models.weights import LinearLayer, Weight, dense, make_embedding, make_head, make_linear
from kernels.cpu_attention import heads_major_cache
from kernels.decode_stack import DecoderLayerWeights, DecodeStack, StackShape
from kernels.linear import Linear
from kernels.qlinear import PackedLinear, PackedWeight, embedding_rows, move_together

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
# Rows of a packed dense MLP at a time: its gate/up output and their product (3 x FFN floats a row) were most of
# a step's memory (a 1B's 2048-token prefill step: +0.47 GB of RSS at its peak in float32). The int kernels give
# every row the same bits whatever rows run beside it; a LoRA step's wrappers (not PackedLinear) see them whole.
MLP_ROWS = 512


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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU over a fused [gate | up] projection, with the tanh-approximate GELU Gemma uses."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": kernels.silu_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}


def _parts(weights: Mapping[str, Weight], fused: str, separate: list[str]) -> list[Weight]:
    """A fused projection's weight as one part (Phi-3's qkv_proj, gate_up_proj), else the separate ones."""
    return [weights[fused]] if fused in weights else [weights[name] for name in separate]


class DecoderLayer:
    def __init__(
        self,
        shape: DecoderShape,
        weights: Mapping[str, Weight],
        prefix: str,
        dtype: torch.dtype | None = None,
        quantization: str = "none",
        index: int = 0,
    ) -> None:
        self.shape = shape
        dtype = dtype or dense(weights[f"{prefix}input_layernorm.weight"]).dtype
        attn = f"{prefix}self_attn."
        qkv = _parts(weights, f"{attn}qkv_proj.weight", [f"{attn}{name}_proj.weight" for name in "qkv"])
        qkv_bias = None
        if shape.attention_bias and f"{attn}q_proj.bias" in weights:
            qkv_bias = torch.cat([dense(weights[f"{attn}{name}_proj.bias"]) for name in "qkv"]).contiguous()
        self.qkv_proj = make_linear(qkv, qkv_bias, dtype, quantization)
        self.o_proj = make_linear([weights[f"{attn}o_proj.weight"]], None, dtype, quantization)

        def norm(name: str) -> torch.Tensor:
            # Gemma scales by (1 + w): the offset is folded in here, in float32, before any cast
            return (dense(weights[f"{prefix}{name}.weight"], torch.float32) + shape.norm_offset).to(dtype)

        self.input_norm = norm("input_layernorm")
        # Llama's post_attention_layernorm is the MLP's input norm; Gemma's normalizes the attention output and
        # pre_feedforward_layernorm is the MLP's input norm, post_feedforward_layernorm its output's.
        self.attention_out_norm = norm("post_attention_layernorm") if shape.sandwich_norms else None
        self.post_attention_norm = norm(
            "pre_feedforward_layernorm" if shape.sandwich_norms else "post_attention_layernorm"
        )
        self.mlp_out_norm = norm("post_feedforward_layernorm") if shape.sandwich_norms else None
        self.q_norm = norm("self_attn.q_norm") if shape.qk_norm else None
        self.k_norm = norm("self_attn.k_norm") if shape.qk_norm else None

        self.activation = ACTIVATIONS[shape.activation]
        self.sparse_mlp: SparseMoE | None = None
        if shape.moe is not None and shape.moe_layers[index]:
            self.sparse_mlp = SparseMoE(shape.moe, dict(weights), prefix, dtype, quantization, self.activation)
        else:
            mlp = f"{prefix}mlp."
            gate_up = _parts(weights, f"{mlp}gate_up_proj.weight", [f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"])
            self.gate_up_proj = make_linear(gate_up, None, dtype, quantization)
            self.down_proj = make_linear([weights[f"{mlp}down_proj.weight"]], None, dtype, quantization)
        self.window = shape.layer_windows[index] if shape.layer_windows else None
        self.rope = shape.layer_rope[index] if shape.layer_rope else "default"
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.scale = shape.scale

    @property
    def linears(self) -> tuple[LinearLayer, ...]:
        """The layer's linears in the order a step runs them: qkv, o, gate_up and down (or the experts')."""
        if self.sparse_mlp is not None:
            return (self.qkv_proj, self.o_proj, *self.sparse_mlp.linears)
        return (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor | None, heads: int) -> torch.Tensor:
        x = x.reshape(-1, heads, self.shape.head_dim)
        if weight is None:
            return x
        normed, _ = kernels.rms_norm(x.reshape(-1, self.shape.head_dim), weight, self.shape.rms_norm_eps)
        return normed.view(-1, heads, self.shape.head_dim)

    def _rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope over each head's leading `rotary_dims` (all of them but for a partial rotary factor, where the
        rest pass through as they are, as transformers' Phi-3 does)."""
        rotary = self.shape.rotary_dims
        if rotary == self.shape.head_dim:
            return kernels.rotary_embedding(positions, q, k, cos_sin)
        q_rot, k_rot = kernels.rotary_embedding(
            positions, q[..., :rotary].contiguous(), k[..., :rotary].contiguous(), cos_sin
        )
        return torch.cat((q_rot, q[..., rotary:]), dim=-1), torch.cat((k_rot, k[..., rotary:]), dim=-1)

    def attention(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        shape = self.shape
        qkv: torch.Tensor = self.qkv_proj(hidden)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._head_norm(q, self.q_norm, shape.num_heads)
        k = self._head_norm(k, self.k_norm, shape.num_kv_heads)
        v = v.view(-1, shape.num_kv_heads, shape.head_dim)
        q, k = self._rotate(positions, q, k, cos_sin)
        kernels.store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        split = meta.num_decode_tokens
        window, softcap = self.window, shape.attention_softcap
        parts = []
        if split:
            parts.append(
                kernels.paged_attention_decode(
                    q[:split],
                    key_cache,
                    value_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    window=window,
                    softcap=softcap,
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
                    window=window,
                    softcap=softcap,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.o_proj(out.reshape(-1, self.q_size))

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sparse_mlp is not None:
            return self.sparse_mlp(hidden)
        rows = hidden.shape[0]
        packed = isinstance(self.gate_up_proj, PackedLinear) and isinstance(self.down_proj, PackedLinear)
        if rows <= MLP_ROWS or not packed or hidden.is_cuda:
            return self.down_proj(self.activation(self.gate_up_proj(hidden)))
        out = torch.empty(rows, self.down_proj.out_features, dtype=hidden.dtype)
        for start in range(0, rows, MLP_ROWS):
            part = hidden[start : start + MLP_ROWS]
            out[start : start + MLP_ROWS] = self.down_proj(self.activation(self.gate_up_proj(part)))
        return out


class DecoderForCausalLM:
    """Inference-only; weights are plain tensors (or stored GGUF tensors) under HF names.

    `dtype`: of the activations, KV cache and unquantized weights (default: the weights' own). With
    `quantization` int8/int4 the linears are packed (kernels/qlinear.py), and so is the logits head; a
    tied embedding then lives only in the head's packed form, its rows dequantized on lookup.
    `cos_sin`: one rope table for every layer, or the tables by the names in `shape.layer_rope`.
    """

    def __init__(
        self,
        shape: DecoderShape,
        weights: Mapping[str, Weight],
        cos_sin: torch.Tensor | Mapping[str, torch.Tensor],
        dtype: torch.dtype | None = None,
        quantization: str = "none",
    ) -> None:
        self.shape = shape
        stored_embed = weights["model.embed_tokens.weight"]
        self.dtype = dtype or dense(weights["model.norm.weight"]).dtype
        self.quantization = quantization
        self.layers = [
            DecoderLayer(shape, weights, f"model.layers.{i}.", self.dtype, quantization, index=i)
            for i in range(shape.num_layers)
        ]
        self.final_norm = (dense(weights["model.norm.weight"], torch.float32) + shape.norm_offset).to(self.dtype)
        stored_head = weights.get("lm_head.weight")
        tied = shape.tie_word_embeddings or stored_head is None
        self.embed: torch.Tensor | None = None
        self.packed_embed: PackedWeight | None = None  # an untied embedding kept quantized (a GGUF's blocks)
        self.lm_head: LinearLayer
        if quantization == "none":
            self.embed = dense(stored_embed, self.dtype).contiguous()
            self.lm_head = Linear(self.embed if tied or stored_head is None else dense(stored_head, self.dtype))
        else:
            self.lm_head = make_head(stored_embed if tied or stored_head is None else stored_head, quantization)
            if not tied:
                embedding = make_embedding(stored_embed, self.dtype, quantization)
                if isinstance(embedding, torch.Tensor):
                    self.embed = embedding
                else:
                    self.packed_embed = embedding
            self._place_packed_weights_together()
        tables = {"default": cos_sin} if isinstance(cos_sin, torch.Tensor) else dict(cos_sin)
        self.rope_tables = tables
        self.cos_sin = tables.get("default", next(iter(tables.values())))  # what the fused decode stack reads
        self._decode_stack: DecodeStack | None = None

    def _layer_cos_sin(self, layer: DecoderLayer) -> torch.Tensor:
        return self.rope_tables.get(layer.rope, self.cos_sin)

    def _place_packed_weights_together(self) -> None:
        """One buffer on huge pages for the packed weights, in the order a decode step reads them."""
        linears = [linear for layer in self.layers for linear in layer.linears]
        packed = [linear for linear in [*linears, self.lm_head] if isinstance(linear, PackedLinear)]
        move_together(packed)

    def weight_nbytes(self) -> int:
        """Bytes of the linears, logits head and embedding as held in memory (a tied embedding once)."""

        def linear_bytes(linear: LinearLayer) -> int:
            if isinstance(linear, PackedLinear):
                return linear.nbytes()
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
            hidden = F.embedding(input_ids, self.embed)
        elif self.packed_embed is not None:
            hidden = embedding_rows(self.packed_embed, input_ids).to(self.dtype).view(*input_ids.shape, -1)
        else:
            assert isinstance(self.lm_head, PackedLinear)
            hidden = embedding_rows(self.lm_head.weight, input_ids).to(self.dtype).view(*input_ids.shape, -1)
        if self.shape.embedding_scale is not None:
            # Gemma: the scale rounded to the activations' type first, as transformers does
            hidden = hidden * torch.tensor(self.shape.embedding_scale, dtype=hidden.dtype)
        return hidden

    def has_fused_decode(self, config: EngineConfig, kv_dtype: torch.dtype) -> bool:
        """Whether decode steps under `config`, over a KV cache of `kv_dtype`, run as one native call
        (`decode_stack`)."""
        if self.quantization == "none" or config.torch_device.type != "cpu" or not config.heads_major_kv:
            return False
        shape = self.shape
        probe_cache = heads_major_cache(1, config.block_size, shape.num_kv_heads, shape.head_dim, kv_dtype)
        return self.decode_stack_applies(torch.empty(0, shape.hidden_size, dtype=self.dtype), probe_cache)

    def decode_stack_applies(self, hidden: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """The native stack implements Llama's layers only: other families' decode steps run op by op."""
        return (
            self.quantization != "none"
            and self.shape.runs_as_llama
            and self.cos_sin.dtype == torch.float32
            and kernels.decode_stack_available(hidden, key_cache, self.shape.num_heads)
        )

    def decode_stack(self, hidden: torch.Tensor, kv_caches: KVCaches) -> DecodeStack | None:
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
            qkv_proj, o, gate_up, down = (linear for linear in linears if isinstance(linear, PackedLinear))
            weights.append(
                DecoderLayerWeights(
                    layer.input_norm,
                    layer.post_attention_norm,
                    qkv_proj.weights,
                    qkv_proj.biases(),
                    o.weight,
                    gate_up.weight,
                    down.weight,
                )
            )
        shape = self.shape
        stack_shape = StackShape(
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.rms_norm_eps, self.layers[0].scale
        )
        self._decode_stack = DecodeStack(weights, self.final_norm, self.cos_sin, stack_shape, kv_caches)
        return self._decode_stack

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: KVCaches
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if meta.num_prefills == 0 and (stack := self.decode_stack(hidden, kv_caches)) is not None:
            return stack(hidden, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
        residual = None
        eps = self.shape.rms_norm_eps
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches, strict=False):
            normed, residual = kernels.rms_norm(hidden, layer.input_norm, eps, residual)
            hidden = layer.attention(normed, positions, self._layer_cos_sin(layer), key_cache, value_cache, meta)
            if layer.attention_out_norm is not None:
                hidden, _ = kernels.rms_norm(hidden, layer.attention_out_norm, eps)
            normed, residual = kernels.rms_norm(hidden, layer.post_attention_norm, eps, residual)
            hidden = layer.mlp(normed)
            if layer.mlp_out_norm is not None:
                hidden, _ = kernels.rms_norm(hidden, layer.mlp_out_norm, eps)
        normed, _ = kernels.rms_norm(hidden, self.final_norm, eps, residual)
        return normed

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.shape.final_softcap
        if cap is not None:  # Gemma 2's final logit soft-capping
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits
