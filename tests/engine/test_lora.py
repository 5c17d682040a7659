"""LoRA adapters in mixed batches: each adapter's greedy output equals HF transformers + PEFT (float32) token for
token, inside one batch that mixes the base model and several adapters, through preemption, prefix sharing
and a resident pool smaller than the adapters in use. Adapters are made here with PEFT (random, non-zero B)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import engine.lora
import engine.runner
from engine.config import EngineConfig
from engine.llm_engine import EngineRejected, LLMEngine
from engine.loader import load_model
from engine.lora import (
    MODULES,
    AdapterError,
    LoraDims,
    LoraLinear,
    LoraSegment,
    LoraWeights,
    lora_step,
    segments_of,
    weights_from_tensors,
)
from engine.sampling_params import SamplingParams
from kernels import lora as native_lora
from tests.support.engine import QUESTIONS, chat_prompt, hf_greedy_tokens

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Different targets, ranks and scalings, so that a row run under the wrong adapter shows.
ADAPTERS = {
    "team-a": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "team-b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "team-c": dict(r=16, lora_alpha=16, target_modules=["o_proj", "gate_proj", "down_proj"], use_rslora=True),
}
SHARED_PREFIX = "You answer questions about bicycles, helmets and spare parts for the shop's customers. " * 2


def make_adapter(base_model: torch.nn.Module, folder: Path, seed: int, **settings: object) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # init_lora_weights=False: B random too, so the adapter changes the output from the first token
    peft_model = get_peft_model(copy.deepcopy(base_model), LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():  # PEFT's random init is small next to the tiny model's weights: make it matter
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.mul_(3.0)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter_dirs(hf_tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(hf_tiny, root / name, seed, **settings)
        for seed, (name, settings) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def hf_greedy_lora(hf_tiny, adapter_dirs):
    """Greedy continuation by HF transformers (+ PEFT, adapter not merged), per (adapter or None, prompt)."""
    from peft import PeftModel

    models: dict[str | None, torch.nn.Module] = {None: hf_tiny}
    for name, folder in adapter_dirs.items():
        models[name] = PeftModel.from_pretrained(copy.deepcopy(hf_tiny), folder).eval()
    memo: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}

    def generate(adapter: str | None, prompt: list[int]) -> list[int]:
        key = (adapter, tuple(prompt))
        if key not in memo:
            memo[key] = hf_greedy_tokens(models[adapter], prompt, MAX_NEW, min_new_tokens=MAX_NEW)
        return memo[key]

    return generate


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))


def lora_engine(loaded, adapter_dirs, **settings) -> LLMEngine:
    settings.setdefault("dtype", "float32")
    engine = LLMEngine(EngineConfig(**settings), loaded)
    for name, folder in adapter_dirs.items():
        engine.register_adapter(name, str(folder))
    return engine


def run_mixed(
    engine: LLMEngine, jobs: list[tuple[str | None, list[int]]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """All jobs (adapter, prompt) submitted at once, stepped to the end; each job's output tokens."""
    results: list[list[int]] = [[] for _ in jobs]
    for number, (adapter, prompt) in enumerate(jobs):
        engine.add_request(f"r{number}", prompt, params, adapter=adapter)
    for _ in range(10_000):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            for delta in output.deltas:
                results[int(output.request_id[1:])].extend(delta.token_ids)
    assert not engine.has_unfinished
    return results


def mixed_jobs(tokenizer) -> list[tuple[str | None, list[int]]]:
    """Every question under the base and each adapter, interleaved so every step mixes them; half share a
    long system prompt, so the prefix cache has the same blocks to offer under every adapter."""
    names: list[str | None] = [None, *ADAPTERS]
    jobs = []
    for number, question in enumerate(QUESTIONS[:6]):
        system = SHARED_PREFIX if number % 2 == 0 else None
        prompt = chat_prompt(tokenizer, question, system=system)
        jobs.extend((names[(number + k) % len(names)], prompt) for k in range(len(names)))
    return jobs


