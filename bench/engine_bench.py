"""Offline throughput: one fixed-seed workload through our engine and through HF transformers `generate`
in static batches of the same size, per dtype, in one process with the same torch threads.

Reports output tokens/s and the ratio to HF, mean batch occupancy and KV utilisation, and model FLOP
utilisation (MFU) against the matmul peak measured in the same run, overall and during pure decode steps
at full concurrency. Prints a table and writes JSON and a PNG plot under bench/results/.

HF's static batch runs until its longest request is done; only each request's own output length counts
as useful tokens (and FLOPs) on both sides.

    python bench/engine_bench.py                         # 64 requests, bfloat16 and float32 (minutes)
    python bench/engine_bench.py --quick                 # a smoke run: 16 short requests
    python bench/engine_bench.py --dtypes bfloat16 --profile-steps 8
    python bench/engine_bench.py --dtypes float32 --quantization int4   # the engine int4, HF float32
    python bench/engine_bench.py --moe                   # MoE (8 experts, 2 active) vs dense of its active size
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: on a shared machine spinning threads wait for a descheduled sibling at every
# op (a 2048-token step went from 7 s to 74 s at 2 threads). Both sides run under the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import checkpoint_folder, load_model
from engine.models.llama import LlamaShape
from engine.sampling_params import SamplingParams
from kernels.linear import Linear

RESULTS = ROOT / "bench" / "results"
TARGET_RATIO = 4.0
TARGET_DECODE_MFU = 0.40
FIRST_ORDINARY_TOKEN = 3  # 0, 1, 2 are <|endoftext|>, <|im_start|>, <|im_end|>


def say(message: str) -> None:
    print(message, flush=True)


# ---- workload -------------------------------------------------------------------------------------
@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    seed: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    count: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> Workload:
    """Random token prompts (no prefix sharing) and forced output lengths, uniform in the ranges."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(count):
        length = rng.randint(*prompt_range)
        prompts.append([rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(length)])
        output_lens.append(rng.randint(*output_range))
    return Workload(prompts, output_lens, seed, prompt_range, output_range)


# ---- model FLOPs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFlops:
    """Useful model FLOPs: 2 x matmul parameters per token, attention per context token, logits per sample."""

    linear_per_token: int
    attention_per_context_token: int  # QK^T and PV, all layers, per key the token attends to
    logits_per_sample: int

    @classmethod
    def from_shape(cls, shape: LlamaShape) -> ModelFlops:
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        per_layer = (
            shape.hidden_size * (q_size + 2 * kv_size)
            + q_size * shape.hidden_size
            + 3 * shape.hidden_size * shape.intermediate_size
        )
        return cls(
            linear_per_token=2 * per_layer * shape.num_layers,
            attention_per_context_token=4 * q_size * shape.num_layers,
            logits_per_sample=2 * shape.hidden_size * shape.vocab_size,
        )

    def decode_token(self, context_len: int) -> int:
        return self.linear_per_token + self.attention_per_context_token * context_len + self.logits_per_sample

    def request(self, prompt_len: int, output_len: int) -> int:
        """Every known token but the last goes through the model once; each output token is one sample."""
        forwarded = prompt_len + output_len - 1
        return (
            self.linear_per_token * forwarded
            + self.attention_per_context_token * forwarded * (forwarded + 1) // 2
            + self.logits_per_sample * output_len
        )

    def workload(self, workload: Workload) -> int:
        return sum(self.request(len(p), o) for p, o in zip(workload.prompts, workload.output_lens))


# ---- matmul peak ----------------------------------------------------------------------------------
def matmul_shapes(shape: LlamaShape, rows: list[int]) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of the model's matmuls, at the row counts given."""
    hidden, ffn = shape.hidden_size, shape.intermediate_size
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    layers = [
        ("qkv", hidden, qkv),
        ("o", shape.num_heads * shape.head_dim, hidden),
        ("gate_up", hidden, 2 * ffn),
        ("down", ffn, hidden),
        ("logits", hidden, shape.vocab_size),
    ]
    return [(f"{name} {m}x{k}@{k}x{n}", m, k, n) for m in rows for name, k, n in layers]


