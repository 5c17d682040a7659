"""The engine on a device: device resolution, the token-major KV layout the GPU kernels read, and the
padding of CUDA-graph decode replays. All of it runs on the CPU; the CUDA-only tests skip without a GPU."""

from __future__ import annotations

import pytest
import torch

import kernels
from app.settings import SettingsError, settings_from
from engine import runner as runner_module
from engine.config import EngineConfig, resolve_device
from engine.cuda_graphs import (
    DecodeInputs,
    capture_sizes,
    decode_metadata,
    pad_decode_inputs,
    padded_size,
)
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from kernels.cpu_attention import is_heads_major
from tests.support.engine import hf_greedy_tokens, run_to_completion

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, *range(5 + i, 5 + i + 3 * i + 2)] for i in range(7)]  # lengths 3 .. 21


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir), device="cpu"))


@pytest.fixture
def reference_kernels():
    kernels.force_reference(True)
    yield
    kernels.force_reference(False)


# ---- device resolution -------------------------------------------------------------------------------
def test_auto_is_cuda_when_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


def test_cpu_resolves_to_cpu():
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_index_is_kept_and_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["mps", "gpu", "cuda:x", ""])
def test_unknown_devices_are_refused(name):
    with pytest.raises(ValueError, match="device must be"):
        resolve_device(name)


@no_cuda
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="sees no CUDA device"):
        EngineConfig(device="cuda")


@no_cuda
def test_serve_flag_and_env_reach_the_engine_config():
    assert settings_from({"device": "cpu"}, {}).engine.device == "cpu"
    assert settings_from({}, {"TOKENMILL_DEVICE": "cpu", "TOKENMILL_ENFORCE_EAGER": "1"}).engine.enforce_eager
    assert settings_from({}, {}).engine.device == "auto"
    with pytest.raises(SettingsError, match="sees no CUDA device"):
        settings_from({"device": "cuda"}, {})


def test_heads_major_layout_is_cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not EngineConfig(device="cuda").heads_major_kv
    with pytest.raises(ValueError, match="CPU-only"):
        EngineConfig(device="cuda", kv_layout="heads_major")


def test_a_model_loaded_elsewhere_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="loaded on cpu"):
        LLMEngine(EngineConfig(device="cuda", num_kv_blocks=8), tiny)


# ---- the token-major layout (the GPU's), on the CPU ---------------------------------------------------
def test_cpu_cache_is_heads_major_unless_token_major_is_asked(tiny):
    default = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=8), tiny).runner
    token_major = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=8, kv_layout="token_major"), tiny).runner
    assert all(is_heads_major(k) and is_heads_major(v) for k, v in default.kv_caches)
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in token_major.kv_caches)
    assert token_major.graphs is None and token_major.dummy_block is None  # no graphs on the CPU


def hf_greedy(folder, prompt, max_new):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf_greedy_tokens(model, prompt, max_new, eos_token_id=None)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_token_major_reference_path_matches_the_default_and_hf(tiny, tiny_llama_dir, reference_kernels, mode):
    settings = {
        "device": "cpu",
        "block_size": 8,
        "num_kv_blocks": 12,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 24,
        "preemption_mode": mode,
        "enable_prefix_caching": False,
    }
    token_major = run_to_completion(LLMEngine(EngineConfig(kv_layout="token_major", **settings), tiny), PROMPTS, GREEDY)
    kernels.force_reference(False)
    default = run_to_completion(LLMEngine(EngineConfig(**settings), tiny), PROMPTS, GREEDY)
    assert token_major == default
    assert token_major["r0"][0] == hf_greedy(tiny_llama_dir, PROMPTS[0], GREEDY.max_tokens)


# ---- CUDA-graph bucketing and padding -----------------------------------------------------------------
def test_capture_sizes_are_powers_of_two_then_the_cap():
    assert capture_sizes(1) == [1]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_a_batch_pads_to_the_next_captured_size():
    sizes = capture_sizes(100)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    assert padded_size(101, sizes) is None  # larger than every graph: eager


