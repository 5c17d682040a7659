"""Interactive time to first token with batch lines in the engine, without the server around it: one
engine, 8 background requests kept in flight (as the batch runner keeps them), a chat request every few
steps. TTFT is counted in process CPU seconds (every thread of this process), so a machine shared with
other work gives the same figures as an idle one; wall seconds are shown beside them.

Three runs on the same request sequence: chat alone, chat with the background as plain low-priority
requests (the scheduler's sit-out switched off), and with background requests sitting out the steps that
compute a chat request's first token (engine/scheduler.py, `_background_sits_out`).

    python bench/background_ttft.py                 # SmolLM2 float32, 30 chat requests (~4 min on 2 cores)
    python bench/background_ttft.py --requests 10   # shorter
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see engine_bench.py: spinning OpenMP threads on a shared VM

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams
from engine.tenancy import Tenancy

BACKGROUND = Tenancy(team="batch", priority=1_000_000, background=True)
CHAT = Tenancy(team="chat")
QUESTIONS = [
    "Write one sentence about the sea.",
    "Name three fruits.",
    "What is a prime number?",
    "Describe a cat in a few words.",
    "Give me a tip for cooking rice.",
]
IN_FLIGHT = 8


def prompt(loaded: LoadedModel, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    chat = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return loaded.tokenizer.encode(chat, add_special_tokens=False)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-round(share * 100) * len(ordered) // 100) - 1)]


def run(loaded: LoadedModel, config: EngineConfig, mode: str, requests: int, every: int, line_tokens: int) -> dict:
    engine = LLMEngine(config, loaded)
    if mode == "plain":  # the background as ordinary lowest-priority requests
        engine.scheduler._background_sits_out = lambda scheduled: None  # type: ignore[method-assign]
    chats = [prompt(loaded, question) for question in QUESTIONS]
    lines = [prompt(loaded, f"Classify ticket {number}: my order did not arrive") for number in range(50)]
    line_params = SamplingParams(temperature=0.0, max_tokens=line_tokens, ignore_eos=True)
    added = 0

    def add_line() -> None:
        nonlocal added
        engine.add_request(f"line-{added}", lines[added % len(lines)], line_params, BACKGROUND)
        added += 1

    if mode != "alone":
        for _ in range(IN_FLIGHT):
            add_line()
        for _ in range(line_tokens // 2):
            engine.step()
    waiting: dict[str, tuple[float, float]] = {}
    ttft_cpu: list[float] = []
    ttft_wall: list[float] = []
    line_tokens_made = 0
    sent = steps = 0
    while sent < requests or waiting:
        if sent < requests and steps % every == 0:
            engine.add_request(
                f"chat-{sent}", chats[sent % len(chats)], SamplingParams(temperature=0.0, max_tokens=4), CHAT
            )
            waiting[f"chat-{sent}"] = (time.process_time(), time.perf_counter())
            sent += 1
        outputs = engine.step()
        steps += 1
        for output in outputs:
            made = sum(len(delta.token_ids) for delta in output.deltas)
            if output.request_id in waiting and made:
                cpu_started, wall_started = waiting.pop(output.request_id)
                ttft_cpu.append(time.process_time() - cpu_started)
                ttft_wall.append(time.perf_counter() - wall_started)
            elif output.request_id.startswith("line-"):
                line_tokens_made += made
                if output.finished:
                    add_line()
    return {"cpu": ttft_cpu, "wall": ttft_wall, "line_tokens": line_tokens_made, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30, help="chat requests per run")
    parser.add_argument("--every", type=int, default=5, help="a chat request every this many steps")
    parser.add_argument("--line-tokens", type=int, default=16, help="output tokens of each batch line")
    parser.add_argument("--data-dir", default=os.environ.get("TOKENMILL_DATA_DIR", ".tokenmill"))
    args = parser.parse_args()
    loaded = load_model(EngineConfig(dtype="float32", data_dir=args.data_dir))
    config = EngineConfig(dtype="float32", num_kv_blocks=1024, max_num_seqs=16, data_dir=args.data_dir)
    results = {
        mode: run(loaded, config, mode, args.requests, args.every, args.line_tokens)
        for mode in ("alone", "plain", "sit-out")
    }
    alone = results["alone"]["cpu"]
    for mode, result in results.items():
        cpu, wall = result["cpu"], result["wall"]
        print(
            f"{mode:8s} TTFT cpu p50 {percentile(cpu, 0.5) * 1000:5.0f} ms p99 {percentile(cpu, 0.99) * 1000:5.0f} ms"
            f" (x{percentile(cpu, 0.5) / percentile(alone, 0.5):.2f} / x{percentile(cpu, 0.99) / percentile(alone, 0.99):.2f})"
            f"; wall p50 {percentile(wall, 0.5) * 1000:5.0f} ms p99 {percentile(wall, 0.99) * 1000:5.0f} ms"
            f"; batch tokens {result['line_tokens']} in {result['steps']} steps"
        )


if __name__ == "__main__":
    main()
