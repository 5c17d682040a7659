"""The fused decode step (kernels/decode_stack.py): a decode step's layers in one native call must give the
per-op path's output bit for bit, and write the same KV entries, for every packed format and dtype, with
attention biases (Qwen2) and sequences of different lengths sharing a pool."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.models.llama import AttentionMetadata, LlamaForCausalLM, LlamaShape
from kernels.cpu_attention import heads_major_cache
from kernels.decode_stack import available

pytestmark = pytest.mark.skipif(not available(torch.float32), reason="the native CPU kernels can't be built here")

SHAPE = LlamaShape(
    vocab_size=96,
    hidden_size=80,  # not a multiple of 32: the packed weights pad their inputs
    intermediate_size=112,
    num_layers=3,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    attention_bias=True,
)
BLOCK_SIZE = 8


def tiny_model(dtype: torch.dtype, quantization: str) -> LlamaForCausalLM:
    generator = torch.Generator().manual_seed(7)

    def randn(*size: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*size, generator=generator) * scale

    s = SHAPE
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    weights = {"model.embed_tokens.weight": randn(s.vocab_size, s.hidden_size, scale=1.0)}
    weights["model.norm.weight"] = 1 + randn(s.hidden_size)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            weights[f"{p}self_attn.{name}_proj.weight"] = randn(rows, s.hidden_size)
            weights[f"{p}self_attn.{name}_proj.bias"] = randn(rows)
        weights[f"{p}self_attn.o_proj.weight"] = randn(s.hidden_size, q)
        weights[f"{p}mlp.gate_proj.weight"] = randn(s.intermediate_size, s.hidden_size)
        weights[f"{p}mlp.up_proj.weight"] = randn(s.intermediate_size, s.hidden_size)
        weights[f"{p}mlp.down_proj.weight"] = randn(s.hidden_size, s.intermediate_size)
        weights[f"{p}input_layernorm.weight"] = 1 + randn(s.hidden_size)
        weights[f"{p}post_attention_layernorm.weight"] = 1 + randn(s.hidden_size)
    angles = torch.arange(s.max_position_embeddings)[:, None] * torch.rand(s.head_dim // 2, generator=generator)
    angles = torch.cat((angles, angles), dim=-1)
    cos_sin = torch.stack((angles.cos(), angles.sin()), dim=1).contiguous()
    return LlamaForCausalLM(s, weights, cos_sin, dtype=dtype, quantization=quantization)


def caches(dtype: torch.dtype, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            heads_major_cache(blocks, BLOCK_SIZE, SHAPE.num_kv_heads, SHAPE.head_dim, dtype),
            heads_major_cache(blocks, BLOCK_SIZE, SHAPE.num_kv_heads, SHAPE.head_dim, dtype),
        )
        for _ in range(SHAPE.num_layers)
    ]


def metadata(tables: torch.Tensor, lengths: list[int], new_tokens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for a step where sequence i has lengths[i] tokens after it and new_tokens[i] of them are new."""
    positions = [p for length, new in zip(lengths, new_tokens) for p in range(length - new, length)]
    rows = [i for i, new in enumerate(new_tokens) for _ in range(new)]
    slots = torch.tensor(
        [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for i, p in zip(rows, positions)]
    )
    decode = all(new == 1 for new in new_tokens)
    counts = torch.tensor([0] + ([] if decode else new_tokens), dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    empty_tables = tables[:0]
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=len(new_tokens) if decode else 0,
        decode_block_tables=tables if decode else empty_tables,
        decode_context_lens=lens if decode else lens[:0],
        prefill_block_tables=empty_tables if decode else tables,
        prefill_query_start_loc=torch.cumsum(counts, 0, dtype=torch.int32),
        prefill_context_lens=lens[:0] if decode else lens,
        num_prefills=0 if decode else len(new_tokens),
    )
    return meta, torch.tensor(positions)


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_fused_decode_steps_equal_the_per_op_path_bit_for_bit(dtype, cache_dtype, quantization, monkeypatch):
    model = tiny_model(dtype, quantization)
    prompt_lengths = [3, 11, 20]  # within one block, across two, across three
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, SHAPE.vocab_size, (sum(prompt_lengths),), generator=generator)
    fused_caches = caches(cache_dtype, 12)
    meta, positions = metadata(tables, prompt_lengths, prompt_lengths)
    model.forward(prompt_ids, positions, meta, fused_caches)  # a prefill: always per op
    per_op_caches = [(k.clone(), v.clone()) for k, v in fused_caches]  # clones keep the heads-major strides

    lengths = list(prompt_lengths)
    for _ in range(6):  # the 20-token sequence crosses into its fourth block
        lengths = [n + 1 for n in lengths]
        ids = torch.randint(0, SHAPE.vocab_size, (len(lengths),), generator=generator)
        meta, positions = metadata(tables, lengths, [1] * len(lengths))
        hidden = model.embed_tokens(ids)
        assert model.decode_stack(hidden, fused_caches) is not None, "the fused path was not taken"
        fused = model.forward(ids, positions, meta, fused_caches)
        with monkeypatch.context() as patch:
            patch.setattr(model, "decode_stack", lambda hidden, kv_caches: None)
            per_op = model.forward(ids, positions, meta, per_op_caches)
        assert fused.dtype == dtype and torch.equal(fused, per_op)
        for (fused_k, fused_v), (per_op_k, per_op_v) in zip(fused_caches, per_op_caches):
            assert torch.equal(fused_k, per_op_k) and torch.equal(fused_v, per_op_v)


def test_prefill_and_unquantized_models_keep_the_per_op_path():
    caches_ = caches(torch.float32, 4)
    hidden = torch.zeros(1, SHAPE.hidden_size)
    assert tiny_model(torch.float32, "none").decode_stack(hidden, caches_) is None
    kernels.use_native_cpu(False)
    try:
        assert tiny_model(torch.float32, "int4").decode_stack(hidden, caches_) is None
    finally:
        kernels.use_native_cpu(True)


@pytest.mark.parametrize("switch_off", [kernels.use_native_cpu, lambda off: kernels.force_reference(not off)])
def test_a_built_stack_is_not_used_once_the_native_kernels_are_switched_off(switch_off):
    """The model keeps its stack between steps without re-checking that it applies; switching the native
    kernels off (or forcing the references) must still send decode steps down the per-op path."""
    caches_ = caches(torch.float32, 4)
    hidden = torch.zeros(1, SHAPE.hidden_size)
    model = tiny_model(torch.float32, "int4")
    stack = model.decode_stack(hidden, caches_)
    assert stack is not None and model.decode_stack(hidden, caches_) is stack
    switch_off(False)
    try:
        assert model.decode_stack(hidden, caches_) is None
    finally:
        switch_off(True)
    assert model.decode_stack(hidden, caches_) is stack
    assert model.decode_stack(hidden, caches(torch.float32, 4)) is not stack  # other caches: a stack of their own
