"""The native LoRA kernel (kernels/csrc/lora_cpu.cpp) adds each segment's low-rank delta as torch computes it,
into the right output columns, and leaves every row outside the segments (the base model's) bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels import lora as native
from kernels.lora import AdapterTable, LoraStep, Piece

pytestmark = pytest.mark.skipif(
    not native.available(torch.float32), reason="no C++ compiler: the native kernels can't be built here"
)
OUTS = (40, 24, 24)  # a fused qkv: q, k, v


def fused(
    rank: int, in_features: int, dtype: torch.dtype, modules: tuple[int, ...]
) -> tuple[torch.Tensor, list[Piece]]:
    """A qkv linear's matrices for the modules (0 q, 1 k, 2 v) an adapter targets."""
    pieces: list[Piece] = []
    column = 0
    for module, out in enumerate(OUTS):
        if module in modules:
            start = len(pieces) * rank
            pieces.append((start, start + rank, column, column + out, torch.randn(rank, out).to(dtype)))
        column += out
    return torch.randn(len(pieces) * rank, in_features).to(dtype), pieces


def expected(x: torch.Tensor, out: torch.Tensor, segments, linear: int, sources) -> torch.Tensor:
    result = out.float().clone()
    for start, end, table in segments:
        entry = sources[id(table)][linear]
        if entry is None:
            continue
        a, pieces = entry
        shrunk = x[start:end].float() @ a.float().t()
        if x.dtype == torch.bfloat16:
            shrunk = shrunk.to(torch.bfloat16).float()
        for rank_start, rank_end, col_start, col_end, b_t in pieces:
            result[start:end, col_start:col_end] += shrunk[:, rank_start:rank_end] @ b_t.float()
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [96, 67])
def test_segments_get_their_adapter_and_base_rows_nothing(dtype, in_features):
    torch.manual_seed(0)
    first = [fused(4, in_features, dtype, (0, 2)), None]  # q and v; the second linear untouched
    second = [fused(8, in_features, dtype, (0, 1, 2)), fused(8, in_features, dtype, (1,))]
    tables = [AdapterTable(first, dtype), AdapterTable(second, dtype)]
    sources = {id(tables[0]): first, id(tables[1]): second}
    rows = 13
    # rows 0, 9 and 12 run the base; 1-3 and 10-11 the first adapter, 4-8 (five: a pass of four, then one) the second
    segments = [(1, 4, tables[0]), (4, 9, tables[1]), (10, 12, tables[0])]
    x = torch.randn(rows, in_features).to(dtype)
    for linear in (0, 1):
        out = torch.randn(rows, sum(OUTS)).to(dtype)
        before = out.clone()
        LoraStep(segments).add(linear, x, out)
        for base_row in (0, 9, 12):
            assert torch.equal(out[base_row], before[base_row])
        tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(out.float(), expected(x, before, segments, linear, sources), **tolerance)
        assert torch.equal(out[10:12], before[10:12]) == (linear == 1)  # the first adapter skips linear 1


def test_rows_at_a_stride_and_many_rows():
    """A prefill's rows, read from a wider buffer (as a view of a fused output): hundreds of rows, threads on."""
    torch.manual_seed(1)
    linears = [fused(16, 576, torch.float32, (0, 1, 2))]
    table = AdapterTable(linears, torch.float32)
    wide = torch.randn(300, 700)
    x = wide[:, :576]
    out = torch.zeros(300, sum(OUTS))
    segments = [(0, 130, table), (170, 300, table)]
    LoraStep(segments).add(0, x, out)
    reference = expected(x, torch.zeros_like(out), segments, 0, {id(table): linears})
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    assert torch.equal(out[130:170], torch.zeros(40, sum(OUTS)))


def test_a_table_refuses_matrices_it_cannot_read():
    a, pieces = fused(4, 32, torch.float32, (0,))
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        AdapterTable([(a.t(), pieces)], torch.float32)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        AdapterTable([(a, pieces)], torch.bfloat16)
