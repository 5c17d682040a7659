"""Which sampling defaults the embedded model should ship with: everyday questions, offline, engine only.

A request that sets no sampling field gets its model's defaults (app/registry/sampling_defaults.py). This
runs candidate defaults against what a new user asks first:
- the README's own request, "What is the capital of France?", 10 times, one after another as a user would
  send them (each timed on its own), and
- 50 everyday factual questions, once each, all at once.

An answer counts as *sensible* when it names the expected answer (any of a few accepted spellings, case
blind) and ends on its own (the model's end-of-turn, not the token limit). A *runaway* is an answer that
reached the token limit: the candidate's own max_tokens, or `--cap` for a candidate without one (the
server would let it run on to --max-tokens-cap, 4,096). The engine loads as `tokenmill serve` does
(quantization auto: int4 for the embedded Q4_1 file on AVX2/AVX-512 CPUs). Writes
bench/results/defaults_bench.json.

    python bench/defaults_bench.py                      # every candidate below
    python bench/defaults_bench.py --candidates card,chosen --tries 3
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/engine_bench.py: a shared machine

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model, resolve_quantization
from engine.sampling_params import SamplingParams

RESULTS = ROOT / "bench" / "results"
README_QUESTION = "What is the capital of France?"
README_ANSWER = ("paris",)

# question -> accepted answers (lower case; one of them must appear in the reply)
QUESTIONS: dict[str, tuple[str, ...]] = {
    README_QUESTION: README_ANSWER,
    "What is the capital of Japan?": ("tokyo",),
    "What is the capital of Italy?": ("rome",),
    "What is the capital of Germany?": ("berlin",),
    "What is the capital of Spain?": ("madrid",),
    "What is the capital of the United Kingdom?": ("london",),
    "What is the capital of Canada?": ("ottawa",),
    "What is the capital of Egypt?": ("cairo",),
    "What is the largest planet in our solar system?": ("jupiter",),
    "Which planet is known as the Red Planet?": ("mars",),
    "What is the closest star to the Earth?": ("sun",),
    "What do bees make?": ("honey",),
    "What gas do plants take in from the air?": ("carbon dioxide", "co2"),
    "What is the chemical symbol for water?": ("h2o", "h₂o"),
    "What is the freezing point of water in degrees Celsius?": ("0", "zero"),
    "What is the boiling point of water in degrees Celsius?": ("100",),
    "How many days are there in a week?": ("7", "seven"),
    "How many legs does a spider have?": ("8", "eight"),
    "How many continents are there?": ("7", "seven"),
    "How many hours are in a day?": ("24", "twenty-four", "twenty four"),
    "How many minutes are in an hour?": ("60", "sixty"),
    "What is 2 plus 2?": ("4", "four"),
    "What is 10 times 10?": ("100", "hundred"),
    "What color is the sky on a clear day?": ("blue",),
    "What color are bananas when they are ripe?": ("yellow",),
    "What is the largest ocean on Earth?": ("pacific",),
    "What is the longest river in Africa?": ("nile",),
    "What is the tallest mountain in the world?": ("everest",),
    "Who wrote Romeo and Juliet?": ("shakespeare",),
    "Who painted the Mona Lisa?": ("leonardo", "da vinci"),
    "Who was the first president of the United States?": ("washington",),
    "What language is mainly spoken in Brazil?": ("portuguese",),
    "What is the main language spoken in Mexico?": ("spanish",),
    "What animal is known as the king of the jungle?": ("lion",),
    "What is the largest mammal in the world?": ("whale",),
    "What do caterpillars turn into?": ("butterfl", "moth"),
    "What is the opposite of hot?": ("cold",),
    "What is the opposite of up?": ("down",),
    "Which season comes after winter?": ("spring",),
    "What is frozen water called?": ("ice",),
    "What organ pumps blood through the body?": ("heart",),
    "How many sides does a triangle have?": ("3", "three"),
    "What is the currency of Japan?": ("yen",),
    "What is the currency of the United States?": ("dollar",),
    "Which animal says moo?": ("cow",),
    "What do we call a baby cat?": ("kitten",),
    "What is the main ingredient in guacamole?": ("avocado",),
    "What metal is liquid at room temperature?": ("mercury",),
    "In which country are the pyramids of Giza?": ("egypt",),
    "What is the hardest natural substance?": ("diamond",),
}


@dataclass(frozen=True)
class Candidate:
    name: str
    defaults: dict[str, float | int]  # as sampling_defaults would hold them
    why: str


CARD = {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's model card; the defaults until now
CANDIDATES = tuple(
    Candidate(name, defaults, why)
    for name, defaults, why in (
        ("openai", {}, "OpenAI's own: temperature 1, top_p 1, no max_tokens"),
        ("card", CARD, "the model card's, the embedded model's defaults until now"),
        ("card+max256", {**CARD, "max_tokens": 256}, "a length limit only"),
        ("card+rep1.1", {**CARD, "repetition_penalty": 1.1}, "a repetition penalty only"),
        ("card+rep1.1+max256", {**CARD, "repetition_penalty": 1.1, "max_tokens": 256}, "both"),
        ("card+rep1.2+max256", {**CARD, "repetition_penalty": 1.2, "max_tokens": 256}, "a stronger penalty"),
        # frequency_penalty counts only the answer's own tokens; repetition_penalty also the prompt's, so it
        # pushes the answer away from the question's words ("capital", "France")
        ("card+freq0.3+max256", {**CARD, "frequency_penalty": 0.3, "max_tokens": 256}, "the answer's repeats"),
        ("card+freq0.5+max256", {**CARD, "frequency_penalty": 0.5, "max_tokens": 256}, "a little more"),
        ("card+freq0.5+max512", {**CARD, "frequency_penalty": 0.5, "max_tokens": 512}, "a longer limit"),
        ("card+freq1.0+max256", {**CARD, "frequency_penalty": 1.0, "max_tokens": 256}, "a stronger one"),
        ("greedy+max256", {"temperature": 0.0, "max_tokens": 256}, "no sampling at all"),
        ("greedy+freq0.5+max256", {"temperature": 0.0, "frequency_penalty": 0.5, "max_tokens": 256}, "greedy"),
        # what app/registry/sampling_defaults.py ships: the card's top_p stays for a request that sets a temperature
        ("chosen", {**CARD, "temperature": 0.0, "frequency_penalty": 0.5, "max_tokens": 256}, "the shipped defaults"),
    )
)


@dataclass
class Answer:
    text: str
    tokens: int
    finish_reason: str
    seconds: float


def params_for(candidate: Candidate, cap: int) -> SamplingParams:
    fields = dict(candidate.defaults)
    fields.setdefault("max_tokens", cap)
    return SamplingParams(**fields)  # type: ignore[arg-type]  # keys checked by SamplingParams itself


def chat_prompt(loaded: LoadedModel, question: str) -> list[int]:
    tokenizer = loaded.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[Answer]:
    """Runs `prompts` together (continuous batching); each answer's seconds are its own, from the start."""
    started = time.perf_counter()
    texts: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    finished: dict[str, tuple[str, float]] = {}
    for index, prompt in enumerate(prompts):
        request_id = f"{tag}-{index}"
        texts[request_id], tokens[request_id] = [], 0
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished:
        for output in engine.step():
            for delta in output.deltas:
                texts[output.request_id].append(delta.text)
                tokens[output.request_id] += len(delta.token_ids)
                if delta.finish_reason:
                    finished[output.request_id] = (delta.finish_reason, time.perf_counter() - started)
    return [
        Answer("".join(texts[key]), tokens[key], *finished[key]) for key in (f"{tag}-{i}" for i in range(len(prompts)))
    ]