def assert_each_matches_hf(jobs, results, hf_greedy_lora) -> None:
    for (adapter, prompt), tokens in zip(jobs, results, strict=True):
        assert tokens == hf_greedy_lora(adapter, prompt), f"adapter {adapter} diverged from HF + PEFT"


def test_adapters_really_change_the_output(tiny, hf_greedy_lora):
    prompt = chat_prompt(tiny.tokenizer, QUESTIONS[0])
    outputs = {name: tuple(hf_greedy_lora(name, prompt)) for name in [None, *ADAPTERS]}
    assert len(set(outputs.values())) == len(outputs), "the adapters must be told apart by their output"


@pytest.mark.parametrize("path", ["native", "torch"])
def test_mixed_batch_matches_hf_peft(tiny, adapter_dirs, hf_greedy_lora, path, monkeypatch):
    """Both ways of adding the adapters: the native kernel, one call per fused linear for all of a step's
    adapters (kernels/lora.py), and torch's matmuls per adapter (GPUs, no compiler, native kernels off)."""
    if path == "torch":
        monkeypatch.setattr(engine.lora, "native_step", lambda model, segments: None)
    elif not native_lora.available(torch.float32):
        pytest.skip("no C++ compiler: the native kernels can't be built here")
    calls = count_native_calls(monkeypatch)
    served = lora_engine(tiny, adapter_dirs, num_kv_blocks=256)
    jobs = mixed_jobs(tiny.tokenizer)
    results = run_mixed(served, jobs)
    assert_each_matches_hf(jobs, results, hf_greedy_lora)
    assert served.blocks.num_used_blocks == 0
    assert served.adapters.users == {}
    assert (calls["add"] > 0) == (path == "native")


def count_native_calls(monkeypatch) -> dict[str, int]:
    """Counts the native kernel's calls from Python (`add`) and decode steps the fused stack ran with adapters."""
    calls = {"add": 0, "stack": 0}
    add, stack_call = native_lora.LoraStep.add, engine.lora._StackWithLora.__call__

    def counted_add(self, *args):
        calls["add"] += 1
        return add(self, *args)

    def counted_stack(self, *args):
        calls["stack"] += 1
        return stack_call(self, *args)

    monkeypatch.setattr(native_lora.LoraStep, "add", counted_add)
    monkeypatch.setattr(engine.lora._StackWithLora, "__call__", counted_stack)
    return calls


