"""What constrained decoding costs: engine decode throughput with and without a JSON schema, same
prompts, same batch, same number of tokens, in one process.

The schemas force long outputs (arrays with a large minItems), so the constrained runs generate exactly
as many tokens as the free runs (which ignore EOS): tokens/s compare like with like. Runs alternate
(free, schema, free, schema, ...) and the median counts, since neighbours share these cores. Also
reports the guides' own time per step (mask + advance, the only work a schema adds besides one masked
fill in the sampler) and its share of the step, measured inside the same runs: on a shared machine the
share is the steadier number. And the one-off cost of compiling each schema.

    python bench/structured_bench.py            # batch 1 and 16, 64 tokens, 3 rounds (minutes)
    python bench/structured_bench.py --quick    # batch 4, 24 tokens, 1 round
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in engine_bench: shared cores

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.serving.structured.guides import compiler_for, json_schema_grammar
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams

RESULTS = ROOT / "bench" / "results"
SCHEMAS = {
    "numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 1000},
    "records": {
        "type": "array",
        "minItems": 1000,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "name": {"type": "string", "maxLength": 8},
                "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
                "score": {"type": "number"},
                "ok": {"type": "boolean"},
            },
            "required": ["id", "name", "tags", "score", "ok"],
            "additionalProperties": False,
        },
    },
}
PROMPT = "Write a long list of records as JSON."


class TimedFactory:
    """Wraps a guide factory; adds up the time its guides spend on masks and advances."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.seconds = 0.0
        self.calls = 0

    def new_guide(self):
        return TimedGuide(self.factory.new_guide(), self)


class TimedGuide:
    def __init__(self, guide, owner: TimedFactory) -> None:
        self.guide, self.owner = guide, owner

    def allowed_tokens(self):
        started = time.perf_counter()
        mask = self.guide.allowed_tokens()
        self.owner.seconds += time.perf_counter() - started
        self.owner.calls += 1
        return mask

    def advance(self, token_id: int) -> None:
        started = time.perf_counter()
        self.guide.advance(token_id)
        self.owner.seconds += time.perf_counter() - started

    @property
    def done(self) -> bool:
        return self.guide.done


def run(engine: LLMEngine, prompt: list[int], batch: int, tokens: int, factory) -> tuple[float, int]:
    for number in range(batch):
        params = SamplingParams(
            temperature=0.8, seed=number, max_tokens=tokens, ignore_eos=factory is None, guide_factory=factory
        )
        engine.add_request(f"r{number}", prompt, params)
    generated = 0
    started = time.perf_counter()
    while engine.has_unfinished:
        for output in engine.step():
            generated += sum(len(delta.token_ids) for delta in output.deltas)
    return time.perf_counter() - started, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.tokens, args.rounds = [4], 24, 1

    config = EngineConfig(dtype=args.dtype, num_kv_blocks=1024, max_num_seqs=64)
    loaded = load_model(config)
    tokenizer = loaded.tokenizer
    compiler = compiler_for(tokenizer)
    started = time.perf_counter()
    compiler.ll_tokenizer  # noqa: B018 - built once per tokenizer
    tokenizer_seconds = time.perf_counter() - started
    compile_ms = {}
    factories = {}
    for name, schema in SCHEMAS.items():
        started = time.perf_counter()
        factories[name] = compiler.compile(json_schema_grammar(schema))
        compile_ms[name] = (time.perf_counter() - started) * 1e3
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    engine = LLMEngine(config, loaded)
    run(engine, prompt, 2, 4, None)  # warm-up

    results = []
    for batch in args.batches:
        samples: dict[str, list[float]] = {"none": [], **{name: [] for name in SCHEMAS}}
        guide_ms_per_step: dict[str, list[float]] = {name: [] for name in SCHEMAS}
        for round_number in range(args.rounds):
            names = list(samples)
            shift = round_number % len(names)  # rotate the order: no variant always runs after the same one
            for name in names[shift:] + names[:shift]:
                timed = None if name == "none" else TimedFactory(factories[name])
                seconds, generated = run(engine, prompt, batch, args.tokens, timed)
                assert generated == batch * args.tokens, (name, generated)
                samples[name].append(generated / seconds)
                if timed is not None:
                    guide_ms_per_step[name].append(timed.seconds * 1e3 / args.tokens)
        free = statistics.median(samples["none"])
        row = {"batch": batch, "tokens_per_sequence": args.tokens, "free_tokens_per_s": round(free, 1), "schemas": {}}
        for name in SCHEMAS:
            guided = statistics.median(samples[name])
            guide_ms = statistics.median(guide_ms_per_step[name])
            step_ms = 1e3 * batch / guided
            row["schemas"][name] = {
                "tokens_per_s": round(guided, 1),
                "ratio_to_free": round(guided / free, 3),
                "guide_ms_per_step": round(guide_ms, 3),
                "guide_share_of_step": round(guide_ms / step_ms, 4),
                "all_tokens_per_s": [round(value, 1) for value in samples[name]],
            }
        row["all_free_tokens_per_s"] = [round(value, 1) for value in samples["none"]]
        results.append(row)
        print(
            f"batch {batch:>3}: free {free:7.1f} tok/s  "
            + "  ".join(
                f"{name} {info['tokens_per_s']:7.1f} tok/s ({info['ratio_to_free']:.2f}x, guides "
                f"{info['guide_ms_per_step']:.2f} ms/step)"
                for name, info in row["schemas"].items()
            ),
            flush=True,
        )

    report = {
        "bench": "structured_bench",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "library": "llguidance " + __import__("llguidance").__version__,
        "tokenizer_build_s": round(tokenizer_seconds, 2),
        "schema_compile_ms": {k: round(v, 1) for k, v in compile_ms.items()},
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "structured_bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
