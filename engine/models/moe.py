"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks `top_k` experts per token, and only
those run, each once over all the batch's tokens routed to it.

Tokens are grouped by expert with one sort; experts add their weighted outputs in ascending expert order, as
transformers does, so float32 results match it exactly. Each expert's gate/up and down are ordinary linears
(`make_linear`), so int8/int4 packing applies to experts as to any dense layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.models.shape import MoEShape, UnsupportedModel
from engine.models.weights import LinearLayer, Weight, dense, make_linear


def _expert_slice(weight: Weight, number: int) -> Weight:
    return weight[number] if isinstance(weight, torch.Tensor) else weight.expert(number)


def expert_weights(weights: dict[str, Weight], prefix: str, number: int) -> tuple[list[Weight], Weight]:
    """([gate, up] or [gate_up], down) of one expert, under any of the names checkpoints use: per expert
    (Qwen `mlp.experts.N.gate_proj`, Mixtral `block_sparse_moe.experts.N.w1/w3/w2`) or stacked in 3-D tensors
    (transformers 5's fused `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], or separate
    `gate_proj`/`up_proj` stacks)."""
    qwen = f"{prefix}mlp.experts.{number}."
    if f"{qwen}gate_proj.weight" in weights:
        gate_up = [weights[f"{qwen}gate_proj.weight"], weights[f"{qwen}up_proj.weight"]]
        return gate_up, weights[f"{qwen}down_proj.weight"]
    mixtral = f"{prefix}block_sparse_moe.experts.{number}."
    if f"{mixtral}w1.weight" in weights:
        return [weights[f"{mixtral}w1.weight"], weights[f"{mixtral}w3.weight"]], weights[f"{mixtral}w2.weight"]
    down = _stacked(weights, prefix, "down_proj")
    if down is not None:
        fused = _stacked(weights, prefix, "gate_up_proj")
        if fused is not None:
            return [_expert_slice(fused, number)], _expert_slice(down, number)
        gate, up = _stacked(weights, prefix, "gate_proj"), _stacked(weights, prefix, "up_proj")
        if gate is not None and up is not None:
            return [_expert_slice(gate, number), _expert_slice(up, number)], _expert_slice(down, number)
    raise UnsupportedModel(f"no weights for expert {number} under {prefix!r}")


def _stacked(weights: dict[str, Weight], prefix: str, name: str) -> Weight | None:
    for key in (f"{prefix}mlp.experts.{name}", f"{prefix}mlp.experts.{name}.weight"):
        if key in weights:
            return weights[key]
    return None


def _router_weight(weights: dict[str, Weight], prefix: str) -> Weight:
    for name in (f"{prefix}mlp.gate.weight", f"{prefix}block_sparse_moe.gate.weight"):
        if name in weights:
            return weights[name]
    raise UnsupportedModel(f"no router weight under {prefix!r}")


class SparseMoE:
    def __init__(
        self,
        moe: MoEShape,
        weights: dict[str, Weight],
        prefix: str,
        dtype: torch.dtype,
        quantization: str,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.moe = moe
        self.activation = activation
        self.router = dense(_router_weight(weights, prefix), dtype)  # [experts, hidden], small: kept dense
        self.experts: list[tuple[LinearLayer, LinearLayer]] = []
        for number in range(moe.num_experts):
            gate_up, down = expert_weights(weights, prefix, number)
            self.experts.append(
                (make_linear(gate_up, None, dtype, quantization), make_linear([down], None, dtype, quantization))
            )
        self.shared: tuple[LinearLayer, LinearLayer] | None = None
        self.shared_gate: torch.Tensor | None = None
        shared = f"{prefix}mlp.shared_expert."
        if moe.shared_intermediate_size and f"{shared}gate_proj.weight" in weights:
            gate_up_parts = [weights[f"{shared}gate_proj.weight"], weights[f"{shared}up_proj.weight"]]
            self.shared = (
                make_linear(gate_up_parts, None, dtype, quantization),
                make_linear([weights[f"{shared}down_proj.weight"]], None, dtype, quantization),
            )
            self.shared_gate = dense(weights[f"{prefix}mlp.shared_expert_gate.weight"], dtype)

    @property
    def linears(self) -> list[LinearLayer]:
        shared = list(self.shared) if self.shared is not None else []
        return [linear for pair in self.experts for linear in pair] + shared

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        probs = torch.softmax(F.linear(hidden, self.router).float(), dim=-1)
        top_weights, top_experts = torch.topk(probs, moe.top_k, dim=-1)  # [tokens, k]
        if moe.normalize_top_k:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        top_weights = top_weights.to(hidden.dtype)
        # one sort groups the (token, choice) pairs by expert; each expert then runs once over its tokens
        flat_experts = top_experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        tokens = order // moe.top_k
        pair_weights = top_weights.reshape(-1)[order]
        counts = torch.bincount(flat_experts, minlength=moe.num_experts).tolist()
        out = torch.zeros_like(hidden)
        start = 0
        for number, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate_up, down = self.experts[number]
            expert_out = down(self.activation(gate_up(hidden[rows])))
            out.index_add_(0, rows, expert_out * pair_weights[start : start + count, None])
            start += count
        if self.shared is not None and self.shared_gate is not None:
            gate_up, down = self.shared
            shared_out = down(self.activation(gate_up(hidden)))
            out = out + torch.sigmoid(F.linear(hidden, self.shared_gate)) * shared_out
        return out
