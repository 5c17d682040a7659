"""One stream, offline, engine only: tok/s with prompt-lookup speculative decoding on and off.

Two prompts: an answer that copies its prompt (code to rewrite) and a plain chat question, 128 output tokens
each (EOS ignored), greedy and temperature 0.7. Speculation on and off alternate within each round, so load
from other work on the machine falls on both alike. Prints tok/s per setting, the ratio, the share of
drafted tokens the model accepted and the tokens per engine step; writes JSON under bench/results/.

    python bench/speculation_bench.py                       # float32, 2 rounds
    python bench/speculation_bench.py --dtype bfloat16 --quantization int4 --rounds 1
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/engine_bench.py: a shared machine

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams

RESULTS = ROOT / "bench" / "results"
CODE = '''def load(path):
    f = open(path)
    data = f.read()
    f.close()
    rows = []
    for line in data.split("\\n"):
        if line.strip() != "":
            rows.append(line.split(","))
    return rows


def total(rows, column):
    s = 0
    for r in rows:
        s = s + float(r[column])
    return s
'''
PROMPTS = {
    "rewrite": f"Rewrite this code with a with-statement and type hints, keeping everything else:\n\n{CODE}",
    "chat": "Tell me about the history of the bicycle and why it became popular in cities.",
}


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[int, float, int]:
    """(output tokens, seconds, engine steps) of one request run alone."""
    engine.add_request("bench", prompt, params)
    steps = engine.stats.steps_total
    started = time.perf_counter()
    tokens = 0
    while engine.has_unfinished:
        for output in engine.step():
            tokens += sum(len(delta.token_ids) for delta in output.deltas)
    return tokens, time.perf_counter() - started, engine.stats.steps_total - steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--data-dir", default=str(ROOT / ".tokenmill"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    base = EngineConfig(
        dtype=args.dtype, quantization=args.quantization, data_dir=args.data_dir, num_kv_blocks=64, device="cpu"
    )
    loaded = load_model(base)
    engines = {
        setting: LLMEngine(
            EngineConfig(**{**base.__dict__, "speculation": setting, "num_speculative_tokens": args.k}), loaded
        )
        for setting in ("off", "ngram")
    }
    tokenizer = loaded.tokenizer
    prompts = {
        name: tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for name, text in PROMPTS.items()
    }
    for engine in engines.values():  # warm-up: kernels built, caches touched
        run_one(engine, prompts["chat"], SamplingParams(temperature=0.0, max_tokens=8))

    rows = []
    for name, prompt in prompts.items():
        for temperature in (float(t) for t in args.temperatures.split(",")):
            # Seeded, as latency_bench's requests are: drafting leaves a seeded reply as it is, so both
            # settings time the same text.
            params = SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True, seed=7)
            rates: dict[str, list[float]] = {"off": [], "ngram": []}
            per_step: dict[str, list[float]] = {"off": [], "ngram": []}
            spec = engines["ngram"].stats
            drafted, accepted = spec.spec_draft_tokens_total, spec.spec_accepted_tokens_total
            for _ in range(args.rounds):
                for setting, engine in engines.items():
                    tokens, seconds, steps = run_one(engine, prompt, params)
                    rates[setting].append(tokens / seconds)
                    per_step[setting].append(tokens / steps)
            drafted = spec.spec_draft_tokens_total - drafted
            accepted = spec.spec_accepted_tokens_total - accepted
            off, on = statistics.median(rates["off"]), statistics.median(rates["ngram"])
            row = {
                "prompt": name,
                "temperature": temperature,
                "tok_s_off": round(off, 2),
                "tok_s_ngram": round(on, 2),
                "ratio": round(on / off, 3),
                # what the load on the machine cannot blur: tokens per engine step
                "tokens_per_step_ngram": round(statistics.median(per_step["ngram"]), 3),
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            }
            rows.append(row)
            print(
                f"{name:8s} T={temperature:<4} off {off:6.2f} tok/s  ngram {on:6.2f} tok/s  x{on / off:.2f}  "
                f"acceptance {row['acceptance_rate']} ({accepted}/{drafted})  "
                f"{row['tokens_per_step_ngram']} tokens/step",
                flush=True,
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"speculation_bench-{args.dtype}-{args.quantization}.json"
    settings = {**vars(args), "torch_threads": torch.get_num_threads()}
    path.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