def measure_matmul_peak(
    shape: LlamaShape, dtype: torch.dtype, decode_rows: int, large_rows: int, seconds: float
) -> dict:
    """GFLOP/s at the model's shapes, the best of torch.matmul (weights transposed, as F.linear reads them:
    MKL's sgemm in float32) and of kernels.linear.Linear (oneDNN on packed weights, what the engine runs).

    The peak is the best shape at `decode_rows` rows (a decode step's shapes); the best at `large_rows`
    (prefill-like) is kept beside it for reference. Taking the faster library keeps MFU honest: a matmul
    library faster than F.linear raises the peak the engine is measured against.
    """
    per_shape, best_at = {}, {}
    generator = torch.Generator().manual_seed(0)

    def best_seconds(fn) -> float:
        for _ in range(3):
            fn()
        best = float("inf")
        deadline = time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline:
            repeats = 5
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            best = min(best, (time.perf_counter() - started) / repeats)
        return best

    torch_matmul_best = 0.0
    for name, m, k, n in matmul_shapes(shape, sorted({decode_rows, large_rows})):
        x = torch.randn(m, k, generator=generator).to(dtype)
        weight = torch.randn(n, k, generator=generator).to(dtype)
        weight_t = weight.t()
        out = torch.empty(m, n, dtype=dtype)
        packed = Linear(weight)
        torch_matmul = best_seconds(lambda: torch.matmul(x, weight_t, out=out))
        best = min(torch_matmul, best_seconds(lambda: packed(x)))
        per_shape[name] = round(2 * m * k * n / best / 1e9, 1)
        best_at[m] = max(best_at.get(m, 0.0), per_shape[name])
        if m == decode_rows:
            torch_matmul_best = max(torch_matmul_best, round(2 * m * k * n / torch_matmul / 1e9, 1))
    return {
        "peak_gflops": best_at[decode_rows],
        "large_m_peak_gflops": best_at[large_rows],
        "torch_matmul_peak_gflops": torch_matmul_best,
        "per_shape_gflops": per_shape,
    }


# ---- our engine -----------------------------------------------------------------------------------
def engine_config(args, dtype: str, kv_blocks: int) -> EngineConfig:
    return EngineConfig(
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        data_dir=args.data_dir,
        num_threads=args.threads,
        quantization=args.quantization,
    )