def random_adapter(dims: LoraDims, rank: int, seed: int, dtype: torch.dtype, modules=MODULES) -> LoraWeights:
    """An adapter as PEFT names its tensors, random, on every layer's `modules`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(dims.num_layers):
        for module in modules:
            in_features, out_features = dims.modules[module]
            part = "self_attn" if module in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}_proj.lora_"
            tensors[key + "A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.3
            tensors[key + "B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.3
    return weights_from_tensors(f"random-{seed}", tensors, 2.0, dims, dtype)


@pytest.mark.parametrize(
    "dtype,quantization,split_qkv",
    [
        (torch.float32, "int8", False),
        (torch.bfloat16, "int4", False),
        (torch.float32, "none", False),
        (torch.float32, "int8", True),
    ],
)
def test_base_rows_get_no_delta_and_the_fused_stack_adds_as_per_op(dtype, quantization, split_qkv, monkeypatch):
    """One decode step over four sequences, rows 1-3 under two adapters (row 0 the base): the base's row equals a
    step without adapters bit for bit; with packed weights the step runs as the fused native stack, the deltas
    added inside it, and equals the per-op path (each linear wrapped) bit for bit. `split_qkv`: q/k/v as two
    packed weights of different formats (a Q4_K_M's q/k int4k and v int6k; here int8 and int4), the stack's
    `qkv_tail`, with the adapters' q/k/v deltas added over both parts."""
    from kernels.qlinear import PackedLinear, dequantize, pack_weight
    from tests.kernels import test_decode_stack as stack_test

    if not native_lora.available(dtype):
        pytest.skip("no C++ compiler: the native kernels can't be built here")
    model = stack_test.tiny_model(dtype, quantization)
    if split_qkv:
        for layer in model.layers:
            assert isinstance(layer.qkv_proj, PackedLinear)
            weight, first = dequantize(layer.qkv_proj.weight), layer.q_size + layer.kv_size
            layer.qkv_proj = PackedLinear(
                pack_weight(weight[:first], "int8", 32),
                bias=layer.qkv_proj.bias,
                tail=pack_weight(weight[first:], "int4"),
            )
    dims = LoraDims.of_model(model)
    first = random_adapter(dims, 4, 1, dtype)
    second = random_adapter(dims, 8, 2, dtype, modules=("q", "v", "o", "down"))
    lengths = [3, 11, 20, 6]
    tables = torch.arange(16, dtype=torch.int32).view(4, 4)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, stack_test.SHAPE.vocab_size, (sum(lengths),), generator=generator)
    caches = stack_test.caches(dtype, 16)
    meta, positions = stack_test.metadata(tables, lengths, lengths)
    model.forward(prompt, positions, meta, caches)  # the prompts, without adapters

    lengths = [n + 1 for n in lengths]
    ids = torch.randint(0, stack_test.SHAPE.vocab_size, (4,), generator=generator)
    meta, positions = stack_test.metadata(tables, lengths, [1] * 4)
    segments = [LoraSegment(1, 2, first), LoraSegment(2, 4, second)]
    calls = count_native_calls(monkeypatch)

    def decode(with_adapters: bool, stack: bool) -> torch.Tensor:
        step_caches = [(k.clone(), v.clone()) for k, v in caches]  # clones keep the heads-major strides
        with monkeypatch.context() as patch:
            if not stack:
                patch.setattr(model, "decode_stack", lambda hidden, kv_caches: None)
            with lora_step(model, segments if with_adapters else []):
                return model.forward(ids, positions, meta, step_caches)

    fused, per_op, plain = decode(True, True), decode(True, False), decode(False, True)
    assert calls["stack"] == (1 if quantization != "none" else 0)
    assert torch.equal(fused[0], plain[0]), "the base's row got a delta"
    assert not torch.equal(fused[1], plain[1]) and not torch.equal(fused[3], plain[3])
    assert torch.equal(fused, per_op)


