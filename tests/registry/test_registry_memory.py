"""The registry's memory check reads a model's size from its headers (safetensors and GGUF alike, no
tensor read) and refuses a load that would not fit, before it starts, with a 409 that says why."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from app.registry.memory import GIB, available_bytes, estimate, gguf_footprint, safetensors_footprint
from app.registry.spec import ModelSpec
from engine.config import EngineConfig
from engine.loader import default_model_path

pytestmark = pytest.mark.real_model


def test_a_checkpoint_folder_is_sized_from_its_safetensors_headers(tiny_llama_dir):
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    footprint = safetensors_footprint(tiny_llama_dir)
    assert footprint.parameters == sum(t.numel() for t in tensors.values())
    assert footprint.stored_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert footprint.layers == config["num_hidden_layers"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert footprint.kv_width == config["num_key_value_heads"] * head_dim


def test_the_embedded_gguf_is_sized_from_its_tensor_index_as_its_conversion_is(smollm2):
    from_gguf = gguf_footprint(default_model_path())
    from_converted = safetensors_footprint(smollm2.folder)
    assert from_gguf.parameters == from_converted.parameters  # 134.5M, tied head counted once
    assert (from_gguf.layers, from_gguf.kv_width) == (
        smollm2.shape.num_layers,
        smollm2.shape.num_kv_heads * smollm2.shape.head_dim,
    )
    assert from_gguf.layers == from_converted.layers and from_gguf.kv_width == from_converted.kv_width


def test_the_estimate_follows_dtype_and_kv_settings(smollm2, tmp_path):
    base = EngineConfig(data_dir=str(smollm2.folder.parent.parent))  # where the converted GGUF is cached

    def spec(dtype: str, **settings) -> ModelSpec:
        return ModelSpec(
            name="m", kind="chat", source="default", architecture="llama", dtype=dtype, engine_settings=settings
        )

    small = estimate(spec("float32", num_kv_blocks=128), base)
    wide = estimate(spec("float32", num_kv_blocks=4096), base)
    shape = smollm2.shape
    per_block = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 16 * 4
    assert (small.kv_bytes, wide.kv_bytes) == (128 * per_block, 4096 * per_block)
    assert small.conversion_bytes == 0  # converted already: read from the safetensors cache
    half = estimate(spec("bfloat16", num_kv_blocks=128), base)
    assert half.weights_bytes * 2 == small.weights_bytes and half.kv_bytes * 2 == small.kv_bytes
    budget = estimate(spec("float32", kv_cache_memory_gb=2.0), base)
    assert abs(budget.kv_bytes - 2 * GIB) <= per_block
    swapping = estimate(spec("float32", num_kv_blocks=128, preemption_mode="swap"), base)
    assert swapping.kv_bytes == 2 * small.kv_bytes  # the CPU swap pool defaults to the device pool's size
    packed = estimate(spec("float32", num_kv_blocks=128, quantization="int4"), base)
    assert packed.kv_bytes * 2 == small.kv_bytes  # packed weights keep a bfloat16 cache under float32
    chosen = estimate(spec("float32", num_kv_blocks=128, quantization="int4", kv_cache_dtype="float32"), base)
    assert chosen.kv_bytes == small.kv_bytes
    fresh = estimate(spec("float32", num_kv_blocks=128), EngineConfig(data_dir=str(tmp_path)))
    assert fresh.conversion_bytes > 0  # nothing converted in an empty data folder: the GGUF is read


def test_unreadable_weights_leave_the_load_unchecked(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not a header")
    assert safetensors_footprint(tmp_path) is None
    assert safetensors_footprint(tmp_path / "nothing-here") is None
    assert gguf_footprint(tmp_path / "model.safetensors") is None
    assert 0 < available_bytes()
