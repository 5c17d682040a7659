"""Fair share between teams, measured: one team floods the engine while another sends a request now and then.

The same workload runs under `--scheduling fair` and `fcfs` through the async engine (the app's interface,
without HTTP). Per team it reports output tokens/s while the team had work, and time to first token
p50 / p99; for the whole run, output tokens/s and fair preemptions. Writes JSON and a PNG under bench/results/.

    python bench/fairness_bench.py                 # the embedded SmolLM2 in bf16 (about a minute)
    python bench/fairness_bench.py --quick         # a tiny random Llama: a smoke run of seconds
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see engine_bench.py: spinning OpenMP threads on a shared VM

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams
from engine.tenancy import Tenancy

RESULTS = ROOT / "bench" / "results"


@dataclass
class Workload:
    flood_requests: int = 64
    flood_tokens: tuple[int, int] = (32, 96)  # output length range of the flood's requests
    quiet_requests: int = 8
    quiet_tokens: int = 16
    quiet_every_s: float = 0.5  # the quiet team sends one request this often, starting after 1 s
    prompt_tokens: int = 40
    max_num_seqs: int = 16
    seed: int = 0


@dataclass
class TeamResult:
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    first_sent: float = float("inf")
    last_done: float = 0.0
    cumulative: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, tokens so far)

    def summary(self) -> dict:
        busy = max(self.last_done - self.first_sent, 1e-9)
        ordered = sorted(self.ttft_s)
        return {
            "requests": len(ordered),
            "output_tokens": self.output_tokens,
            "tokens_per_s_while_busy": self.output_tokens / busy,
            "ttft_p50_s": statistics.median(ordered),
            "ttft_p99_s": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "ttft_max_s": ordered[-1],
        }


async def one_request(
    engine: AsyncEngine,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    team: str,
    result: TeamResult,
    started: float,
) -> None:
    sent = time.monotonic()
    result.first_sent = min(result.first_sent, sent - started)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = True
    async for output in engine.generate(request_id, prompt, params, Tenancy(team=team)):
        tokens = sum(len(delta.token_ids) for delta in output.deltas)
        if tokens and first:
            result.ttft_s.append(time.monotonic() - sent)
            first = False
        result.output_tokens += tokens
        result.cumulative.append((time.monotonic() - started, result.output_tokens))
    result.last_done = max(result.last_done, time.monotonic() - started)


async def run_mode(loaded: LoadedModel, config: EngineConfig, workload: Workload) -> dict:
    engine = AsyncEngine.start(config, loaded)
    rng = random.Random(workload.seed)
    vocab = loaded.shape.vocab_size

    def prompt(number: int) -> list[int]:
        return [1 + (number * 7919 + i * 104729) % (vocab - 2) for i in range(workload.prompt_tokens)]

    teams = {"flood": TeamResult(), "quiet": TeamResult()}
    started = time.monotonic()
    try:
        tasks = [
            asyncio.create_task(
                one_request(
                    engine,
                    f"flood-{n}",
                    prompt(n),
                    rng.randint(*workload.flood_tokens),
                    "flood",
                    teams["flood"],
                    started,
                )
            )
            for n in range(workload.flood_requests)
        ]
        await asyncio.sleep(1.0)
        for n in range(workload.quiet_requests):
            tasks.append(
                asyncio.create_task(
                    one_request(
                        engine,
                        f"quiet-{n}",
                        prompt(10_000 + n),
                        workload.quiet_tokens,
                        "quiet",
                        teams["quiet"],
                        started,
                    )
                )
            )
            await asyncio.sleep(workload.quiet_every_s)
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        stats = engine.stats()
    finally:
        engine.shutdown()
    total = sum(team.output_tokens for team in teams.values())
    return {
        "seconds": elapsed,
        "output_tokens_per_s": total / elapsed,
        "fair_preemptions": stats.num_preemptions_fair,
        "preemptions": stats.num_preemptions,
        "teams": {name: team.summary() for name, team in teams.items()},
        "curves": {name: team.cumulative[:: max(1, len(team.cumulative) // 400)] for name, team in teams.items()},
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_axis, served_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    modes = list(report["modes"])
    width = 0.2
    for offset, (team, stat) in enumerate([(t, s) for t in ("flood", "quiet") for s in ("ttft_p50_s", "ttft_p99_s")]):
        values = [report["modes"][mode]["teams"][team][stat] for mode in modes]
        ttft_axis.bar(
            [i + (offset - 1.5) * width for i in range(len(modes))], values, width, label=f"{team} {stat[5:8]}"
        )
    ttft_axis.set_xticks(range(len(modes)), modes)
    ttft_axis.set_yscale("log")
    ttft_axis.set_ylabel("time to first token (s, log)")
    ttft_axis.set_title("TTFT per team")
    ttft_axis.legend()
    for mode, style in zip(modes, ("-", "--")):
        for team, color in (("flood", "tab:red"), ("quiet", "tab:blue")):
            curve = report["modes"][mode]["curves"][team]
            served_axis.plot([t for t, _ in curve], [n for _, n in curve], style, color=color, label=f"{team} ({mode})")
    served_axis.set_xlabel("seconds")
    served_axis.set_ylabel("output tokens served")
    served_axis.set_yscale("symlog")
    served_axis.set_title("tokens served over time")
    served_axis.legend()
    fig.suptitle(f"fair share vs fcfs: {report['model']}, {report['workload']['max_num_seqs']} seats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random model and a small workload")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness_bench.json")
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("TOKENMILL_DATA_DIR", ".tokenmill"),
        help="where the converted embedded model is cached",
    )
    args = parser.parse_args()
    workload = Workload()
    if args.quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        folder = Path(tempfile.mkdtemp(prefix="fairness-tiny-"))
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
        ).save_pretrained(folder)
        base = load_model(EngineConfig(model="default", dtype="float32", data_dir=args.data_dir))
        base.tokenizer.save_pretrained(folder)
        loaded = load_model(EngineConfig(model=str(folder), dtype="float32"))
        workload = Workload(flood_requests=48, quiet_requests=4, quiet_every_s=0.2, max_num_seqs=8)
    else:
        loaded = load_model(EngineConfig(dtype=args.dtype, data_dir=args.data_dir))
    report: dict = {"model": loaded.name, "workload": workload.__dict__, "modes": {}}
    for mode in ("fair", "fcfs"):
        dtype = "bfloat16" if loaded.dtype == torch.bfloat16 else "float32"
        config = EngineConfig(
            model=str(loaded.folder),
            dtype=dtype,
            max_num_seqs=workload.max_num_seqs,
            num_kv_blocks=2048,
            scheduling=mode,
        )
        report["modes"][mode] = asyncio.run(run_mode(loaded, config, workload))
        result = report["modes"][mode]
        print(
            f"{mode:5s} {result['seconds']:6.1f}s  {result['output_tokens_per_s']:7.1f} tok/s  "
            f"fair preemptions {result['fair_preemptions']}"
        )
        for team, summary in result["teams"].items():
            print(
                f"      {team:6s} {summary['tokens_per_s_while_busy']:7.1f} tok/s while busy   TTFT p50 "
                f"{summary['ttft_p50_s']:.3f}s  p99 {summary['ttft_p99_s']:.3f}s  max {summary['ttft_max_s']:.3f}s"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