def kv_blocks_for(workload: Workload, block_size: int, max_num_seqs: int) -> int:
    """Enough blocks for the max_num_seqs longest requests at full length: no preemption."""
    needs = sorted(
        (-(-(len(p) + o) // block_size) for p, o in zip(workload.prompts, workload.output_lens)), reverse=True
    )
    return max(2, sum(needs[:max_num_seqs]))


def warm_up_engine(engine: LLMEngine, vocab: int) -> None:
    rng = random.Random(12345)
    for number in range(2):
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(24)]
        engine.add_request(f"warmup{number}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()


def run_engine(engine: LLMEngine, workload: Workload, flops: ModelFlops, label: str) -> dict:
    prompt_lens = {f"r{i}": len(p) for i, p in enumerate(workload.prompts)}
    produced = {request_id: 0 for request_id in prompt_lens}
    full = engine.config.max_num_seqs
    steps, occupancy_sum, kv_sum = 0, 0.0, 0.0
    decode_full = {"steps": 0, "seconds": 0.0, "tokens": 0, "flops": 0, "step_gflops": []}
    decode_any = {"steps": 0, "seconds": 0.0, "tokens": 0, "flops": 0, "step_gflops": []}
    step_seconds = []
    kv_total = engine.stats.kv_blocks_total
    preemptions_before = engine.stats.num_preemptions
    finished = 0
    started = time.perf_counter()
    for number, (prompt, output_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(
            f"r{number}", prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        )
    last_report = started
    while engine.has_unfinished:
        step_started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - step_started
        stats = engine.stats
        seqs, tokens = stats.scheduled_seqs_last_step, stats.scheduled_tokens_last_step
        steps += 1
        step_seconds.append(seconds)
        occupancy_sum += seqs / full
        kv_sum += stats.kv_blocks_used / kv_total
        # A pure decode step: every scheduled request ran one token and sampled it, so it is in `outputs`.
        step_flops = 0
        for output in outputs:
            for delta in output.deltas:
                context = prompt_lens[output.request_id] + produced[output.request_id]
                produced[output.request_id] += len(delta.token_ids)
                step_flops += flops.decode_token(context)
            finished += output.finished
        if seqs and seqs == tokens and sum(len(o.deltas) for o in outputs) == seqs:
            for bucket in [decode_any] + ([decode_full] if seqs == full else []):
                bucket["steps"] += 1
                bucket["seconds"] += seconds
                bucket["tokens"] += seqs
                bucket["flops"] += step_flops
                bucket["step_gflops"].append(step_flops / seconds / 1e9)
        now = time.perf_counter()
        if now - last_report >= 5 or not engine.has_unfinished:
            say(
                f"  {label}: {finished}/{len(workload.prompts)} requests done, {sum(produced.values())} tokens, "
                f"step {steps}, {now - started:.1f}s"
            )
            last_report = now
    wall = time.perf_counter() - started
    if produced != {f"r{i}": o for i, o in enumerate(workload.output_lens)}:
        raise RuntimeError("the engine did not produce the forced output lengths")

    def decode_summary(bucket: dict) -> dict | None:
        if not bucket["steps"]:
            return None
        return {
            "steps": bucket["steps"],
            "tokens_per_s": bucket["tokens"] / bucket["seconds"],
            "ms_per_step": 1e3 * bucket["seconds"] / bucket["steps"],
            "mean_batch": bucket["tokens"] / bucket["steps"],
            "gflops": bucket["flops"] / bucket["seconds"] / 1e9,
            "median_step_gflops": statistics.median(bucket["step_gflops"]),
        }

    return {
        "seconds": wall,
        "output_tokens": workload.output_tokens,
        "output_tokens_per_s": workload.output_tokens / wall,
        "total_tokens_per_s": (workload.output_tokens + workload.prompt_tokens) / wall,
        "steps": steps,
        "mean_step_ms": 1e3 * sum(step_seconds) / len(step_seconds),
        "mean_batch_occupancy": occupancy_sum / steps,
        "mean_kv_utilisation": kv_sum / steps,
        "kv_blocks_total": kv_total,
        "preemptions": engine.stats.num_preemptions - preemptions_before,
        "gflops": flops.workload(workload) / wall / 1e9,
        "decode_full_concurrency": decode_summary(decode_full),
        "decode_all": decode_summary(decode_any),
    }


def profile_decode(args, dtype: str, loaded, steps: int, context: int = 256, top: int = 15) -> dict:
    """torch.profiler over `steps` pure decode steps at full concurrency; the top ops by self CPU time.

    The prompts share all but their last block, so that prefix caching makes the set-up prefill cheap;
    decode attention still reads every sequence's whole context.
    """
    from torch.profiler import ProfilerActivity, profile

    full, block, vocab = args.max_num_seqs, args.block_size, loaded.shape.vocab_size
    context = max(block, context // block * block)
    engine = LLMEngine(engine_config(args, dtype, full * -(-(context + steps + 8) // block) + 1), loaded)
    rng = random.Random(7)
    shared = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(context - block)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"profile{n}" for n in range(full)]
    engine.add_request(ids[0], shared + [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(block)], params)
    engine.step()  # its prompt's blocks are now in the prefix cache
    for request_id in ids[1:]:
        engine.add_request(
            request_id, shared + [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(block)], params
        )
    for _ in range(100):
        if engine.stats.scheduled_seqs_last_step == engine.stats.scheduled_tokens_last_step == full:
            break
        engine.step()
    else:
        raise RuntimeError("the profiling batch never reached full concurrency")
    engine.step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - started

    def table(events) -> list[dict]:
        events = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        return [
            {
                "op": e.key,
                "input_shapes": str(e.input_shapes) if e.input_shapes else None,
                "calls_per_step": e.count / steps,
                "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                "share": e.self_cpu_time_total / total_self,
            }
            for e in events[:top]
        ]

    total_self = sum(e.self_cpu_time_total for e in prof.key_averages())
    return {
        "steps": steps,
        "concurrency": full,
        "context_len": f"{context}..{context + steps + 2}",
        "ms_per_step": 1e3 * wall / steps,
        "profiled_self_ms_per_step": total_self / 1e3 / steps,
        "top_ops": table(prof.key_averages()),
        "top_ops_by_shape": table(prof.key_averages(group_by_input_shape=True)),
    }


# ---- HF transformers ------------------------------------------------------------------------------
def run_hf(model, workload: Workload, batch_size: int, pad_id: int, label: str) -> dict:
    """Static batches in request order, left padded; each batch runs to its longest output (EOS banned)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Progress(StoppingCriteria):
        def __init__(self, prefix: str) -> None:
            self.prefix, self.steps, self.last = prefix, 0, time.perf_counter()

        def __call__(self, input_ids, scores, **kwargs):
            self.steps += 1
            if time.perf_counter() - self.last >= 5:
                say(f"  {self.prefix}, generated {self.steps} tokens per row, {time.perf_counter() - started:.1f}s")
                self.last = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    generated = padded_prompt_tokens = 0
    batches = range(0, len(workload.prompts), batch_size)
    started = time.perf_counter()
    for batch_number, first in enumerate(batches, 1):
        prompts = workload.prompts[first : first + batch_size]
        lens = workload.output_lens[first : first + batch_size]
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new_tokens = max(lens)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                stopping_criteria=StoppingCriteriaList([Progress(f"{label}: batch {batch_number}/{len(batches)}")]),
            )
        if out.shape[1] - width != new_tokens:
            raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, not the forced {new_tokens}")
        generated += new_tokens * len(prompts)
        padded_prompt_tokens += width * len(prompts)
        say(
            f"  {label}: batch {batch_number}/{len(batches)} done ({len(prompts)} x {new_tokens} tokens), "
            f"{time.perf_counter() - started:.1f}s"
        )
    wall = time.perf_counter() - started
    return {
        "seconds": wall,
        "output_tokens": workload.output_tokens,  # useful: each request's own length
        "output_tokens_per_s": workload.output_tokens / wall,
        "generated_tokens": generated,  # what the static batches actually generated, padding rows included
        "generated_tokens_per_s": generated / wall,
        "padded_prompt_tokens": padded_prompt_tokens,
        "batch_size": batch_size,
        "num_batches": len(batches),
    }


def warm_up_hf(model, pad_id: int) -> None:
    with torch.inference_mode():
        ids = torch.randint(FIRST_ORDINARY_TOKEN, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            pad_token_id=pad_id,
        )


# ---- one dtype ------------------------------------------------------------------------------------
def bench_dtype(args, dtype: str, workload: Workload, flops: ModelFlops) -> dict:
    from transformers import AutoModelForCausalLM

    say(f"[{dtype}] loading models")
    loaded = load_model(EngineConfig(dtype=dtype, data_dir=args.data_dir, quantization=args.quantization))
    vocab = loaded.shape.vocab_size
    torch_dtype = loaded.dtype
    pad_id = (
        loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else loaded.tokenizer.eos_token_id
    )

    say(f"[{dtype}] measuring the matmul peak")
    peak_before = measure_matmul_peak(loaded.shape, torch_dtype, args.max_num_seqs, 256, args.peak_seconds)

    kv_blocks = args.kv_blocks or kv_blocks_for(workload, args.block_size, args.max_num_seqs)
    engine = LLMEngine(engine_config(args, dtype, kv_blocks), loaded)
    warm_up_engine(engine, vocab)
    say(
        f"[{dtype}] our engine: {len(workload.prompts)} requests, max_num_seqs {args.max_num_seqs}, "
        f"{kv_blocks} KV blocks"
    )
    ours = run_engine(engine, workload, flops, f"engine {dtype}")

    del engine
    profile = None
    if args.profile_steps:
        say(f"[{dtype}] profiling {args.profile_steps} decode steps at {args.max_num_seqs} concurrent")
        profile = profile_decode(args, dtype, loaded, args.profile_steps)

    say(f"[{dtype}] HF transformers generate, static batches of {args.max_num_seqs}")
    hf_folder, _ = checkpoint_folder(EngineConfig(data_dir=args.data_dir))  # a GGUF run as stored has no copy
    hf_model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch_dtype).eval()
    warm_up_hf(hf_model, pad_id)
    hf = run_hf(hf_model, workload, args.max_num_seqs, pad_id, f"HF {dtype}")
    hf["gflops"] = flops.workload(workload) / hf["seconds"] / 1e9
    del hf_model

    say(f"[{dtype}] measuring the matmul peak again")
    peak_after = measure_matmul_peak(loaded.shape, torch_dtype, args.max_num_seqs, 256, args.peak_seconds)
    # The higher of the two: MFU is then a lower bound, not flattered by a noisy neighbour.
    peak = max(peak_before["peak_gflops"], peak_after["peak_gflops"])

    def mfu(gflops: float | None) -> float | None:
        return None if gflops is None else gflops / peak

    ours["mfu"] = mfu(ours["gflops"])
    for key in ("decode_full_concurrency", "decode_all"):
        if ours[key] is not None:
            ours[key]["mfu"] = mfu(ours[key]["gflops"])
            ours[key]["median_step_mfu"] = mfu(ours[key]["median_step_gflops"])
    hf["mfu"] = mfu(hf["gflops"])
    ratio = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    # The target reads the median step: the full-concurrency window is ~24 steps (until the first request
    # ends), and on a shared VM one descheduled step moves its mean by points (33-39% over identical runs).
    decode_mfu = ours["decode_full_concurrency"]["median_step_mfu"] if ours["decode_full_concurrency"] else None
    large_peak = max(peak_before["large_m_peak_gflops"], peak_after["large_m_peak_gflops"])
    ours["mfu_vs_large_m_peak"] = ours["gflops"] / large_peak
    # For comparison with runs before the peak included the packed Linear: torch.matmul's peak alone.
    torch_matmul_peak = max(peak_before["torch_matmul_peak_gflops"], peak_after["torch_matmul_peak_gflops"])
    if ours["decode_full_concurrency"] is not None:
        ours["decode_full_concurrency"]["median_step_mfu_vs_torch_matmul_peak"] = (
            ours["decode_full_concurrency"]["median_step_gflops"] / torch_matmul_peak
        )
    result = {
        "matmul_peak_gflops": peak,
        "matmul_large_m_peak_gflops": large_peak,
        "torch_matmul_peak_gflops": torch_matmul_peak,
        "matmul_peak_before": peak_before,
        "matmul_peak_after": peak_after,
        "engine": ours,
        "hf": hf,
        "ratio_to_hf": ratio,
        "targets": {
            "ratio_to_hf": {"target": TARGET_RATIO, "value": ratio, "met": ratio >= TARGET_RATIO},
        },
    }
    if dtype == "bfloat16":
        result["targets"]["decode_mfu_full_concurrency"] = {
            "target": TARGET_DECODE_MFU,
            "value": decode_mfu,
            "met": decode_mfu is not None and decode_mfu >= TARGET_DECODE_MFU,
        }
    if profile is not None:
        result["decode_profile"] = profile
    return result


# ---- report ---------------------------------------------------------------------------------------
def fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_table(report: dict) -> None:
    workload = report["workload"]
    say("")
    say(
        f"Offline throughput: {workload['requests']} requests, prompts {workload['prompt_range']}, outputs "
        f"{workload['output_range']} (seed {workload['seed']}), {report['machine']['threads']} torch threads, "
        f"max_num_seqs / HF batch {workload['max_num_seqs']}"
    )
    say("HF static batches run to their longest request; only each request's own output tokens count.")
    header = (
        f"{'dtype':<12} {'side':<7} {'out tok/s':>9} {'vs HF':>6} {'occup.':>6} {'KV use':>6} "
        f"{'GFLOP/s':>8} {'MFU':>6} {'dec@full tok/s':>14} {'dec@full MFU (median)':>21} {'peak GFLOP/s':>12}"
    )
    say(header)
    say("-" * len(header))
    for dtype, result in report["results"].items():
        ours, hf = result["engine"], result["hf"]
        decode = ours["decode_full_concurrency"] or {}
        say(
            f"{dtype:<12} {'engine':<7} {ours['output_tokens_per_s']:>9.1f} {result['ratio_to_hf']:>5.2f}x "
            f"{ours['mean_batch_occupancy']:>6.1%} {ours['mean_kv_utilisation']:>6.1%} {ours['gflops']:>8.1f} "
            f"{ours['mfu']:>6.1%} {fmt(decode.get('tokens_per_s')):>14} {fmt(decode.get('median_step_mfu'), '.1%'):>21} "
            f"{result['matmul_peak_gflops']:>12.1f}"
        )
        say(
            f"{'':<12} {'HF':<7} {hf['output_tokens_per_s']:>9.1f} {'1.00x':>6} {'':>6} {'':>6} {hf['gflops']:>8.1f} "
            f"{hf['mfu']:>6.1%}"
        )
    say("")
    for dtype, result in report["results"].items():
        for name, target in result["targets"].items():
            value = target["value"]
            shown = "-" if value is None else (f"{value:.1%}" if "mfu" in name else f"{value:.2f}x")
            wanted = f"{target['target']:.0%}" if "mfu" in name else f"{target['target']:.1f}x"
            say(f"target {dtype} {name}: {shown} (want >= {wanted}) {'MET' if target['met'] else 'NOT MET'}")
        decode = result["engine"]["decode_full_concurrency"] or {}
        if "median_step_mfu_vs_torch_matmul_peak" in decode:
            vs_torch_matmul = decode["median_step_mfu_vs_torch_matmul_peak"]
            say(
                f"  ({dtype} decode at full concurrency, median step, against torch.matmul's peak alone "
                f"({result['torch_matmul_peak_gflops']:.1f} GFLOP/s): {vs_torch_matmul:.1%}; "
                f"over the steps' total time against the peak: {decode['mfu']:.1%})"
            )
        profile = result.get("decode_profile")
        if profile:
            say(
                f"\n{dtype} decode profile: {profile['ms_per_step']:.1f} ms/step at {profile['concurrency']} concurrent, "
                f"context {profile['context_len']}"
            )
            for row in profile["top_ops"]:
                say(
                    f"  {row['op']:<40} {row['self_ms_per_step']:>7.2f} ms/step {row['share']:>6.1%} "
                    f"{row['calls_per_step']:>6.0f} calls/step"
                )
            say("  by input shape:")
            for row in profile["top_ops_by_shape"][:10]:
                say(
                    f"  {row['op']:<16} {row['input_shapes'] or '':<56.56} {row['self_ms_per_step']:>7.2f} ms/step "
                    f"{row['calls_per_step']:>4.0f} calls"
                )


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(report["results"])
    results = [report["results"][d] for d in dtypes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    x = range(len(dtypes))
    width = 0.38
    ours = [r["engine"]["output_tokens_per_s"] for r in results]
    hf = [r["hf"]["output_tokens_per_s"] for r in results]
    left.bar([i - width / 2 for i in x], ours, width, label="tokenmill engine", color="#2b7bba")
    left.bar([i + width / 2 for i in x], hf, width, label="HF generate (static batches)", color="#b0b0b0")
    for i, r in enumerate(results):
        left.annotate(f"{r['ratio_to_hf']:.2f}x", (i - width / 2, ours[i]), ha="center", va="bottom", fontsize=10)
    left.set_xticks(list(x), dtypes)
    left.set_ylabel("output tokens/s (useful)")
    left.set_title(f"Offline throughput, {report['workload']['requests']} requests")
    left.legend(fontsize=8)

    series = [
        ("engine overall", [r["engine"]["mfu"] for r in results], "#2b7bba"),
        (
            "engine decode @ full (median step)",
            [(r["engine"]["decode_full_concurrency"] or {}).get("median_step_mfu") or 0 for r in results],
            "#174a73",
        ),
        ("HF overall", [r["hf"]["mfu"] for r in results], "#b0b0b0"),
    ]
    bar = 0.26
    for n, (label, values, color) in enumerate(series):
        right.bar([i + (n - 1) * bar for i in x], [100 * v for v in values], bar, label=label, color=color)
    right.axhline(100 * TARGET_DECODE_MFU, color="#c0392b", linestyle="--", linewidth=1, label="decode target (bf16)")
    right.set_xticks(list(x), dtypes)
    right.set_ylabel("% of measured matmul peak")
    right.set_title("Model FLOP utilisation")
    right.legend(fontsize=8)
    machine = report["machine"]
    load = "/".join(f"{machine[k][0]:.1f}" for k in ("load_average_start", "load_average_end") if k in machine)
    fig.suptitle(f"{machine['threads']} torch threads, {machine['cpu']}, load average (start/end) {load}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def native_kernels_in_use() -> bool:
    from kernels import cpu_native_ops

    return cpu_native_ops.silu_and_mul_available(torch.zeros(1, 2))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- main -----------------------------------------------------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    low_value, high_value = int(low), int(high or low)
    if not 1 <= low_value <= high_value:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want LOW-HIGH with 1 <= LOW <= HIGH")
    return low_value, high_value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 requests, short prompts and outputs")
    parser.add_argument("--requests", type=int, help="number of requests (default 64, quick 16)")
    parser.add_argument("--prompt-len", type=parse_range, help="prompt tokens LOW-HIGH (default 32-512, quick 16-64)")
    parser.add_argument("--output-len", type=parse_range, help="output tokens LOW-HIGH (default 32-256, quick 8-32)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16,float32")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="engine concurrency and HF static batch size (default: min(64, requests))",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "int8", "int4"),
        default="none",
        help="the engine's weights (HF runs the dtype's own, unquantized); results go to engine_bench-QUANT.json",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=None, help="KV pool size (default: enough for no preemption)")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads, the same for both sides (default: the CPUs this process may use)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--moe",
        action="store_true",
        help="decode step of an MoE (8 experts, 2 active) vs a dense model of its active size",
    )
    parser.add_argument("--peak-seconds", type=float, default=None, help="time per matmul shape for the peak")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="also profile this many decode steps at full concurrency (torch.profiler)",
    )
    parser.add_argument("--data-dir", default=str(ROOT / ".tokenmill"), help="where converted weights are cached")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    args = parser.parse_args(argv)
    args.requests = args.requests or (16 if args.quick else 64)
    args.prompt_len = args.prompt_len or ((16, 64) if args.quick else (32, 512))
    args.output_len = args.output_len or ((8, 32) if args.quick else (32, 256))
    args.max_num_seqs = args.max_num_seqs or min(64, args.requests)
    args.peak_seconds = args.peak_seconds or (0.05 if args.quick else 0.4)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for dtype in args.dtypes:
        if dtype not in ("bfloat16", "float32"):
            parser.error(f"unknown dtype {dtype!r}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.moe:  # its own workload: batch-1 decode steps of two random-weight checkpoints (bench/moe_decode.py)
        from bench.moe_decode import add_arguments, moe_vs_dense

        moe_parser = argparse.ArgumentParser()
        add_arguments(moe_parser)
        return moe_vs_dense(moe_parser.parse_args(["--threads", str(args.threads)]))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import transformers
    from transformers import AutoConfig

    folder, _ = checkpoint_folder(EngineConfig(data_dir=args.data_dir))
    shape = LlamaShape.from_hf_config(AutoConfig.from_pretrained(folder))
    flops = ModelFlops.from_shape(shape)
    workload = make_workload(args.requests, args.prompt_len, args.output_len, shape.vocab_size, args.seed)
    say(
        f"workload: {args.requests} requests, {workload.prompt_tokens} prompt tokens, {workload.output_tokens} "
        f"output tokens; {args.threads} torch threads"
    )
    report = {
        "benchmark": "engine_bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": {
            "cpu": cpu_name(),
            "threads": args.threads,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "native_cpu_kernels": native_kernels_in_use(),
            "load_average_start": list(os.getloadavg()),
        },
        "workload": {
            "requests": args.requests,
            "seed": args.seed,
            "prompt_range": list(args.prompt_len),
            "output_range": list(args.output_len),
            "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": args.block_size,
        },
        "flops": {**asdict(flops), "workload_useful_gflop": flops.workload(workload) / 1e9},
        "definitions": {
            "output_tokens_per_s": "each request's own forced output length, summed, over wall time (HF's static "
            "batches generate up to the batch's longest; those extra tokens are not counted)",
            "mean_batch_occupancy": "scheduled sequences / max_num_seqs, mean over engine steps",
            "mean_kv_utilisation": "kv_blocks_used / kv_blocks_total after each step, mean over engine steps",
            "gflops": "useful model FLOPs (2 x matmul params per forwarded token + 4 x q_size x layers per attended "
            "key + logits per sampled token; no padding) over wall time",
            "mfu": "gflops / matmul_peak_gflops; peak = best GFLOP/s of torch.matmul or the engine's packed Linear "
            "(whichever is faster, per shape) at the model's matmul shapes "
            "with max_num_seqs rows (a decode step's shapes), the higher of a measurement before and after "
            "the dtype's runs; matmul_large_m_peak_gflops is the same at 256 rows (prefill-like)",
            "decode_full_concurrency": "engine steps where all max_num_seqs requests ran one decode token each; "
            "mfu over their total time, median_step_mfu the median step's (the target)",
        },
        "results": {},
    }
    report["quantization"] = args.quantization
    for dtype in args.dtypes:
        label = dtype if args.quantization == "none" else f"{dtype}+{args.quantization}"
        report["results"][label] = bench_dtype(args, dtype, workload, flops)
    report["machine"]["load_average_end"] = list(os.getloadavg())
    print_table(report)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = "engine_bench_quick" if args.quick else "engine_bench"
    if args.quantization != "none":
        stem += f"-{args.quantization}"
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, png_path)
    say(f"\nwrote {json_path} and {png_path}")
    return report


if __name__ == "__main__":
    main()