def sensible(answer: Answer, accepted: tuple[str, ...]) -> bool:
    return answer.finish_reason == "stop" and any(word in answer.text.lower() for word in accepted)


def measure(engine: LLMEngine, loaded: LoadedModel, candidate: Candidate, tries: int, cap: int) -> dict[str, object]:
    params = params_for(candidate, cap)
    readme_prompt = chat_prompt(loaded, README_QUESTION)
    readme = [run(engine, [readme_prompt], params, f"{candidate.name}-readme-{i}")[0] for i in range(tries)]
    questions = list(QUESTIONS)
    everyday = run(engine, [chat_prompt(loaded, q) for q in questions], params, f"{candidate.name}-everyday")
    answers = readme + everyday
    return {
        "candidate": candidate.name,
        "defaults": candidate.defaults,
        "why": candidate.why,
        "token_limit": params.max_tokens,
        "readme_paris": sum(any(w in a.text.lower() for w in README_ANSWER) for a in readme),
        "readme_tries": tries,
        "readme_max_tokens": max(a.tokens for a in readme),
        "readme_max_seconds": round(max(a.seconds for a in readme), 2),
        "readme_median_seconds": round(statistics.median(a.seconds for a in readme), 2),
        "everyday_sensible": sum(sensible(a, QUESTIONS[q]) for a, q in zip(everyday, questions, strict=True)),
        "everyday_named_answer": sum(
            any(w in a.text.lower() for w in QUESTIONS[q]) for a, q in zip(everyday, questions, strict=True)
        ),
        "everyday_questions": len(questions),
        "mean_tokens": round(statistics.mean(a.tokens for a in answers), 1),
        "runaways": sum(a.finish_reason == "length" for a in answers),
        "answers": len(answers),
        "readme_samples": [a.text[:160] for a in readme],
        "everyday_failures": [
            {"question": q, "answer": a.text[:160], "tokens": a.tokens, "finish_reason": a.finish_reason}
            for a, q in zip(everyday, questions, strict=True)
            if not sensible(a, QUESTIONS[q])
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", default=",".join(c.name for c in CANDIDATES))
    parser.add_argument("--tries", type=int, default=10, help="times the README's question is asked")
    parser.add_argument("--cap", type=int, default=512, help="token limit for candidates without max_tokens")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4"))
    parser.add_argument("--data-dir", default=str(ROOT / ".tokenmill"))
    parser.add_argument("--out", default=str(RESULTS / "defaults_bench.json"))
    args = parser.parse_args()

    chosen = [c for c in CANDIDATES if c.name in args.candidates.split(",")]
    config = EngineConfig(quantization=args.quantization, data_dir=args.data_dir, num_kv_blocks=2048)
    loaded = load_model(config)
    engine = LLMEngine(config, loaded)
    run(engine, [chat_prompt(loaded, "Hi")], SamplingParams(temperature=0.0, max_tokens=4), "warm-up")
    rows = []
    print(
        f"{'candidate':22s} {'README Paris':>12s} {'max tok':>7s} {'max s':>6s} {'sensible':>9s} "
        f"{'mean tok':>8s} {'runaways':>9s}"
    )
    for candidate in chosen:
        row = measure(engine, loaded, candidate, args.tries, args.cap)
        rows.append(row)
        print(
            f"{candidate.name:22s} {row['readme_paris']:>5}/{row['readme_tries']:<6} {row['readme_max_tokens']:>7} "
            f"{row['readme_max_seconds']:>6} {row['everyday_sensible']:>5}/{row['everyday_questions']:<3} "
            f"{row['mean_tokens']:>8} {row['runaways']:>5}/{row['answers']:<3}",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {**vars(args), "quantization_resolved": resolve_quantization(config)}
    out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
