"""Decode step time at batch 1: a mixture-of-experts model (8 experts, 2 active, Mixtral layout) against a dense
model of the same active size (its FFN as wide as the two active experts together), same attention, same
everything else, random weights. The target (issue #43): the MoE within 1.5x of the dense model's step.

    python bench/engine_bench.py --moe                        # float32 and int8, 8 layers, hidden 576
    python bench/moe_decode.py --layers 4 --steps 16          # a smoke run

Writes bench/results/moe_decode.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import checkpoint_folder, load_model
from engine.sampling_params import SamplingParams

RESULTS = ROOT / "bench" / "results"
QUANTIZATIONS: dict[str, Literal["none", "int8", "int4"]] = {"none": "none", "int8": "int8", "int4": "int4"}
EXPERTS, ACTIVE = 8, 2


def build_checkpoint(folder: Path, moe: bool, args: argparse.Namespace, tokenizer_folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    shape: dict[str, Any] = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if moe:
        config = AutoConfig.for_model(
            "mixtral", intermediate_size=args.expert_ffn, num_local_experts=EXPERTS, num_experts_per_tok=ACTIVE, **shape
        )
    else:
        config = AutoConfig.for_model("mistral", intermediate_size=args.expert_ffn * ACTIVE, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)


def decode_step_ms(folder: Path, quantization: str, args: argparse.Namespace) -> dict[str, float]:
    config = EngineConfig(
        model=str(folder),
        dtype="float32",
        num_kv_blocks=64,
        speculation="off",
        quantization=QUANTIZATIONS[quantization],
    )
    loaded = load_model(config)
    engine = LLMEngine(config, loaded)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True)
    times = []
    for round_ in range(args.rounds):
        engine.add_request(f"r{round_}", list(range(100, 132)), params)
        engine.step()  # the prefill
        while engine.has_unfinished:
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
    return {
        "median_ms": 1000 * statistics.median(times),
        "p10_ms": 1000 * sorted(times)[len(times) // 10],
        "weight_mb": loaded.model.weight_nbytes() / 1e6,
    }


def moe_vs_dense(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    tokenizer_folder, _ = checkpoint_folder(EngineConfig(data_dir=str(ROOT / ".tokenmill")))
    report: dict[str, Any] = {
        "benchmark": "moe_decode",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "shape": {
            "hidden": args.hidden,
            "layers": args.layers,
            "experts": EXPERTS,
            "active": ACTIVE,
            "expert_ffn": args.expert_ffn,
            "dense_ffn": args.expert_ffn * ACTIVE,
        },
        "threads": args.threads,
        "load_average_start": list(os.getloadavg()),
        "results": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        folders = {kind: Path(scratch) / kind for kind in ("moe", "dense")}
        for kind, folder in folders.items():
            build_checkpoint(folder, kind == "moe", args, tokenizer_folder)
        for quantization in args.quantizations:
            rows = {kind: decode_step_ms(folder, quantization, args) for kind, folder in folders.items()}
            ratio = rows["moe"]["median_ms"] / rows["dense"]["median_ms"]
            report["results"][quantization] = {**rows, "moe_over_dense": ratio}
            print(
                f"{quantization:>5}: dense {rows['dense']['median_ms']:.2f} ms/step, "
                f"MoE {rows['moe']['median_ms']:.2f} ms/step ({ratio:.2f}x; target <= 1.5x), "
                f"weights {rows['dense']['weight_mb']:.0f} / {rows['moe']['weight_mb']:.0f} MB",
                flush=True,
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "moe_decode.json").write_text(json.dumps(report, indent=2))
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--expert-ffn", type=int, default=768, help="each expert's FFN; the dense one is 2x")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quantizations", type=lambda text: text.split(","), default=["none", "int8"], help="comma-separated"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    moe_vs_dense(parser.parse_args())
