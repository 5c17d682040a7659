"""Quality of the quantized modes against bfloat16: greedy token agreement and perplexity.

For each mode (--quantization int8 / int4, bfloat16 activations) on the embedded SmolLM2:
- agreement: bf16 generates greedily from varied chat prompts (about 1k tokens in all); the quantized
  model reads the same sequences (teacher forcing) and we count the positions where its greedy choice is
  bf16's token. This counts each disagreement once; free-running generations are printed too (there a
  single early flip changes the rest of a reply, so the prefix before the first flip is reported).
- perplexity: of each mode on a fixed English text (below), with the relative gap to bf16.
- weights: bytes resident in the linears, head and embedding, against bf16's.
Prints a table and writes JSON under bench/results/. Targets (issue #17): agreement >= 98%, perplexity
within 2% of bf16, int4 weights <= 40% of bf16.

    python bench/quality_bench.py                      # int8 and int4, float32 activations (the default)
    python bench/quality_bench.py --dtype bfloat16     # bfloat16 activations
    python bench/quality_bench.py --modes int4 --max-tokens 64
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in the server: a shared machine's threads wait passively

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.models.llama import AttentionMetadata, LlamaForCausalLM
from engine.sampling_params import SamplingParams

RESULTS = ROOT / "bench" / "results"
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea at night.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "List five tips for learning a new language.",
    "What is 17 times 23? Show your steps.",
    "Write a Python function that reverses a string, and explain it.",
    "Summarize the plot of a story about a lost dog finding its way home.",
    "Why do leaves change color in autumn?",
]
# Written for this benchmark: plain expository English, about 450 tokens.
FIXED_TEXT = (
    "The river begins as a thin stream high in the mountains, where snow melts slowly through the spring. "
    "As it descends, small creeks join it from both sides, and by the time it reaches the valley it is wide "
    "enough to carry boats. Farmers along its banks have used the water for centuries to irrigate their "
    "fields, and the towns that grew up beside it depended on it for trade. In the summer the current is "
    "gentle, and children swim in the shallow bends; in the autumn heavy rains can raise the level by "
    "several meters in a single night. Engineers built dams and levees to control the floods, but these "
    "changed the river in ways that were not expected. Fish that once swam upstream to lay their eggs could "
    "no longer pass the walls, and the sand that the water used to carry to the coast was trapped behind "
    "the dams. Without that sand, the beaches near the mouth of the river began to shrink. Today scientists "
    "study the whole basin as a single system, measuring the flow of water, the movement of sediment and the "
    "health of the animals that live there. They have learned that small changes in one place can have large "
    "effects far away. Some communities have removed old dams, and within a few years the fish returned. "
    "Others have planted trees along the banks to keep the soil from washing away. A library, in the same "
    "way, is more than a building full of books. It is a place where people come to read, to study, to meet "
    "friends and to use computers they may not have at home. Librarians help visitors find information, "
    "teach classes on research, and organize events for children and adults. In many towns the library is "
    "one of the few public spaces where anyone can spend an afternoon without paying. When budgets are cut, "
    "libraries often reduce their hours first, and the people who rely on them most feel the loss. Good "
    "public services are like rivers: they connect places, they carry what people need, and they are easy "
    "to take for granted until they run dry."
)


def all_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """float32 [len(token_ids), vocab]: the next-token logits at every position, one prefill pass."""
    model: LlamaForCausalLM = engine.loaded.model
    block_size = engine.config.block_size
    blocks = -(-len(token_ids) // block_size)
    count = len(token_ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(count, dtype=torch.long),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, blocks, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=torch.arange(blocks, dtype=torch.int32).view(1, blocks),
        prefill_query_start_loc=torch.tensor([0, count], dtype=torch.int32),
        prefill_context_lens=torch.tensor([count], dtype=torch.int32),
        num_prefills=1,
    )
    hidden = model.forward(torch.tensor(token_ids), torch.arange(count), meta, engine.runner.kv_caches)
    return model.compute_logits(hidden)


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for number, prompt in enumerate(prompts):
        engine.add_request(f"q{number}", prompt, params)
    out: dict[str, list[int]] = {f"q{number}": [] for number in range(len(prompts))}
    for _ in range(100_000):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            for delta in output.deltas:
                out[output.request_id].extend(delta.token_ids)
    return [out[f"q{number}"] for number in range(len(prompts))]


def perplexity(engine: LLMEngine, token_ids: list[int]) -> float:
    logits = all_logits(engine, token_ids)[:-1]
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits, targets)
    return math.exp(float(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    parser.add_argument("--max-tokens", type=int, default=128, help="generated per prompt (8 prompts)")
    parser.add_argument("--data-dir", default=os.environ.get("TOKENMILL_TEST_DATA_DIR", ".tokenmill"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="activations of the quantized modes (the reference is always bfloat16)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="the quantized modes' KV cache (auto: bfloat16 under float32 activations, as the server runs)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    def engine_for(quantization: str) -> LLMEngine:
        dtype = "bfloat16" if quantization == "none" else args.dtype
        config = EngineConfig(
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype="auto" if quantization == "none" else args.kv_cache_dtype,  # type: ignore[arg-type]
            data_dir=args.data_dir,  # type: ignore[arg-type]
            num_kv_blocks=256,
        )
        return LLMEngine(config, load_model(config))

    started = time.monotonic()
    reference = engine_for("none")
    tokenizer = reference.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        for p in PROMPTS
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    reference_out = greedy(reference, prompts, args.max_tokens)
    text_ids = tokenizer.encode(FIXED_TEXT, add_special_tokens=False)
    reference_ppl = perplexity(reference, text_ids)
    reference_bytes = reference.loaded.model.weight_nbytes()
    rows = [
        {
            "mode": "bf16",
            "agreement": 1.0,
            "free_running_prefix": 1.0,
            "perplexity": reference_ppl,
            "perplexity_gap": 0.0,
            "weight_bytes": reference_bytes,
            "weight_fraction": 1.0,
        }
    ]
    del reference
    for mode in args.modes:
        engine = engine_for(mode)
        agree = total = 0
        for prompt, continuation in zip(prompts, reference_out):
            logits = all_logits(engine, prompt + continuation)
            predicted = logits[len(prompt) - 1 : len(prompt) - 1 + len(continuation)].argmax(-1).tolist()
            agree += sum(int(a == b) for a, b in zip(predicted, continuation))
            total += len(continuation)
        free = greedy(engine, prompts, args.max_tokens)
        prefix = sum(
            next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(free, reference_out)
        )
        ppl = perplexity(engine, text_ids)
        nbytes = engine.loaded.model.weight_nbytes()
        rows.append(
            {
                "mode": mode,
                "agreement": agree / total,
                "free_running_prefix": prefix / total,
                "perplexity": ppl,
                "perplexity_gap": ppl / reference_ppl - 1,
                "weight_bytes": nbytes,
                "weight_fraction": nbytes / reference_bytes,
                "tokens_compared": total,
            }
        )
        del engine
    print(
        f"\nquantized modes with {args.dtype} activations against bfloat16; "
        f"{len(prompts)} prompts x {args.max_tokens} greedy tokens; perplexity over {len(text_ids)} tokens "
        f"({time.monotonic() - started:.0f} s)"
    )
    print(
        f"{'mode':6} {'agreement':>10} {'free-run prefix':>16} {'perplexity':>11} {'vs bf16':>8} {'weights MB':>11} "
        f"{'of bf16':>8}"
    )
    for row in rows:
        print(
            f"{row['mode']:6} {row['agreement']:10.1%} {row['free_running_prefix']:16.1%} {row['perplexity']:11.3f} "
            f"{row['perplexity_gap']:+8.2%} {row['weight_bytes'] / 1e6:11.1f} {row['weight_fraction']:8.1%}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    # the server's configuration keeps the plain file name; a KV cache chosen by hand is added to it
    name = f"quality_bench_{args.dtype}" + ("" if args.kv_cache_dtype == "auto" else f"-kv-{args.kv_cache_dtype}")
    summary = {"max_tokens": args.max_tokens, "activations": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}
    (RESULTS / f"{name}.json").write_text(json.dumps({**summary, "rows": rows}, indent=2))
    print(f"wrote {RESULTS / f'{name}.json'}")


if __name__ == "__main__":
    main()
