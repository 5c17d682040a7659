"""A burst of requests that share their prompt's start (a team's system prompt, a batch's instructions), in
one engine: with the scheduler as it is, where a new request whose next prompt block another request computes
this step waits a step and then finds it cached (engine/scheduler.py, `_waits_for_shared_prefix`), and as
before that wait, where requests admitted in the same step each computed the shared blocks.

Per burst: the time until every request has its first token, the median time to first token, the time until
all are done, and the prompt tokens the engine computed (prompt tokens less prefix-cache hits). The two arms
alternate over rounds, each round with a fresh engine (one short request run first, so that its step budget
is a served engine's) and a new shared prompt (random ordinary tokens: the time does not depend on the
values). Prints a table, writes JSON and a PNG.

    python bench/shared_prefix_bench.py                          # embedded SmolLM2, server defaults
    python bench/shared_prefix_bench.py --model ~/.cache/tokenmill-bench/models/llama-1b-Q4_K_M.gguf
    python bench/shared_prefix_bench.py --requests 8 --shared-tokens 1000 --own-tokens 40 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams

RESULTS = ROOT / "bench" / "results"
FIRST_ORDINARY_TOKEN = 1000  # past the special and byte tokens of the vocabularies we run
ARMS = ("wait for shared blocks", "as before")


def run_burst(loaded: LoadedModel, config: EngineConfig, arm: str, args: argparse.Namespace, seed: int) -> dict:
    engine = LLMEngine(config, loaded)
    if arm == "as before":  # every request admitted at once computes the shared blocks itself
        engine.scheduler._waits_for_shared_prefix = lambda request, scheduled: False  # type: ignore[method-assign]
    rng = random.Random(seed)
    vocab = loaded.shape.vocab_size

    def tokens(count: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(count)]

    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    # A served engine has measured its steps: its budget is about max_step_seconds of work, not the full
    # max_num_batched_tokens of a first step (engine/step_budget.py). A short request first gets it there.
    engine.add_request("warm-up", tokens(args.own_tokens), params)
    while engine.has_unfinished:
        engine.step()
    warm_queries, warm_hits = (
        engine.scheduler.counters.prefix_cache_queries,
        engine.scheduler.counters.prefix_cache_hits,
    )
    shared = tokens(args.shared_tokens)
    started = time.perf_counter()
    for number in range(args.requests):
        engine.add_request(f"r{number}", shared + tokens(args.own_tokens), params)
    first: dict[str, float] = {}
    while engine.has_unfinished:
        for output in engine.step():
            if any(delta.token_ids for delta in output.deltas):
                first.setdefault(output.request_id, time.perf_counter() - started)
    done = time.perf_counter() - started
    counters = engine.scheduler.counters
    return {
        "all_first_tokens_s": max(first.values()),
        "ttft_p50_s": statistics.median(first.values()),
        "all_done_s": done,
        "prompt_tokens_computed": counters.prefix_cache_queries
        - warm_queries
        - (counters.prefix_cache_hits - warm_hits),
        "prompt_tokens": counters.prefix_cache_queries - warm_queries,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, tokens_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    medians = report["medians"]
    stats = ("ttft_p50_s", "all_first_tokens_s", "all_done_s")
    for offset, arm in enumerate(ARMS):
        time_axis.bar(
            [i + (offset - 0.5) * 0.38 for i in range(len(stats))], [medians[arm][s] for s in stats], 0.38, label=arm
        )
    time_axis.set_xticks(range(len(stats)), ["TTFT p50", "every first token", "all done"])
    time_axis.set_ylabel("seconds (median of rounds)")
    time_axis.legend()
    tokens_axis.bar(range(len(ARMS)), [medians[arm]["prompt_tokens_computed"] for arm in ARMS], 0.5)
    tokens_axis.set_xticks(range(len(ARMS)), list(ARMS))
    tokens_axis.set_ylabel(f"prompt tokens computed (of {medians[ARMS[0]]['prompt_tokens']:.0f})")
    workload = report["workload"]
    figure.suptitle(
        f"{workload['requests']} requests at once sharing {workload['shared_tokens']} prompt tokens: {report['model']}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (embedded SmolLM2), a HF folder or a .gguf")
    parser.add_argument("--requests", type=int, default=8, help="requests in the burst")
    parser.add_argument("--shared-tokens", type=int, default=1000, help="the prompt start they share")
    parser.add_argument("--own-tokens", type=int, default=40, help="each request's own rest of the prompt")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="bursts per arm, the arms alternated")
    parser.add_argument("--data-dir", default=os.environ.get("TOKENMILL_DATA_DIR", ".tokenmill"))
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_prefix_bench.json")
    args = parser.parse_args()

    # the server's defaults (quantization auto, the step budget), and KV room for the whole burst
    config = EngineConfig(model=args.model, quantization="auto", data_dir=args.data_dir)
    loaded = load_model(config)
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for number in range(args.rounds):
        for arm in ARMS if number % 2 == 0 else reversed(ARMS):
            result = run_burst(loaded, config, arm, args, seed=number)
            rounds[arm].append(result)
            print(
                f"round {number + 1} {arm:22s}: every first token {result['all_first_tokens_s']:6.2f} s, "
                f"TTFT p50 {result['ttft_p50_s']:6.2f} s, all done {result['all_done_s']:6.2f} s, "
                f"prompt tokens computed {result['prompt_tokens_computed']} of {result['prompt_tokens']}",
                flush=True,
            )
    medians = {
        arm: {key: statistics.median(r[key] for r in results) for key in results[0]} for arm, results in rounds.items()
    }
    print(f"\n{'':24s} {'every first token':>18s} {'TTFT p50':>9s} {'all done':>9s} {'prompt computed':>16s}")
    for arm in ARMS:
        m = medians[arm]
        print(
            f"{arm:24s} {m['all_first_tokens_s']:16.2f} s {m['ttft_p50_s']:7.2f} s {m['all_done_s']:7.2f} s "
            f"{m['prompt_tokens_computed']:9.0f} of {m['prompt_tokens']:.0f}"
        )
    before, now = medians["as before"], medians["wait for shared blocks"]
    print(f"every first token {before['all_first_tokens_s'] / now['all_first_tokens_s']:.2f}x sooner (medians)")
    report = {
        "model": loaded.name,
        "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "command": " ".join(sys.argv),
        "workload": {
            k: getattr(args, k) for k in ("requests", "shared_tokens", "own_tokens", "output_tokens", "rounds")
        },
        "rounds": rounds,
        "medians": medians,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
