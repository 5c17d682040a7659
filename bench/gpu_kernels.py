"""Every Triton kernel against its torch reference on a GPU, then the engine end to end on the GPU.

    python bench/gpu_kernels.py            # about 3-5 minutes on one H200; must stay under 8

On a lent device machine (python3 there holds torch, triton and transformers), as one run:
    PYTHONUNBUFFERED=1 python3 bench/gpu_kernels.py; cp bench/results/gpu_* "$OUT"/

Part 1: each kernel against its reference (bf16 and fp32): agreement and time. Shapes are a small Llama
(32 query heads, 8 kv heads, head_dim 64, hidden 2048, ffn 8192) serving a busy batch.
Part 2 (bench/gpu_e2e.py): the engine on device="cuda" through those kernels, with and without CUDA
graphs, on SmolLM2 and a ~1B random Llama at 1 / 32 / 256 concurrent requests, and greedy checks.

Writes bench/results/gpu_kernels.json and bench/results/gpu_e2e.png. Without CUDA it says so and exits 0;
on a kernel disagreement beyond the tolerance, or a failed greedy check, it exits 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.paged_attention import (
    paged_attention_decode_reference,
    paged_attention_decode_triton,
    paged_attention_prefill_reference,
    paged_attention_prefill_triton,
)
from kernels.rms_norm import rms_norm_reference, rms_norm_triton
from kernels.rotary import rotary_embedding_reference, rotary_embedding_triton
from kernels.store_kv import store_kv_reference, store_kv_triton

DEVICE = "cuda"
RESULTS = ROOT / "bench" / "results" / "gpu_kernels.json"
TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, BLOCK_SIZE = 32, 8, 64, 2048, 8192, 16
DECODE_SEQS, DECODE_CONTEXT = 32, 1000  # not a multiple of the block size on purpose
PREFILL_SEQS, PREFILL_PREFIX, PREFILL_NEW = 4, 250, 500
TOKENS = 2048


def paged_inputs(context_lens: list[int], dtype: torch.dtype):
    blocks_per_seq = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 8
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device=DEVICE, dtype=dtype)
    value_cache = torch.randn(shape, device=DEVICE, dtype=dtype)
    ids = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    table = torch.zeros(len(context_lens), max(blocks_per_seq) + 2, dtype=torch.int32, device=DEVICE)
    start = 0
    for seq, count in enumerate(blocks_per_seq):
        table[seq, :count] = ids[start : start + count]
        start += count
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return key_cache, value_cache, table, lens


def cases(dtype: torch.dtype):
    """(kernel, shape, triton call, reference call) per kernel; the calls take no arguments."""
    scale = HEAD_DIM**-0.5
    randn = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=dtype)

    key_cache, value_cache, table, lens = paged_inputs([DECODE_CONTEXT] * DECODE_SEQS, dtype)
    query = randn(DECODE_SEQS, HEADS, HEAD_DIM)
    decode_args = (query, key_cache, value_cache, table, lens, scale)
    yield (
        "paged_attention_decode",
        f"{DECODE_SEQS} seqs x {DECODE_CONTEXT} ctx",
        lambda: paged_attention_decode_triton(*decode_args),
        lambda: paged_attention_decode_reference(*decode_args),
    )

    context = PREFILL_PREFIX + PREFILL_NEW
    key_cache, value_cache, table, lens = paged_inputs([context] * PREFILL_SEQS, dtype)
    query = randn(PREFILL_SEQS * PREFILL_NEW, HEADS, HEAD_DIM)
    starts = torch.arange(0, PREFILL_SEQS + 1, device=DEVICE, dtype=torch.int32) * PREFILL_NEW
    prefill_args = (query, key_cache, value_cache, table, starts, lens, scale)
    yield (
        "paged_attention_prefill",
        f"{PREFILL_SEQS} seqs x {PREFILL_NEW} new after {PREFILL_PREFIX}",
        lambda: paged_attention_prefill_triton(*prefill_args),
        lambda: paged_attention_prefill_reference(*prefill_args),
    )

    num_blocks = TOKENS // BLOCK_SIZE + 8
    key_cache = randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    value_cache = randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key, value = randn(TOKENS, KV_HEADS, HEAD_DIM), randn(TOKENS, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:TOKENS]
    triton_caches, reference_caches = (key_cache.clone(), value_cache.clone()), (key_cache.clone(), value_cache.clone())
    yield (
        "store_kv",
        f"{TOKENS} tokens",
        lambda: store_kv_triton(key, value, *triton_caches, slots) or triton_caches,
        lambda: store_kv_reference(key, value, *reference_caches, slots) or reference_caches,
    )

    x, residual, weight = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN), randn(HIDDEN)
    yield (
        "rms_norm+residual",
        f"{TOKENS} x {HIDDEN}",
        lambda: rms_norm_triton(x, weight, 1e-6, residual),
        lambda: rms_norm_reference(x, weight, 1e-6, residual),
    )

    qkv = randn(TOKENS, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, : HEADS * HEAD_DIM].view(TOKENS, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(TOKENS, KV_HEADS, HEAD_DIM)
    cos_sin_cache = torch.randn(4096, 2, HEAD_DIM, device=DEVICE)
    positions = torch.randint(0, 4096, (TOKENS,), device=DEVICE)
    yield (
        "rotary_embedding",
        f"{TOKENS} tokens",
        lambda: rotary_embedding_triton(positions, q, k, cos_sin_cache),
        lambda: rotary_embedding_reference(positions, q, k, cos_sin_cache),
    )

    gate_up = randn(TOKENS, 2 * FFN)
    yield (
        "silu_and_mul",
        f"{TOKENS} x {FFN}",
        lambda: silu_and_mul_triton(gate_up),
        lambda: silu_and_mul_reference(gate_up),
    )


def max_error(actual, expected) -> float:
    if isinstance(actual, torch.Tensor):
        actual, expected = (actual,), (expected,)
    return max((a.float() - e.float()).abs().max().item() for a, e in zip(actual, expected))


def agrees(actual, expected, dtype: torch.dtype) -> bool:
    if isinstance(actual, torch.Tensor):
        actual, expected = (actual,), (expected,)
    return all(torch.allclose(a, e, **TOLERANCE[dtype]) for a, e in zip(actual, expected))


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_kernels: no CUDA device here, nothing to check or time. "
            "(On CPU the kernels are tested under TRITON_INTERPRET=1 by tests/kernels/test_kernels.py.)"
        )
        return 0
    import triton
    from triton.testing import do_bench

    torch.manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, shape, fast, reference in cases(dtype):
            actual, expected = fast(), reference()
            torch.cuda.synchronize()
            rows.append(
                {
                    "kernel": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": shape,
                    "max_abs_error": max_error(actual, expected),
                    "ok": agrees(actual, expected, dtype),
                    "triton_ms": do_bench(fast, return_mode="median"),
                    "torch_ms": do_bench(reference, return_mode="median"),
                }
            )

    header = (
        f"{'kernel':<24} {'dtype':<9} {'shape':<30} {'max err':>9} {'ok':>3} "
        f"{'triton ms':>10} {'torch ms':>10} {'speedup':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['kernel']:<24} {row['dtype']:<9} {row['shape']:<30} {row['max_abs_error']:>9.2e} "
            f"{'yes' if row['ok'] else 'NO':>3} {row['triton_ms']:>10.4f} {row['torch_ms']:>10.4f} "
            f"{row['torch_ms'] / row['triton_ms']:>7.2f}x"
        )

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tolerance": {str(k).removeprefix("torch."): v for k, v in TOLERANCE.items()},
        "results": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")  # the kernel part survives a failing engine part
    kernels_ok = all(row["ok"] for row in rows)

    from bench.gpu_e2e import run_end_to_end

    report["end_to_end"] = run_end_to_end(RESULTS.parent)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0 if kernels_ok and report["end_to_end"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
