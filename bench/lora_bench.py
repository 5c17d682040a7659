"""LoRA adapters beside their base model, measured: 8 streams spread over 4 adapters against 8 streams on the base
alone, in the same run (rounds alternate, medians reported), plus what an adapter costs to load and to hold.

Target (issue #46): the adapters' aggregate output tokens/s >= 0.8x the base's. Adapters are made here with PEFT
(random weights, rank --rank on all seven projections, the heaviest case). Writes JSON and a PNG under
bench/results/.

    python bench/lora_bench.py                  # the embedded SmolLM2 (float32 weights, bf16 with --dtype)
    python bench/lora_bench.py --quantization int4
    python bench/lora_bench.py --quick          # a tiny random Llama: a smoke run of seconds
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see engine_bench.py: spinning OpenMP threads on a shared VM

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.lora import load_weights, read_manifest
from engine.sampling_params import SamplingParams
from kernels import lora as lora_kernel

RESULTS = ROOT / "bench" / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(loaded: LoadedModel, count: int, rank: int, root: Path) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    # PEFT needs the modules' shapes only (the adapters are random): the config, as a quantized model's folder
    # holds no float weights
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(loaded.folder), dtype=torch.float32)
    folders = {}
    for number in range(count):
        torch.manual_seed(number)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        folder = root / f"adapter-{number}"
        get_peft_model(copy.deepcopy(base), config).save_pretrained(folder)
        folders[f"adapter-{number}"] = folder
    return folders


def add_streams(engine: LLMEngine, adapters: list[str | None], prompt_len: int, output_len: int, tag: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    vocab = engine.loaded.shape.vocab_size
    for number, adapter in enumerate(adapters):
        prompt = [(number * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(prompt_len)]  # no shared prefix
        engine.add_request(f"{tag}-{number}", prompt, params, adapter=adapter)


def run_round(engine: LLMEngine, adapters: list[str | None], prompt_len: int, output_len: int, tag: str) -> float:
    """All streams at once to the end; aggregate output tokens/s."""
    started = time.perf_counter()
    add_streams(engine, adapters, prompt_len, output_len, tag)
    produced = 0
    while engine.has_unfinished:
        for output in engine.step():
            produced += sum(len(delta.token_ids) for delta in output.deltas)
    return produced / (time.perf_counter() - started)


def run_interleaved(
    engines: list[LLMEngine], sides: list[list[str | None]], prompt_len: int, output_len: int, tag: str
) -> list[float]:
    """Each engine's streams at once to the end, the engines taking turns step by step; per engine, output
    tokens over the time of its own steps."""
    for side, (engine, adapters) in enumerate(zip(engines, sides, strict=True)):
        add_streams(engine, adapters, prompt_len, output_len, f"{tag}-{side}")
    produced, elapsed = [0] * len(engines), [0.0] * len(engines)
    while any(engine.has_unfinished for engine in engines):
        for side, engine in enumerate(engines):
            if engine.has_unfinished:
                started = time.perf_counter()
                outputs = engine.step()
                elapsed[side] += time.perf_counter() - started
                produced[side] += sum(len(delta.token_ids) for output in outputs for delta in output.deltas)
    return [tokens / seconds for tokens, seconds in zip(produced, elapsed, strict=True)]


def measure(
    args: argparse.Namespace, loaded: LoadedModel, folders: dict[str, Path], base_loaded: LoadedModel | None
) -> dict:
    """`base_loaded`: a second copy of the model for the base's own engine, stepped in turn with the adapters'
    (--alternate steps); None: one engine, rounds of the base and of the adapters in turn."""
    config = EngineConfig(
        model=str(loaded.folder),
        dtype=args.dtype,
        quantization=args.quantization,
        num_kv_blocks=1024,
        max_num_seqs=args.streams,
        max_loras=len(folders),
        speculation="off",  # random prompts draft nothing; keep both sides on the same path
    )
    engine = LLMEngine(config, loaded)
    register_s = []
    for name, folder in folders.items():
        started = time.perf_counter()
        engine.register_adapter(name, str(folder))
        register_s.append(time.perf_counter() - started)
    names = list(folders)
    manifest = read_manifest(next(iter(folders.values())))
    lora_kernel.available(loaded.model.dtype)  # builds the native kernel once (cached after): not a load's cost
    started = time.perf_counter()
    weights = load_weights("probe", manifest, engine.adapters.dims, loaded.model.dtype)
    load_s = time.perf_counter() - started
    spread: list[str | None] = [names[i % len(names)] for i in range(args.streams)]
    base_only: list[str | None] = [None] * args.streams
    base_rates, lora_rates = [], []
    if base_loaded is not None:
        base_engine = LLMEngine(config, base_loaded)
        run_interleaved([base_engine, engine], [base_only, spread], args.prompt_len, 4, "warm")
        for number in range(args.rounds):  # who steps first swaps each round
            order = [(base_engine, base_only), (engine, spread)][:: 1 if number % 2 == 0 else -1]
            rates = run_interleaved(
                [e for e, _ in order], [a for _, a in order], args.prompt_len, args.output_len, f"r{number}"
            )
            base_rate, lora_rate = rates[:: 1 if number % 2 == 0 else -1]
            base_rates.append(base_rate)
            lora_rates.append(lora_rate)
    else:
        run_round(engine, base_only, args.prompt_len, 4, "warm-base")
        run_round(engine, spread, args.prompt_len, 4, "warm-lora")  # loads every adapter once
        for number in range(args.rounds):  # alternate, so that load from parallel work hits both sides alike
            base_rates.append(run_round(engine, base_only, args.prompt_len, args.output_len, f"base{number}"))
            lora_rates.append(run_round(engine, spread, args.prompt_len, args.output_len, f"lora{number}"))
    base = statistics.median(base_rates)
    lora = statistics.median(lora_rates)
    # each round's adapters against the base round just before it: steadier than the medians when the
    # machine's load drifts over the run
    pair_ratios = [lora_rate / base_rate for base_rate, lora_rate in zip(base_rates, lora_rates, strict=True)]
    return {
        "config": {
            "dtype": args.dtype,
            "quantization": loaded.model.quantization,
            "streams": args.streams,
            "adapters": len(names),
            "rank": args.rank,
            "targets": TARGETS,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "alternate": args.alternate,
        },
        "base_tok_s": base_rates,
        "lora_tok_s": lora_rates,
        "base_tok_s_median": base,
        "lora_tok_s_median": lora,
        "ratio": lora / base,
        "round_ratios": pair_ratios,
        "round_ratio_median": statistics.median(pair_ratios),
        "target_ratio": 0.8,
        "register_s_median": statistics.median(register_s),
        "load_s": load_s,
        "pool_load_s_mean": engine.adapters.stats.load_seconds_total / max(1, engine.adapters.stats.loads),
        "bytes_per_adapter": weights.nbytes,
        "file_bytes_per_adapter": (next(iter(folders.values())) / "adapter_model.safetensors").stat().st_size,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = ["base alone", f"{report['config']['adapters']} adapters"]
    values = [report["base_tok_s_median"], report["lora_tok_s_median"]]
    ax.bar(labels, values, color=["#888", "#2a7"])
    ax.axhline(0.8 * report["base_tok_s_median"], color="#c33", linestyle="--", label="0.8x base (target)")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title(
        f"{report['model']}: {report['config']['streams']} streams, rank {report['config']['rank']}, "
        f"{report['config']['quantization']} ({report['ratio']:.2f}x)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random model and a small workload")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--alternate",
        default="steps",
        choices=("steps", "rounds"),
        help="steps: the base and the adapters in two engines (two copies of the model) stepping in turn, each "
        "timed by its own steps; rounds: one engine, whole rounds in turn (more exposed to a drifting load)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "lora_bench.json")
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("TOKENMILL_DATA_DIR", ".tokenmill"),
        help="where the converted embedded model is cached",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    if args.quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                tie_word_embeddings=True,
            )
        ).save_pretrained(work / "tiny")
        embedded = load_model(EngineConfig(model="default", dtype="float32", data_dir=args.data_dir))
        embedded.tokenizer.save_pretrained(work / "tiny")
        del embedded
        args.output_len, args.prompt_len, args.rounds = 16, 16, 1
        source = str(work / "tiny")
    else:
        source = "default"
    loaded = load_model(
        EngineConfig(model=source, dtype=args.dtype, quantization=args.quantization, data_dir=args.data_dir)
    )
    folders = make_adapters(loaded, args.adapters, args.rank, work)
    load_before = os.getloadavg()[0]
    base_loaded = None
    if args.alternate == "steps":
        base_loaded = load_model(
            EngineConfig(model=source, dtype=args.dtype, quantization=args.quantization, data_dir=args.data_dir)
        )
    measured = measure(args, loaded, folders, base_loaded)
    # 1-minute load averages around the measurement, on os.cpu_count() CPUs: how shared the machine was
    machine = {"cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    report = {"model": loaded.name, **measured, "machine": machine}
    print(
        f"base alone {report['base_tok_s_median']:7.1f} tok/s   {args.adapters} adapters "
        f"{report['lora_tok_s_median']:7.1f} tok/s   ratio {report['ratio']:.2f} (target >= 0.8; "
        f"per round {min(report['round_ratios']):.2f}-{max(report['round_ratios']):.2f}, "
        f"median {report['round_ratio_median']:.2f})\n"
        f"adapter: register {report['register_s_median'] * 1e3:.0f} ms, load {report['load_s'] * 1e3:.0f} ms, "
        f"{report['bytes_per_adapter'] / 2**20:.1f} MiB resident ({report['file_bytes_per_adapter'] / 2**20:.1f} MiB file)\n"
        f"machine: {machine['cpus']} CPUs, load average {machine['load_average_before']:.1f} before, "
        f"{machine['load_average_after']:.1f} after"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