def decode_batch(tables: list[list[int]], lens: list[int], block_size: int) -> DecodeInputs:
    width = max(map(len, tables))
    table = torch.tensor([row + [0] * (width - len(row)) for row in tables], dtype=torch.int32)
    positions = [n - 1 for n in lens]
    slots = [row[p // block_size] * block_size + p % block_size for row, p in zip(tables, positions)]
    return DecodeInputs(
        torch.arange(3, 3 + len(lens)),
        torch.tensor(positions),
        torch.tensor(slots),
        table,
        torch.tensor(lens, dtype=torch.int32),
    )


def test_padding_rows_live_in_the_dummy_block_only():
    block_size, dummy = 4, 9
    real = decode_batch([[3, 0, 5], [7]], [11, 2], block_size)
    padded = pad_decode_inputs(real, 8, 6, dummy, block_size)
    for name in ("token_ids", "positions", "slot_mapping", "context_lens"):
        assert torch.equal(getattr(padded, name)[:2], getattr(real, name))
    assert torch.equal(padded.block_tables[:2, :3], real.block_tables)
    assert (padded.block_tables[2:] == dummy).all() and (padded.block_tables[:, 3:] == dummy).all()
    assert ((padded.slot_mapping[2:] // block_size) == dummy).all()
    # A padding row reads positions below its context length: only the dummy block.
    assert (padded.context_lens[2:] == 1).all() and (padded.positions[2:] == 0).all()


def test_a_batch_that_does_not_fit_is_refused():
    real = decode_batch([[1, 2, 3]], [9], 4)
    with pytest.raises(ValueError):
        pad_decode_inputs(real, 1, 2, 9, 4)


def test_padded_forward_leaves_real_blocks_and_rows_as_unpadded(tiny, reference_kernels):
    shape, block_size, dummy = tiny.shape, 4, 6
    torch.manual_seed(0)
    caches = [
        tuple(torch.randn(dummy + 1, block_size, shape.num_kv_heads, shape.head_dim) for _ in "kv")
        for _ in range(shape.num_layers)
    ]
    padded_caches = [(k.clone(), v.clone()) for k, v in caches]
    initial = [(k.clone(), v.clone()) for k, v in caches]
    real = decode_batch([[2, 0], [5], [1, 3]], [6, 3, 8], block_size)
    expected = tiny.model.forward(real.token_ids, real.positions, decode_metadata(real), caches)
    padded = pad_decode_inputs(real, 8, 5, dummy, block_size)
    hidden = tiny.model.forward(padded.token_ids, padded.positions, decode_metadata(padded), padded_caches)
    # MKL's sgemm may sum in another order for 8 rows than for 3: equal up to float32 rounding.
    torch.testing.assert_close(hidden[:3], expected, atol=1e-5, rtol=1e-5)
    untouched = 4  # in no real block table: padding must not write it either
    for (k, v), (pk, pv), (k0, v0) in zip(caches, padded_caches, initial):
        torch.testing.assert_close(pk[:dummy], k[:dummy], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pv[:dummy], v[:dummy], atol=1e-5, rtol=1e-5)
        assert torch.equal(pk[untouched], k0[untouched]) and torch.equal(pv[untouched], v0[untouched])


@pytest.mark.parametrize("layout", ["token_major", "auto"])
def test_graph_replay_path_on_the_cpu_matches_eager(tiny, monkeypatch, layout):
    """The runner's graph path (dummy block, padding, replay buffers) with the CPU's stand-in for replay."""
    settings = {"device": "cpu", "block_size": 8, "num_kv_blocks": 24, "max_num_seqs": 8, "kv_layout": layout}
    eager = run_to_completion(LLMEngine(EngineConfig(**settings), tiny), PROMPTS, GREEDY)
    monkeypatch.setattr(runner_module, "uses_decode_graphs", lambda config, device: True)
    engine = LLMEngine(EngineConfig(**settings), tiny)
    assert engine.runner.dummy_block == 24 and engine.blocks.num_blocks == 24
    assert engine.runner.kv_caches[0][0].shape[0] == 25
    replays = []
    run = engine.runner.graphs.run
    monkeypatch.setattr(
        engine.runner.graphs, "run", lambda inputs: replays.append(len(inputs.token_ids)) or run(inputs)
    )
    assert run_to_completion(engine, PROMPTS, GREEDY) == eager
    assert set(replays) - {1, 2, 4, 8}  # batches of other sizes were padded


# ---- on a GPU ---------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_engine_matches_cpu_greedy(tiny_llama_dir, tiny, enforce_eager):
    gpu = load_model(EngineConfig(model=str(tiny_llama_dir), device="cuda"))
    engine = LLMEngine(
        EngineConfig(device="cuda", block_size=16, num_kv_blocks=32, max_num_seqs=8, enforce_eager=enforce_eager), gpu
    )
    assert (engine.runner.graphs is None) == enforce_eager
    cpu = run_to_completion(
        LLMEngine(EngineConfig(device="cpu", num_kv_blocks=32, max_num_seqs=8), tiny), PROMPTS, GREEDY
    )
    assert run_to_completion(engine, PROMPTS, GREEDY) == cpu


@needs_cuda
def test_cuda_swap_pool_is_pinned_cpu_memory(tiny_llama_dir):
    gpu = load_model(EngineConfig(model=str(tiny_llama_dir), device="cuda"))
    runner = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=8, preemption_mode="swap"), gpu).runner
    key_cache, _ = runner.cpu_kv_caches[0]
    assert key_cache.device.type == "cpu" and key_cache.is_pinned() and key_cache.is_contiguous()
    assert runner.kv_caches[0][0].is_cuda and runner.kv_caches[0][0].is_contiguous()


# ---- the GPU benchmark's end-to-end part, at toy size on the CPU -------------------------------------------
def test_gpu_bench_end_to_end_runs_at_toy_size_on_the_cpu(monkeypatch, tmp_path):
    import json

    from bench import gpu_e2e

    toy = {
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_theta": 1e4,
    }
    for name, value in {
        "DEVICE": "cpu",
        "SMOLLM2_SHAPE": toy,
        "LLAMA_1B_SHAPE": toy,
        "CONCURRENCY": (1, 3),
        "PROMPT_RANGE": (4, 12),
        "OUTPUT_TOKENS": 6,
        "CHECK_PROMPTS": 2,
        "CHECK_TOKENS": 5,
    }.items():
        monkeypatch.setattr(gpu_e2e, name, value)
    monkeypatch.setattr(gpu_e2e, "smollm2", lambda dtype, folder: (None, "random (toy)"))
    report = gpu_e2e.run_end_to_end(tmp_path)
    assert report["ok"] and report["float32_check"]["eager_equal_hf"]
    assert len(report["throughput"]) == 2 * 2 * 2  # models x graphs on/off x concurrencies
    assert all(row["output_tokens"] == 6 * row["concurrency"] for row in report["throughput"])
    assert (tmp_path / "gpu_e2e.png").stat().st_size > 0
    json.dumps(report)
