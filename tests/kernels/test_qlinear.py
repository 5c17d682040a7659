"""kernels/qlinear: packed bf16 / int8 / int4 linears for few rows agree with dequantize-then-matmul."""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import pytest
import torch

from kernels import cpu_native
from kernels.qlinear import (
    FORMAT_CODES,
    K_FORMATS,
    PackedLinear,
    PackedWeight,
    QuantizedRows,
    concat_quantized_rows,
    dequantize,
    embedding_rows,
    matrix_unit,
    native_available,
    pack_quantized,
    pack_quantized_chunks,
    pack_weight,
    place_together,
    qlinear_native,
    qlinear_reference,
    quantize_activations,
    quantize_rows,
)

pytestmark = pytest.mark.skipif(
    not native_available(torch.zeros(1, 2)), reason="no C++ compiler: the native kernels can't be built here"
)
# (out_features, in_features): odd K, K below one group, N not a multiple of the 64-row tile, a real shape
SHAPES = [(37, 75), (100, 33), (130, 161), (960, 576)]
FORMATS = ["bf16", "int8", "int4"]


def k_quant_rows(fmt: str, out_features: int, in_features: int, generator: torch.Generator) -> QuantizedRows:
    """Random int4k (Q4_K) or int6k (Q6_K) rows: codes, 6-bit / int8 group scales, float16 super-block scales."""
    groups, supers = in_features // 32, in_features // 256

    def integers(low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=generator)

    d = (torch.rand(out_features, supers, 2 if fmt == "int4k" else 1, generator=generator) * 0.02).half()
    if fmt == "int4k":
        scales, mins = integers(0, 64, out_features, groups).byte(), integers(0, 64, out_features, groups).byte()
        return QuantizedRows(
            "int4k", integers(0, 16, out_features, in_features).byte(), scales, mins, in_features, 32, d
        )
    scales = integers(-128, 128, out_features, 2 * groups).to(torch.int8)
    return QuantizedRows("int6k", integers(0, 64, out_features, in_features).byte(), scales, None, in_features, 32, d)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_matches_reference_for_every_row_count(fmt: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    out_features, in_features = shape
    weight = pack_weight(torch.randn(out_features, in_features, generator=generator), fmt)  # type: ignore[arg-type]
    bias = torch.randn(out_features, generator=generator)
    for rows in range(1, 18):
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        out = qlinear_native(x, weight, bias)
        expected = qlinear_reference(x.float(), weight, bias)
        assert out.shape == (rows, out_features) and out.dtype == dtype
        # float32: the sums differ only in order and in float32 rounding; bfloat16: plus the output's rounding
        assert relative_error(out, expected) < (5e-5 if dtype == torch.float32 else 1e-2), (fmt, rows)


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("shape", [(100, 256), (130, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_quant_formats_native_matches_their_values(fmt: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """int4k / int6k (GGUF's Q4_K / Q6_K as stored): the kernel against the reference at one row, at every row
    count of a pass (VNNI's take 8 rows, AVX2's 4) and past it, at 64, and the
    reference's weight against the formula the blocks hold (w = d * sc * q - dmin * m; d * sc * (q - 32)).
    From 128 rows int6k decodes each block's codes once (decode_int6k / decode_int6k_pairs)."""
    generator = torch.Generator().manual_seed(sum(shape))
    rows = k_quant_rows(fmt, *shape, generator)
    weight = pack_quantized(rows)
    assert weight.nbytes() < (0.6 if fmt == "int4k" else 0.85) * shape[1] * (-(-shape[0] // 64) * 64)
    d = rows.supers.float().repeat_interleave(8 if fmt == "int4k" else 16, dim=1)  # type: ignore[union-attr]
    if fmt == "int4k":
        scale, minimum = d[..., 0] * rows.scales.float(), d[..., 1] * rows.mins.float()  # type: ignore[union-attr]
        expected_weight = rows.values.float() * scale.repeat_interleave(32, 1) - minimum.repeat_interleave(32, 1)
    else:
        scale = d[..., 0] * rows.scales.float()
        expected_weight = (rows.values.float() - 32) * scale.repeat_interleave(16, 1)
    assert torch.equal(dequantize(weight), expected_weight)
    for count in [*range(1, 18), 64, 130]:  # from 128 rows int6k decodes each block once
        x = torch.randn(count, shape[1], generator=generator).to(dtype)
        out = qlinear_native(x, weight)
        assert relative_error(out, qlinear_reference(x.float(), weight)) < (5e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(matrix_unit() != "amx", reason="AMX: Intel from Sapphire Rapids, with the tile state granted")
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_amx_gives_the_vector_path_bits(fmt: str) -> None:
    """From 8 rows int4k / int6k run their products on AMX tiles: the same int32 sums and the same float epilogue
    as the vpdpbusd path, so the same bits at every row count (one 8-row pass, part of one, several passes over
    a block's weights written once), and a server's replies do not depend on which path a step took."""
    generator = torch.Generator().manual_seed(11)
    weight = pack_quantized(k_quant_rows(fmt, 96, 512, generator))
    try:
        for count in (8, 9, 15, 16, 17, 64, 130):
            x = torch.randn(count, 512, generator=generator) * torch.rand(count, 1, generator=generator) * 10
            for dtype in (torch.float32, torch.bfloat16):
                on_tiles = qlinear_native(x.to(dtype), weight)
                assert matrix_unit(False) is None
                on_vectors = qlinear_native(x.to(dtype), weight)
                assert matrix_unit(True) == "amx"
                assert torch.equal(on_tiles, on_vectors), (count, dtype)
                assert relative_error(on_tiles, qlinear_reference(x.to(dtype).float(), weight)) < (
                    5e-5 if dtype == torch.float32 else 1e-2
                )
    finally:
        matrix_unit(True)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_row_gets_the_same_bits_alone_or_among_many(fmt: str) -> None:
    """x is quantized per row (from 4 rows split across the threads), so a row's result does not depend on
    the rows that came with it: a reply is the same at one user or forty."""
    generator = torch.Generator().manual_seed(7)
    weight = pack_weight(torch.randn(200, 333, generator=generator), fmt)  # type: ignore[arg-type]
    x = torch.randn(40, 333, generator=generator) * torch.rand(40, 1, generator=generator) * 20
    together = qlinear_native(x, weight, threads=2)
    for row in (0, 17, 39):
        assert torch.equal(qlinear_native(x[row : row + 1], weight, threads=2)[0], together[row]), row


@pytest.mark.parametrize("fmt", ["int8", "int4", *K_FORMATS])
@pytest.mark.parametrize("rows", [1, 8])
def test_the_bits_do_not_depend_on_which_thread_takes_which_outputs(fmt: str, rows: int) -> None:
    """Two threads take the output blocks in chunks, whichever is free first (kernels/csrc/qlinear_cpu.cpp), so
    the split differs from call to call; each output is summed by one thread, so a reply's bits are the same as
    one thread's, every time."""
    generator = torch.Generator().manual_seed(11)
    if fmt in K_FORMATS:
        weight = pack_quantized(k_quant_rows(fmt, 1056, 512, generator))
    else:
        weight = pack_weight(torch.randn(1056, 512, generator=generator), fmt)  # type: ignore[arg-type]
    x = torch.randn(rows, 512, generator=generator) * 5
    alone = qlinear_native(x, weight, threads=1)
    for _ in range(20):
        assert torch.equal(qlinear_native(x, weight, threads=2), alone)


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("codes", ["random", "largest"])
def test_a_k_quant_row_gets_the_same_bits_alone_as_among_many_at_the_digits_extremes(fmt: str, codes: str) -> None:
    """On AVX2 one row of int4 / int4k / int6k runs loops of their own (each digit of x times the codes by the byte
    product, summed in int16: one_row_nibble_sums, one_row_int6k_sums in kernels/csrc/qlinear_cpu.cpp), more rows
    widen the codes once for four: the same int32 sums, so the same bits, also where the int16 sums are largest
    (every code 15 or 63, high digits of 127, low digits near +-128), which would saturate a longer sum."""
    generator = torch.Generator().manual_seed(5)
    rows = k_quant_rows(fmt, 96, 512, generator)
    if codes == "largest":
        rows = dataclasses.replace(rows, values=torch.full_like(rows.values, 15 if fmt == "int4k" else 63))
    weight = pack_quantized(rows)
    x = torch.randn(7, 512, generator=generator) * 20
    x[1], x[2] = 50.0, -50.0  # every high digit +-127, every low one 0
    x[3] = torch.arange(512) % 60 + 0.499  # remainders of just under half a step: low digits of 128, carried ...
    x[4] = -(torch.arange(512) % 60 + 0.498)  # ... and of -127 or -128
    x[3, ::32], x[4, ::32] = 127.0, -127.0  # each block's maximum: a scale of 1
    together = qlinear_native(x, weight, threads=2)
    for row in range(x.shape[0]):
        assert torch.equal(qlinear_native(x[row : row + 1], weight, threads=2)[0], together[row]), row
    dense = dequantize(weight).double()
    error = (together.double() - x.double() @ dense.T).abs()
    assert (error <= dense.abs().sum(-1) * x.abs().amax() / 127 / 256).all()  # x's 16 bits, summed


@pytest.mark.parametrize("fmt", FORMATS)
def test_leading_dimensions_and_strided_input(fmt: str) -> None:
    linear = PackedLinear(torch.randn(70, 64), fmt)  # type: ignore[arg-type]
    x = torch.randn(2, 3, 128)[..., ::2]  # not contiguous
    out = linear(x)
    assert out.shape == (2, 3, 70)
    expected = qlinear_reference(x.reshape(6, 64), linear.weight).view(2, 3, 70)
    assert relative_error(out, expected) < 5e-5


def test_int8_is_within_half_a_step_per_channel() -> None:
    weight = torch.randn(50, 200) * torch.linspace(0.01, 10, 50)[:, None]  # rows of very different scale
    restored = dequantize(pack_weight(weight, "int8"))
    step = weight.abs().amax(1, keepdim=True) / 127
    assert ((restored - weight).abs() <= step * 0.5 + 1e-3 * step).all()


def test_int4_is_within_half_a_step_per_group() -> None:
    weight = torch.randn(64, 96)
    restored = dequantize(pack_weight(weight, "int4"))
    groups = weight.view(64, 3, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    # the scale and minimum are stored as float16: a little over half a step
    assert ((restored - weight).abs() <= step * 0.51 + 1e-3).all()


def test_gguf_q4_1_and_q8_0_values_come_back_unchanged() -> None:
    """Weights dequantized from GGUF Q4_1 / Q8_0 blocks re-quantize to the same values (SmolLM2's GGUF)."""
    generator = torch.Generator().manual_seed(1)
    scale = (torch.rand(64, 4, 1, generator=generator) * 0.01 + 0.001).half().float()
    minimum = (-torch.rand(64, 4, 1, generator=generator) * 0.1).half().float()
    q = torch.randint(0, 16, (64, 4, 32), generator=generator).float()
    q[..., 0], q[..., 1] = 0, 15  # each block uses its whole range, as GGUF's quantizer makes it
    q4_1 = (q * scale + minimum).view(64, 128)
    assert torch.allclose(dequantize(pack_weight(q4_1, "int4")), q4_1, rtol=0, atol=1e-6)
    q8 = torch.randint(-127, 128, (64, 4, 32), generator=generator).float()
    q8[..., 0] = 127
    q8_0 = (q8 * scale).view(64, 128)
    assert torch.allclose(dequantize(pack_weight(q8_0, "int8", group=32)), q8_0, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_k_quant_embedding_rows_are_the_dequantized_rows(fmt: str) -> None:
    weight = pack_quantized(k_quant_rows(fmt, 100, 512, torch.Generator().manual_seed(5)))
    ids = torch.tensor([0, 99, 17, 17, 64])
    assert torch.equal(embedding_rows(weight, ids), dequantize(weight)[ids])


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_rows_are_the_dequantized_rows(fmt: str) -> None:
    for group in (None, 32):  # per channel (bf16: the whole row), and per 32 as the tied int4/int8 heads
        weight = pack_weight(torch.randn(300, 72), fmt, group)  # type: ignore[arg-type]
        ids = torch.tensor([[0, 299], [17, 17]])
        assert torch.equal(embedding_rows(weight, ids), dequantize(weight)[ids.reshape(-1)])


def test_embedding_rows_outside_the_vocabulary_are_refused() -> None:
    weight = pack_weight(torch.randn(300, 72), "int8", 32)
    for ids in (torch.tensor([0, 300]), torch.tensor([-1])):
        with pytest.raises(IndexError):
            embedding_rows(weight, ids)
    assert embedding_rows(weight, torch.tensor([], dtype=torch.long)).shape == (0, 72)


def test_activation_quantization_keeps_16_bits_and_zero_rows_zero() -> None:
    x = torch.randn(3, 40) * torch.tensor([[1e-3], [1.0], [1e3]])
    step = x.abs().amax(-1, keepdim=True) / 127 / 256  # per row here: each row's blocks share a scale or less
    assert ((quantize_activations(x) - x).abs() <= step * 0.51).all()
    x = torch.zeros(2, 40)
    x[1, 5] = 3.0
    quantized = quantize_activations(x)
    assert torch.equal(quantized, x)  # a block's maximum is exact; zero blocks stay zero, no NaN
    weight = pack_weight(torch.randn(16, 40), "int4")
    assert torch.isfinite(qlinear_native(x, weight)).all()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_remainder_of_nearly_half_a_step_keeps_16_bits_in_the_kernels(fmt: str) -> None:
    """x just under a whole step plus a half leaves a low digit of 128, past int8: it carries into the high digit
    (x ~ s * (high + 1 - 128 / 256)), where clamping it to 127 would be off by 3/4 of a low step on every such input."""
    in_features = 256
    x = torch.arange(in_features, dtype=torch.float32) % 60 + 0.499  # a scale of 1: each remainder is 0.499
    x[::32] = 127.0  # each block's maximum
    weight = pack_weight(torch.rand(16, in_features, generator=torch.Generator().manual_seed(1)) + 0.5, fmt)
    dense = dequantize(weight).double()
    expected = x.double() @ dense.T
    allowed = dense.abs().sum(-1) * (0.5 / 256) * 1.01 + expected.abs() * 1e-6
    for rows in (1, 8):
        got = qlinear_native(x.expand(rows, in_features).contiguous(), weight, threads=2).double()
        assert ((got - expected).abs() <= allowed).all(), rows


def test_weights_placed_together_hold_the_same_values_in_one_buffer() -> None:
    """The model's packed weights are copied into one buffer, in the order given (a decode step's): the copies
    hold the same values and compute the same bits as the originals."""
    weights = [pack_weight(torch.randn(*shape), fmt) for shape, fmt in zip(SHAPES, FORMATS)]  # type: ignore[arg-type]
    placed = place_together(weights)
    starts = []
    for original, copy in zip(weights, placed, strict=True):
        for name in ("packed", "scales", "mins"):
            before, after = getattr(original, name), getattr(copy, name)
            assert (before is None) == (after is None)
            if after is not None:
                assert torch.equal(before, after) and after.data_ptr() % 64 == 0
                starts.append(after.data_ptr())
        x = torch.randn(5, original.in_features)
        assert torch.equal(qlinear_native(x, copy), qlinear_native(x, original))
    assert starts == sorted(starts)
    tensors = [t for weight in placed for t in (weight.packed, weight.scales, weight.mins) if t is not None]
    assert len({tensor.untyped_storage().data_ptr() for tensor in tensors}) == 1


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("chunks", [[64, 64], [100], [30, 20, 17], [128, 3, 61, 200], [5]])
def test_rows_packed_chunk_by_chunk_are_the_rows_packed_whole(fmt: str, chunks: list[int]) -> None:
    """A GGUF tensor is packed as its rows are read (engine/models/weights.py): the same bytes as packing them all
    at once, whether the chunks end on a 64-row tile or not."""
    parts = [quantize_rows(torch.randn(rows, 96), fmt, 32) for rows in chunks]  # type: ignore[arg-type]
    whole = pack_quantized(concat_quantized_rows(parts))
    chunked = pack_quantized_chunks(iter(parts), sum(chunks))
    assert (chunked.format, chunked.out_features, chunked.in_features) == (fmt, sum(chunks), 96)
    for name in ("packed", "scales", "mins"):
        expected, got = getattr(whole, name), getattr(chunked, name)
        assert (expected is None) == (got is None) and (got is None or torch.equal(expected, got)), name


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_k_quant_rows_packed_chunk_by_chunk_are_the_rows_packed_whole(fmt: str) -> None:
    generator = torch.Generator().manual_seed(7)
    parts = [k_quant_rows(fmt, rows, 256, generator) for rows in (30, 20, 17, 100)]
    whole = pack_quantized(concat_quantized_rows(parts))
    chunked = pack_quantized_chunks(iter(parts), 167)
    assert torch.equal(whole.packed, chunked.packed) and torch.equal(whole.scales, chunked.scales)  # type: ignore[arg-type]


def test_weights_resident_int4_is_under_40_percent_of_bf16() -> None:
    weight = torch.randn(1536, 576)
    bf16_bytes = weight.numel() * 2
    assert pack_weight(weight, "int4").nbytes() <= 0.4 * bf16_bytes
    assert pack_weight(weight, "int8").nbytes() <= 0.55 * bf16_bytes


def _portable_kernel(tmp_path: Path, march: str) -> ctypes.CDLL:
    flags = [flag if flag != "-march=native" else f"-march={march}" for flag in cpu_native.FLAGS["qlinear_cpu"]]
    compiler = cpu_native._compiler()
    assert compiler is not None
    library_path = tmp_path / f"qlinear-{march}.so"
    cpu_native._build(compiler, cpu_native.CSRC / "qlinear_cpu.cpp", flags, library_path)
    return ctypes.CDLL(str(library_path))


def _run(library: ctypes.CDLL, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    function = library.tokenmill_qlinear_f32
    function.restype = None
    function.argtypes = (
        [ctypes.c_void_p, ctypes.c_void_p]
        + [ctypes.c_int64] * 3
        + [ctypes.c_int]
        + [ctypes.c_void_p] * 3
        + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    )
    out = torch.empty(x.shape[0], weight.out_features)
    function(
        x.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        weight.in_features,
        weight.out_features,
        FORMAT_CODES[weight.format],
        weight.packed.data_ptr(),
        None if weight.scales is None else weight.scales.data_ptr(),
        None if weight.mins is None else weight.mins.data_ptr(),
        weight.group,
        None,
        1,
    )
    return out


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "x86-64-v4"])
def test_portable_builds_agree_with_this_cpus_build(tmp_path: Path, march: str) -> None:
    """The fallbacks compute what this CPU's build computes: plain x86-64 (a scalar loop), AVX2 (vpmaddwd on
    weights widened to int16) and AVX-512 without VNNI (the prebuilt x86-64-v4 library: AVX2's sums, AVX-512's
    floats), at one row (AVX2's own loops), at four, at five and nine (past a pass of four or of eight rows: their
    tails), and at 130, where int6k decodes each block once."""
    if march not in cpu_native.supported_targets() and march != "x86-64":
        pytest.skip(f"this CPU can't run {march} code")
    library = _portable_kernel(tmp_path, march)
    generator = torch.Generator().manual_seed(3)
    weights = [pack_weight(torch.randn(130, 161, generator=generator), fmt) for fmt in FORMATS]  # type: ignore[arg-type]
    weights += [pack_quantized(k_quant_rows(fmt, 130, 512, generator)) for fmt in K_FORMATS]
    for fmt, largest in (("int4k", 15), ("int6k", 63)):  # the largest int16 sums of AVX2's one-row loops
        codes = k_quant_rows(fmt, 64, 512, generator)
        weights.append(pack_quantized(dataclasses.replace(codes, values=torch.full_like(codes.values, largest))))
    for weight in weights:
        fmt = weight.format
        for rows in (1, 4, 5, 9, 130):
            x = torch.randn(rows, weight.in_features, generator=generator)
            error = relative_error(_run(library, x, weight), qlinear_native(x, weight, threads=1))
            assert error < 1e-5, (fmt, rows)


def test_a_linear_with_a_tail_weight_outputs_both_parts_side_by_side() -> None:
    """A fused linear whose parts keep different formats (Q4_K_M's q/k int4k, v int6k): the outputs of `weight`
    then of `tail`, each with its share of the bias, at one row and at many."""
    generator = torch.Generator().manual_seed(11)
    head, tail = (
        pack_quantized(k_quant_rows("int4k", 96, 256, generator)),
        pack_quantized(k_quant_rows("int6k", 32, 256, generator)),
    )
    bias = torch.randn(128, generator=generator)
    linear = PackedLinear(head, bias=bias, tail=tail)
    assert (linear.out_features, linear.in_features) == (128, 256)
    assert linear.nbytes() == head.nbytes() + tail.nbytes()
    for rows in (1, 9):
        x = torch.randn(rows, 256, generator=generator)
        expected = torch.cat((qlinear_native(x, head, bias[:96]), qlinear_native(x, tail, bias[96:])), dim=-1)
        assert torch.equal(linear(x), expected)
    with pytest.raises(ValueError, match="same inputs"):
        PackedLinear(head, tail=pack_quantized(k_quant_rows("int6k", 32, 512, generator)))
