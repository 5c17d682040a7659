"""Fair share between teams, measured: one team floods the engine while another sends a request now and then.

The same workload runs under `--scheduling fair` and `fcfs` through the async engine (the app's interface,
without HTTP). Per team it reports output tokens/s while the team had work, and time to first token
p50 / p99; for the whole run, output tokens/s and fair preemptions. Writes JSON and a PNG under bench/results/.

    python bench/fairness_bench.py                 # the embedded SmolLM2 in bf16 (about a minute)
    python bench/fairness_bench.py --quick         # a tiny random Llama: a smoke run of seconds

`--shapes chat,prefill` runs issue #45's floods instead, on the embedded model with the server's default
flags (float32, --quantization auto): team A sends its whole flood at once, 4 s later team B sends 4 short
streamed requests one after another. chat: 160 requests of ~150 prompt tokens and 64-224 output tokens;
prefill: 96 prompts of ~1,200 tokens and 8 output tokens (ignore_eos). It reports B's time to first token
alone and during the flood against the bound max(3 x solo, solo + 2 s), and the plain flood's throughput
(no B) with this scheduler and with the one at `--baseline-ref` (before fair share covered the prefill
phase), in the same run. Writes bench/results/fairness_prefill.json.

    python bench/fairness_bench.py --shapes chat,prefill                 # full size (~10 min, quiet machine)
    python bench/fairness_bench.py --shapes chat,prefill --scale 0.1     # a reduced run that proves it works
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see engine_bench.py: spinning OpenMP threads on a shared VM

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams
from engine.step_budget import StepBudget
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


def quick_model(data_dir: str) -> LoadedModel:
    """A tiny random Llama with SmolLM2's tokenizer: smoke runs of seconds."""
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
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
    ).save_pretrained(folder)
    base = load_model(EngineConfig(model="default", dtype="float32", data_dir=data_dir))
    base.tokenizer.save_pretrained(folder)
    return load_model(EngineConfig(model=str(folder), dtype="float32"))


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


@dataclass(frozen=True)
class FloodShape:
    """Issue #45's floods: team A sends everything at once, team B asks a little later, one request at a time."""

    flood_requests: int
    prompt_tokens: int
    output_tokens: tuple[int, int]
    quiet_requests: int = 4
    quiet_prompt_tokens: int = 24  # "Hi" in the chat template with its default system prompt is ~30
    quiet_tokens: int = 16
    quiet_after_s: float = 4.0

    def scaled(self, scale: float) -> FloodShape:
        return replace(
            self,
            flood_requests=max(4, round(self.flood_requests * scale)),
            quiet_after_s=max(0.5, self.quiet_after_s * min(1.0, scale * 2)),
        )


SHAPES = {
    "chat": FloodShape(flood_requests=160, prompt_tokens=150, output_tokens=(64, 224)),
    "prefill": FloodShape(flood_requests=96, prompt_tokens=1200, output_tokens=(8, 8)),
}


