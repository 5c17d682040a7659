"""The native sampler (kernels/csrc/sample_cpu.cpp) against the plain torch reference: same kept tokens, same
distribution, same token for the same uniform, on awkward vocabularies, ties at the edges and flat rows."""

from __future__ import annotations

import pytest
import torch

from kernels.sampling import argmax_native, sample_available, sample_native, sample_reference

pytestmark = pytest.mark.skipif(
    not sample_available(torch.zeros(1, 2)), reason="the native CPU kernels can't be built here"
)

# (temperature, top_k, top_p, min_p): each cut alone, together, and none.
SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (0.7, 40, 1.0, 0.0),
    (1.3, 40, 0.95, 0.0),
    (0.5, 0, 1.0, 0.05),
    (1.0, 7, 0.5, 0.2),
    (2.0, 0, 0.999, 0.0),
    (0.05, 0, 0.3, 0.0),
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 1e-6, 0.0),
    (1.0, 100000, 0.9, 0.0),  # k beyond the vocabulary keeps everything
]


def check_against_reference(logits: torch.Tensor, settings: list[tuple[float, int, float, float]], seed: int = 0):
    temperature, top_k, top_p, min_p = (list(column) for column in zip(*settings))
    uniform = torch.rand(len(settings), generator=torch.Generator().manual_seed(seed))
    tokens, distribution = sample_native(logits, temperature, top_k, top_p, min_p, uniform, with_probabilities=True)
    expected_tokens, expected_distribution = sample_reference(logits, temperature, top_k, top_p, min_p, uniform)
    assert distribution is not None
    # The kept sets agree, but for a few tokens at a nucleus edge that float rounding of a long running sum
    # puts on the other side (p = 0.999), and for tokens below e^-87 of the best, which weigh 0 natively.
    differ = (distribution > 1e-30) != (expected_distribution > 1e-30)
    assert (differ.sum(dim=-1) <= 3).all(), f"kept sets differ by {differ.sum(dim=-1).tolist()} tokens"
    assert (torch.maximum(distribution, expected_distribution)[differ] < 1e-3).all()
    torch.testing.assert_close(distribution[~differ], expected_distribution[~differ], atol=2e-6, rtol=2e-4)
    # The same uniform draws the same token unless 1 - u sits within rounding of a cumulative boundary.
    cumulative = expected_distribution.cumsum(dim=-1)
    for row, (got, wanted) in enumerate(zip(tokens.tolist(), expected_tokens.tolist())):
        if got != wanted:
            boundary = cumulative[row, min(got, wanted)].item()
            assert abs(boundary - (1.0 - uniform[row].item())) < 1e-4, (row, settings[row], got, wanted)
        assert distribution[row, got] > 0


@pytest.mark.parametrize("vocab", [1, 5, 17, 1000, 5003, 49152])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_native_sampler_matches_the_reference(vocab, scale):
    logits = torch.randn(len(SETTINGS), vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    check_against_reference(logits, SETTINGS, seed=int(scale * 10))


def test_ties_at_every_edge_are_kept():
    # Four equal best tokens, then eight equal, then the rest: top-k 2, a nucleus ending inside the first
    # group and a min-p at the second group's value all keep every tie.
    row = torch.full((64,), -5.0)
    row[[3, 9, 20, 41]] = 2.0
    row[[0, 1, 2, 50, 51, 52, 53, 63]] = 1.0
    logits = row.expand(4, 64)
    settings = [(1.0, 2, 1.0, 0.0), (1.0, 0, 0.3, 0.0), (1.0, 6, 0.99, 0.0), (1.0, 0, 1.0, float(torch.e**-1))]
    check_against_reference(logits, settings)
    _, distribution = sample_native(logits, *(list(c) for c in zip(*settings)), torch.zeros(4), True)
    assert distribution is not None
    assert (distribution > 0).sum(dim=-1).tolist() == [4, 4, 12, 12]


def test_forbidden_tokens_are_never_drawn_and_draws_follow_the_distribution():
    vocab = 3000
    row = torch.full((vocab,), float("-inf"))
    allowed = [5, 700, 1500, 2999]
    row[allowed] = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    draws = 20000
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(1))
    tokens, _ = sample_native(
        row.expand(draws, vocab), [1.0] * draws, [0] * draws, [1.0] * draws, [0.0] * draws, uniform
    )
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts.sum() == counts[allowed].sum()
    assert torch.allclose(counts[allowed].float() / draws, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.015)


def test_a_flat_row_keeps_the_whole_nucleus():
    # Every token equal: no candidate level holds 90% of the mass but the whole vocabulary, which is sorted.
    logits = torch.zeros(2, 49152)
    settings = [(1.0, 0, 0.9, 0.0), (1.0, 30000, 0.5, 0.0)]
    check_against_reference(logits, settings)


def test_broadcast_and_strided_rows_read_the_right_logits():
    base = torch.randn(3, 2000, generator=torch.Generator().manual_seed(3)) * 4
    strided = torch.randn(3, 4000, generator=torch.Generator().manual_seed(4))[:, ::2]
    for logits in (base[1:2].expand(3, 2000), strided, base[:, :1000]):
        check_against_reference(logits, [(0.8, 0, 0.9, 0.0), (1.0, 20, 1.0, 0.0), (1.5, 0, 1.0, 0.1)])


@pytest.mark.parametrize("vocab", [1, 3, 16, 17, 1000, 49152])
def test_native_argmax_is_torch_argmax_including_ties(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    logits[1] = 0.5  # all tied: the first index
    logits[2, vocab // 2 :] = 9.0  # a tie in the second half: its first index
    logits[3, -1] = 50.0  # the last one
    logits[4] = float("-inf")
    logits[4, vocab // 3] = -1e30
    for rows in (logits, logits[:, : max(1, vocab - 1)], logits[2:3].expand(4, vocab)):
        assert torch.equal(argmax_native(rows), rows.argmax(dim=-1))