def test_prefix_cache_never_shares_kv_between_adapters(tiny, adapter_dirs, hf_greedy_lora):
    engine = lora_engine(tiny, adapter_dirs, num_kv_blocks=256)
    prompt = chat_prompt(tiny.tokenizer, QUESTIONS[1], system=SHARED_PREFIX)
    run_mixed(engine, [("team-a", prompt)])  # warms the cache under team-a only
    hits_before = engine.scheduler.counters.prefix_cache_hits
    jobs: list[tuple[str | None, list[int]]] = [(None, prompt), ("team-b", prompt), ("team-c", prompt)]
    results = run_mixed(engine, jobs)
    assert engine.scheduler.counters.prefix_cache_hits == hits_before, "another adapter's KV was reused"
    assert_each_matches_hf(jobs, results, hf_greedy_lora)
    # the same adapter does reuse its own cached prefix
    again = run_mixed(engine, [("team-a", prompt)])
    assert engine.scheduler.counters.prefix_cache_hits > hits_before
    assert again[0] == hf_greedy_lora("team-a", prompt)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_a_small_pool_keep_each_adapter_exact(tiny, adapter_dirs, hf_greedy_lora, mode):
    jobs = mixed_jobs(tiny.tokenizer)
    longest = max(len(prompt) for _, prompt in jobs) + MAX_NEW
    engine = lora_engine(tiny, adapter_dirs, num_kv_blocks=-(-longest // 16) + 8, preemption_mode=mode, max_loras=2)
    results = run_mixed(engine, jobs)
    counters = engine.scheduler.counters
    assert counters.preemptions_recompute + counters.preemptions_swap > 0
    assert engine.adapters.stats.evictions > 0  # 3 adapters through 2 resident slots
    assert len(engine.adapters.resident) <= 2
    assert_each_matches_hf(jobs, results, hf_greedy_lora)


def test_a_broken_grouping_is_caught(tiny, adapter_dirs, hf_greedy_lora, monkeypatch):
    """The oracle tells adapters apart: with every adapter segment run under one adapter's weights, it fails."""

    def one_adapter_for_all(row_adapters: list[LoraWeights | None]) -> list[LoraSegment]:
        segments = segments_of(row_adapters)
        return [LoraSegment(s.start, s.end, segments[0].weights) for s in segments]

    monkeypatch.setattr(engine.runner, "segments_of", one_adapter_for_all)
    lora = lora_engine(tiny, adapter_dirs, num_kv_blocks=256)
    jobs = mixed_jobs(tiny.tokenizer)
    results = run_mixed(lora, jobs)
    with pytest.raises(AssertionError, match="diverged"):
        assert_each_matches_hf(jobs, results, hf_greedy_lora)


@pytest.mark.parametrize("path", ["torch", "native"])
def test_lora_on_int8_base_adds_the_float_low_rank_product(path):
    from engine.lora import FusedLora
    from kernels import lora as native
    from kernels.qlinear import PackedLinear

    if path == "native" and not native.available(torch.float32):
        pytest.skip("no C++ compiler: the native kernels can't be built here")
    torch.manual_seed(0)
    base = PackedLinear(torch.randn(48, 32), "int8")
    a, b = torch.randn(4, 32), torch.randn(48, 4)
    pieces = ((0, 4, 0, 48, (b * 0.5).t().contiguous()),)
    weights = LoraWeights("x", ({"down_proj": FusedLora(a, pieces)},), 0)
    step = None
    if path == "native":  # layer 0's down_proj: the fourth linear of the table
        step = native.LoraStep([(1, 4, native.AdapterTable([None, None, None, (a, pieces)], torch.float32))])
    x = torch.randn(5, 32)
    out = LoraLinear(base, 0, "down_proj", [LoraSegment(1, 4, weights)], step)(x)
    expected = base(x)
    expected[1:4] += 0.5 * (x[1:4] @ a.t() @ b.t())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(out[[0, 4]], base(x)[[0, 4]])  # the base's rows: exactly no delta


def test_unknown_adapter_and_wrong_base_are_refused(tiny, tiny_llama_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=32), tiny)
    with pytest.raises(EngineRejected, match="not registered"):
        engine.add_request("r", [1, 2, 3], GREEDY, adapter="nobody")
    other = LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(
        tmp_path / "wrong"
    )
    with pytest.raises(AdapterError, match=r"q_proj.*do not fit"):
        engine.register_adapter("wrong", str(tmp_path / "wrong"))
    assert "wrong" not in engine.adapters.registered
    wide = tmp_path / "rank"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    get_peft_model(hf, LoraConfig(r=128, target_modules=["v_proj"], init_lora_weights=False)).save_pretrained(wide)
    with pytest.raises(AdapterError, match="rank 128"):
        engine.register_adapter("wide", str(wide))


def test_an_adapter_in_use_cannot_be_removed_or_replaced(tiny, adapter_dirs):
    engine = lora_engine(tiny, adapter_dirs, num_kv_blocks=64, max_loras=1)
    prompt = chat_prompt(tiny.tokenizer, QUESTIONS[0])
    engine.add_request("a", prompt, GREEDY, adapter="team-a")  # holds the one slot
    engine.add_request("b", prompt, GREEDY, adapter="team-b")  # waits for it
    assert [r.request_id for r in engine.waiting_for_adapter] == ["b"]
    for name in ("team-a", "team-b"):
        with pytest.raises(AdapterError, match="in use"):
            engine.unregister_adapter(name)
        with pytest.raises(AdapterError, match="in use"):
            engine.register_adapter(name, str(adapter_dirs["team-c"]))
    engine.abort("b")
    assert not engine.waiting_for_adapter
    engine.unregister_adapter("team-b")
    while engine.has_unfinished:  # "a" to its end
        engine.step()
    assert engine.adapters.users == {}
    engine.unregister_adapter("team-a")
