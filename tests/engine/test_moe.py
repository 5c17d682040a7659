"""The sparse MLP runs only the experts its router picks, each once over the tokens routed to it."""

from __future__ import annotations

import torch

from engine.models.moe import SparseMoE
from engine.models.shape import MoEShape
from kernels.activation import silu_and_mul_reference


def test_only_the_chosen_experts_run_each_once_over_its_tokens():
    experts, hidden, ffn = 6, 16, 8
    generator = torch.Generator().manual_seed(0)
    weights = {"l.mlp.gate.weight": torch.randn(experts, hidden, generator=generator)}
    for number in range(experts):
        for name, size in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)), ("down_proj", (hidden, ffn))):
            weights[f"l.mlp.experts.{number}.{name}.weight"] = torch.randn(*size, generator=generator)
    shape = MoEShape(experts, 2, ffn, normalize_top_k=True, shared_intermediate_size=0)
    moe = SparseMoE(shape, weights, "l.", torch.float32, "none", silu_and_mul_reference)
    calls: list[tuple[int, int]] = []
    for number, (gate_up, down) in enumerate(moe.experts):
        original = gate_up.__call__

        def counting(x: torch.Tensor, number: int = number, original=original) -> torch.Tensor:
            calls.append((number, x.shape[0]))
            return original(x)

        moe.experts[number] = (counting, down)  # type: ignore[assignment]
    x = torch.randn(5, hidden, generator=generator)
    out = moe(x)
    chosen = torch.topk(x @ weights["l.mlp.gate.weight"].T, 2, dim=-1).indices
    assert sorted(number for number, _ in calls) == sorted(set(chosen.flatten().tolist()))  # each once, no others
    assert sum(rows for _, rows in calls) == 5 * 2
    # against the dense definition: every token through its two experts, weights renormalised
    probs = torch.softmax(x @ weights["l.mlp.gate.weight"].T, dim=-1)
    top, index = torch.topk(probs, 2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    expected = torch.zeros_like(x)
    for token in range(5):
        for slot in range(2):
            e = int(index[token, slot])
            w = weights
            gate = x[token] @ w[f"l.mlp.experts.{e}.gate_proj.weight"].T
            up = x[token] @ w[f"l.mlp.experts.{e}.up_proj.weight"].T
            expected[token] += (
                top[token, slot] * (torch.nn.functional.silu(gate) * up) @ w[f"l.mlp.experts.{e}.down_proj.weight"].T
            )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
