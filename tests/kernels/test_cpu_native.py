"""The native CPU kernels (kernels/csrc) agree with the torch references, and their absence is harmless."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels import cpu_native_ops as native
from kernels.activation import silu_and_mul_reference
from kernels.cpu_attention import heads_major_cache
from kernels.linear import CHUNK_ROWS, Linear, bucket_rows, can_pack
from kernels.paged_attention import paged_attention_decode_reference
from kernels.rms_norm import rms_norm_reference
from kernels.rotary import rotary_embedding_reference
from kernels.store_kv import store_kv_reference

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.skipif(
    not native.silu_and_mul_available(torch.zeros(1, 2)),
    reason="no C++ compiler: the native kernels can't be built here",
)


def cos_sin_table(head_dim: int, positions: int = 4096) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(positions).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return torch.stack((angles.cos(), angles.sin()), dim=1).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g).to(dtype)
    residual = torch.randn(37, 576, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-5, residual)
    got, got_residual = native.rms_norm_native(x, weight, 1e-5, residual)
    assert torch.equal(got_residual, expected_residual)  # the residual sum rounds exactly like torch
    # Only the order of the sum of squares differs: within one rounding step of the dtype.
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference_exactly_on_views_of_a_fused_qkv(dtype):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(23, 9 * 64 + 2 * 3 * 64, generator=g).to(dtype)
    q, k, _ = qkv.split((9 * 64, 3 * 64, 3 * 64), dim=-1)
    q, k = q.view(-1, 9, 64), k.view(-1, 3, 64)
    positions = torch.randint(0, 4096, (23,), generator=g)
    table = cos_sin_table(64)
    expected_q, expected_k = rotary_embedding_reference(positions, q, k, table)
    assert native.rotary_available(q, k, table)
    got_q, got_k = native.rotary_embedding_native(positions, q, k, table)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    x = (3 * torch.randn(19, 2 * 1536, generator=torch.Generator().manual_seed(2))).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 88.5])  # the exp clamps
    # Our exp and torch's differ by an ulp or two of float32, which can move a bfloat16 rounding by one.
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(native.silu_and_mul_native(x), silu_and_mul_reference(x), atol=tolerance, rtol=tolerance)


# (activations, KV cache): the matching pairs, and bfloat16 caches under float32 activations (packed weights)
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
def test_store_kv_writes_the_same_slots_as_the_reference(dtype, cache_dtype):
    """A narrower cache gets the values rounded as torch rounds them (nearest even)."""
    g = torch.Generator().manual_seed(3)
    expected_k, expected_v = (heads_major_cache(9, 16, 3, 64, cache_dtype) for _ in range(2))
    got_k, got_v = expected_k.clone(), expected_v.clone()
    kv = torch.randn(6, 2 * 3 * 64, generator=g).to(dtype)
    key, value = (part.view(6, 3, 64) for part in kv.split((192, 192), dim=-1))  # strided rows
    slots = torch.tensor([0, 17, 143, 95, 40, 41])
    store_kv_reference(key, value, expected_k, expected_v, slots)
    assert native.store_kv_available(key, value, got_k)
    native.store_kv_native(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize(
    "block_size,kv_heads,group,head_dim",
    [
        (16, 3, 3, 64),  # SmolLM2-135M
        (8, 2, 8, 64),  # the vectorised head_dim-64 path with other groups and block sizes
        (32, 4, 1, 64),
        (16, 1, 5, 64),  # a group size without a compiled specialisation
        (16, 2, 8, 128),  # Llama-3-style GQA
        (8, 4, 1, 80),  # multi-head attention, a head size without a compiled specialisation
    ],
)
def test_paged_decode_matches_reference(dtype, cache_dtype, block_size, kv_heads, group, head_dim):
    g = torch.Generator().manual_seed(block_size + kv_heads + group + head_dim)
    num_blocks = 64
    shape = (num_blocks, block_size, kv_heads, head_dim)
    token_major = [torch.randn(*shape, generator=g).to(cache_dtype) for _ in range(2)]
    heads_major = [heads_major_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype) for _ in range(2)]
    for target, source in zip(heads_major, token_major):
        target.copy_(source)
    lengths = torch.tensor([1, block_size, block_size + 1, 7 * block_size - 3, 3], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[: 5 * 7].view(5, 7).int()
    heads = kv_heads * group
    strided_heads = torch.randn(5, 2 * heads, head_dim, generator=g).to(dtype)[:, ::2]
    # As the model passes it: the query columns of the fused qkv output, rows strided past the keys and values.
    fused_qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qkv_view = fused_qkv[:, : heads * head_dim].view(5, heads, head_dim)
    scale = head_dim**-0.5
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for query in (strided_heads, qkv_view):
        expected = paged_attention_decode_reference(query, *token_major, tables, lengths, scale)
        assert native.decode_available(query, heads_major[0])
        got = native.paged_attention_decode_native(query, *heads_major, tables, lengths, scale)
        assert got.is_contiguous() and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 64, 300, 555])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_f_linear(rows, dtype):
    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(96, 576, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(2, rows, 576, generator=g).to(dtype)  # leading dimensions are kept
    for linear_bias in (None, bias):
        linear = Linear(weight, linear_bias)
        if can_pack(weight):
            assert linear.packed is not None and linear.weight is None  # one copy of the weights, packed
        got, expected = linear(x), F.linear(x, weight, linear_bias)
        assert got.shape == expected.shape and got.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)  # oneDNN runs both, padded rows or not
        else:
            # Outputs are about 24 in size; oneDNN sums in another order than MKL.
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_linear_reads_a_strided_input():
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 64, generator=g)
    x = torch.randn(300, 128, generator=g)[:, ::2]
    torch.testing.assert_close(Linear(weight)(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_row_buckets_are_few_and_waste_little():
    """oneDNN keeps a primitive, with its scratch memory, per row count: the buckets bound them."""
    buckets = [bucket_rows(rows) for rows in range(1, CHUNK_ROWS + 1)]
    assert all(b >= rows for rows, b in enumerate(buckets, start=1))
    assert buckets == sorted(buckets) and buckets[-1] == CHUNK_ROWS
    assert len(set(buckets)) <= 32
    assert all(b - rows < max(8, rows // 4) for rows, b in enumerate(buckets, start=1))
    assert bucket_rows(1) == 1  # a single sequence's decode is not padded
    with pytest.raises(ValueError):
        bucket_rows(CHUNK_ROWS + 1)


def run_without_native(tmp_path: Path, environment: dict[str, str]) -> str:
    """A fresh process (the libraries load once per process) that runs one decode through `kernels`."""
    script = (
        "import torch, kernels\n"
        "from kernels import cpu_native_ops as native\n"
        "from kernels.cpu_attention import heads_major_cache\n"
        "cache = heads_major_cache(4, 16, 1, 64, torch.float32).normal_()\n"
        "q = torch.randn(2, 2, 64)\n"
        "out = kernels.paged_attention_decode(q, cache, cache, torch.tensor([[0, 1], [2, 3]]).int(),"
        " torch.tensor([20, 3]).int(), 0.125)\n"
        "print(native.decode_available(q, cache), tuple(out.shape))\n"
    )
    env = {**os.environ, "TOKENMILL_KERNEL_CACHE": str(tmp_path / "kernels"), **environment}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def test_without_a_working_compiler_the_torch_paths_run(tmp_path):
    no_prebuilt = {"TOKENMILL_PREBUILT_KERNELS": str(tmp_path / "none")}
    assert run_without_native(tmp_path, {"CXX": "/bin/false", **no_prebuilt}) == "False (2, 2, 64)"
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_prebuilt_kernels_serve_where_no_compiler_works(tmp_path):
    """The slim image's case: deploy/bundle.py prebuilt them, the machine that serves has no g++."""
    targets = cpu_native.supported_targets()
    if not targets:
        pytest.skip("no portable x86-64 level on this CPU")
    prebuilt = tmp_path / "prebuilt"
    written = cpu_native.prebuild(prebuilt, targets=(targets[0],))
    assert {path.name.split("-x86-64")[0] for path in written} == set(cpu_native.FLAGS)
    environment = {"CXX": "/bin/false", "TOKENMILL_PREBUILT_KERNELS": str(prebuilt)}
    assert run_without_native(tmp_path, environment) == "True (2, 2, 64)"
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing was compiled where it ran

    # A library built from other sources is never loaded: its name carries the sources' hash.
    for path in written:
        path.rename(path.with_name(path.name.replace(targets[0] + "-", targets[0] + "-stale")))
    assert run_without_native(tmp_path, environment) == "False (2, 2, 64)"


def test_the_portable_level_follows_the_cpu_flags():
    v3 = "fpu sse2 avx avx2 fma bmi1 bmi2 f16c movbe"
    assert cpu_native.supported_targets(v3) == ["x86-64-v3"]
    assert cpu_native.supported_targets(v3 + " avx512f avx512bw avx512cd avx512dq avx512vl") == [
        "x86-64-v4",
        "x86-64-v3",
    ]
    assert cpu_native.supported_targets("fp asimd") == []  # an ARM CPU: no prebuilt x86 library applies


def test_native_kernels_can_be_turned_off(tmp_path):
    assert run_without_native(tmp_path, {"TOKENMILL_NATIVE_KERNELS": "0"}) == "False (2, 2, 64)"