def baseline_scheduler(ref: str) -> type:
    """engine/scheduler.py as it was at `ref` (git), as a class the engine can be built with."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:engine/scheduler.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType("baseline_scheduler")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{ref}:engine/scheduler.py", "exec"), module.__dict__)

    class Baseline(module.Scheduler):  # type: ignore[name-defined,misc]
        """The engine reports each step's time to its scheduler's step budget; the old scheduler had none
        (its budget was max_num_batched_tokens alone, which a budget with no time bound keeps)."""

        def __init__(self, config: EngineConfig, block_manager: object) -> None:
            super().__init__(config, block_manager)
            self.step_budget = StepBudget(config.max_num_batched_tokens, 0.0)

    return Baseline


@contextlib.contextmanager
def scheduler_class(cls: type | None) -> Iterator[None]:
    """Engines built inside use `cls` (None: this tree's scheduler)."""
    import engine.llm_engine as llm_engine

    current = llm_engine.Scheduler
    llm_engine.Scheduler = cls or current  # type: ignore[misc]
    try:
        yield
    finally:
        llm_engine.Scheduler = current  # type: ignore[misc]


async def ttft_of(engine: AsyncEngine, request_id: str, prompt: list[int], max_tokens: int, team: str) -> float:
    """Streams one request to its end; its time to first token."""
    sent = time.monotonic()
    first: float | None = None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async for output in engine.generate(request_id, prompt, params, Tenancy(team=team)):
        if first is None and any(delta.token_ids for delta in output.deltas):
            first = time.monotonic() - sent
    assert first is not None
    return first


async def run_flood(loaded: LoadedModel, config: EngineConfig, shape: FloodShape, *, quiet: bool) -> dict:
    """A's flood (and B's requests when `quiet`) through one fresh async engine."""
    engine = AsyncEngine.start(config, loaded)
    rng = random.Random(45)
    vocab = loaded.shape.vocab_size

    def prompt(number: int, length: int) -> list[int]:
        return [3 + (number * 7919 + i * 104729) % (vocab - 4) for i in range(length)]

    served = {"output": 0}

    async def flood_request(number: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(*shape.output_tokens), ignore_eos=True)
        async for output in engine.generate(f"a-{number}", prompt(number, shape.prompt_tokens), params, Tenancy("a")):
            served["output"] += sum(len(delta.token_ids) for delta in output.deltas)

    started = time.monotonic()
    try:
        flood = [asyncio.create_task(flood_request(n)) for n in range(shape.flood_requests)]
        quiet_ttft = []
        if quiet:
            await asyncio.sleep(shape.quiet_after_s)
            for n in range(shape.quiet_requests):
                quiet_prompt = prompt(100_000 + n, shape.quiet_prompt_tokens)
                quiet_ttft.append(await ttft_of(engine, f"b-{n}", quiet_prompt, shape.quiet_tokens, "b"))
        await asyncio.gather(*flood)
        seconds = time.monotonic() - started
    finally:
        engine.shutdown()
    prompt_tokens = shape.flood_requests * shape.prompt_tokens
    return {
        "seconds": seconds,
        "flood_output_tokens_per_s": served["output"] / seconds,
        "flood_tokens_per_s": (served["output"] + prompt_tokens) / seconds,
        "quiet_ttft_s": quiet_ttft,
    }


async def solo_ttft(loaded: LoadedModel, config: EngineConfig, shape: FloodShape) -> float:
    """B alone: the median of 3 requests, one after another, on an idle engine."""
    engine = AsyncEngine.start(config, loaded)
    vocab = loaded.shape.vocab_size
    try:
        times = [
            await ttft_of(
                engine,
                f"solo-{n}",
                [3 + (n * 31 + i * 7) % (vocab - 4) for i in range(shape.quiet_prompt_tokens)],
                shape.quiet_tokens,
                "b",
            )
            for n in range(3)
        ]
    finally:
        engine.shutdown()
    return statistics.median(times)


def run_shapes(
    loaded: LoadedModel, config: EngineConfig, names: list[str], scale: float, ref: str, rounds: int
) -> dict:
    """Per shape: B alone, B during the flood (this scheduler and the baseline's, once each), then the plain
    flood `rounds` times per scheduler, alternated (new, baseline, baseline, new, ...) so that a drift of the
    machine's speed falls on both; the throughput ratio is of the medians."""
    baseline = baseline_scheduler(ref)
    report: dict = {
        "model": loaded.name,
        "config": config.__dict__,
        "scale": scale,
        "baseline_ref": ref,
        "rounds": rounds,
        "shapes": {},
    }
    for name in names:
        shape = SHAPES[name].scaled(scale)
        solo = asyncio.run(solo_ttft(loaded, config, shape))
        bound = max(3 * solo, solo + 2.0)
        result: dict = {"shape": shape.__dict__, "solo_ttft_s": solo, "bound_s": bound}
        schedulers = {"new": None, "baseline": baseline}
        for label, cls in schedulers.items():
            with scheduler_class(cls):
                result[f"with_b_{label}"] = asyncio.run(run_flood(loaded, config, shape, quiet=True))
        plain_rounds: dict[str, list[dict]] = {"new": [], "baseline": []}
        for number in range(rounds):
            order = ("new", "baseline") if number % 2 == 0 else ("baseline", "new")
            for label in order:
                with scheduler_class(schedulers[label]):
                    plain_rounds[label].append(asyncio.run(run_flood(loaded, config, shape, quiet=False)))
        for label, runs in plain_rounds.items():
            median = statistics.median(run["flood_tokens_per_s"] for run in runs)
            result[f"plain_{label}"] = min(runs, key=lambda run: abs(run["flood_tokens_per_s"] - median))
            result[f"plain_{label}_rounds_tokens_per_s"] = [run["flood_tokens_per_s"] for run in runs]
            result[f"plain_{label}"]["flood_tokens_per_s"] = median
        new, old = result["plain_new"]["flood_tokens_per_s"], result["plain_baseline"]["flood_tokens_per_s"]
        result["plain_throughput_ratio"] = new / old
        result["within_bound"] = max(result["with_b_new"]["quiet_ttft_s"]) <= bound
        report["shapes"][name] = result
        print(f"{name}: {shape.flood_requests} x {shape.prompt_tokens} prompt tokens, outputs {shape.output_tokens}")
        print(f"  B alone: TTFT {solo:.3f}s   bound max(3x solo, solo + 2 s) = {bound:.2f}s")
        for label in ("new", "baseline"):
            ttfts = ", ".join(f"{t:.2f}" for t in result[f"with_b_{label}"]["quiet_ttft_s"])
            plain = result[f"plain_{label}"]
            print(
                f"  {label:8s} B during the flood: {ttfts} s   plain flood: {plain['flood_tokens_per_s']:.0f} tok/s "
                f"({plain['flood_output_tokens_per_s']:.0f} output tok/s, {plain['seconds']:.1f}s)"
            )
        print(f"  plain flood throughput new / baseline: {result['plain_throughput_ratio']:.3f}")
    return report


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
    parser.add_argument("--shapes", default="", help="issue #45's floods instead: chat,prefill (see above)")
    parser.add_argument("--scale", type=float, default=1.0, help="with --shapes: the floods' size, 1 = full")
    parser.add_argument("--baseline-ref", default="83c0b5c", help="with --shapes: git ref of the scheduler to compare")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="with --shapes: the step budget")
    parser.add_argument("--max-step-seconds", type=float, default=None, help="with --shapes: a step's time bound")
    parser.add_argument("--rounds", type=int, default=2, help="with --shapes: plain floods per scheduler, alternated")
    args = parser.parse_args()
    if args.shapes:
        names = [name for name in args.shapes.split(",") if name]
        if unknown := set(names) - set(SHAPES):
            parser.error(f"unknown shapes {sorted(unknown)}; choose from {sorted(SHAPES)}")
        if args.quick:
            loaded = quick_model(args.data_dir)
            config = EngineConfig(model=str(loaded.folder), num_kv_blocks=8192, max_num_seqs=64)
        else:
            config = EngineConfig(data_dir=args.data_dir, quantization="auto")  # the server's defaults
            loaded = load_model(config)
        if args.max_num_batched_tokens:
            config = replace(config, max_num_batched_tokens=args.max_num_batched_tokens)
        if args.max_step_seconds is not None:
            config = replace(config, max_step_seconds=args.max_step_seconds)
        report = run_shapes(loaded, config, names, args.scale, args.baseline_ref, args.rounds)
        out = args.out if args.out != RESULTS / "fairness_bench.json" else RESULTS / "fairness_prefill.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {out}")
        return
    workload = Workload()
    if args.quick:
        loaded = quick_model(args.data_dir)
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
