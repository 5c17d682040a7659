"""Turns one step's logits into one token per sequence: bias, penalties, temperature, top-k/p, min-p."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernels
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """One row of the batch: what the sampler needs to know about its sequence."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None = None  # the sequence's own seed (params.seed, plus its index for n > 1)
    eos_token_id: int | None = None  # None when ignore_eos
    allowed_tokens: torch.Tensor | None = None  # bool [<= vocab]: a guide's constraint on the next token


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # Per row, with drafts: whether the row's draft was accepted (its token is then the draft itself).
    accepted: list[bool] | None = None


_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that a seeded sequence draws its `position`th output token with. A function of
    (seed, position) rather than a generator's next value, so a step that samples several positions at once
    (drafts being verified) draws exactly what one token per step would, and preemption changes nothing.
    24 bits: exactly a float32, which must stay below 1.0 (a rounded 53-bit value could reach it)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) + position) >> 40) * 2.0**-24


class Sampler:
    def __call__(
        self, logits: torch.Tensor, states: list[SamplingState], drafts: list[int | None] | None = None
    ) -> SamplerOutput:
        """One token per row. With `drafts` (speculative decoding), `accepted` says per row whether the row's
        draft is the token it drew. Rows are sampled exactly as without drafts: for a draft of one token (a
        point mass) that is rejection sampling's own rule, the draft d is kept with probability p(d) and the
        token is distributed as p either way (Leviathan et al. 2023). And as a seeded row's uniform is keyed
        by its position (keyed_uniform), a seeded reply is the same whether or not its steps were drafted."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sampling states")
        if drafts is not None and len(drafts) != len(states):
            raise ValueError(f"{len(drafts)} drafts for {len(states)} sampling states")
        raw_logits = logits.float()
        logits = apply_logit_processors(raw_logits, states)

        greedy_rows = [row for row, state in enumerate(states) if state.params.greedy]
        random_rows = [row for row, state in enumerate(states) if not state.params.greedy]
        token_ids = torch.empty(len(states), dtype=torch.long)
        if greedy_rows:
            greedy_logits = _rows(logits, greedy_rows)
            argmax = kernels.greedy_tokens if kernels.native_sampling_available(greedy_logits) else blocked_argmax
            token_ids = _placed(token_ids, greedy_rows, argmax(greedy_logits))
        if random_rows:
            sampled = sample_random_rows(_rows(logits, random_rows), [states[r] for r in random_rows])
            token_ids = _placed(token_ids, random_rows, sampled)
        chosen = token_ids.tolist()
        accepted = None if drafts is None else [token == draft for token, draft in zip(chosen, drafts)]
        return SamplerOutput(chosen, token_logprobs(raw_logits, states, chosen), accepted)


def _rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return tensor if len(rows) == tensor.shape[0] else tensor[rows]


def _placed(tensor: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """`tensor` with `values` at `rows`; `values` itself when the rows are all of them (no scatter)."""
    if len(rows) == tensor.shape[0]:
        return values
    tensor[rows] = values
    return tensor


def apply_logit_processors(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """logit_bias, min_tokens, repetition, presence and frequency penalties; returns a new tensor
    only when some row asked for one of them, so plain rows pay nothing."""
    vocab = logits.shape[1]
    bias = [
        (row, token, value)
        for row, state in enumerate(states)
        for token, value in state.params.logit_bias.items()
        if 0 <= token < vocab
    ]
    banned = [
        (row, token)
        for row, state in enumerate(states)
        if len(state.output_token_ids) < state.params.min_tokens
        for token in (state.eos_token_id, *state.params.stop_token_ids)
        if token is not None and 0 <= token < vocab
    ]
    repetition_rows = [row for row, state in enumerate(states) if state.params.repetition_penalty != 1.0]
    frequency_rows = [
        row
        for row, state in enumerate(states)
        if state.params.presence_penalty != 0.0 or state.params.frequency_penalty != 0.0
    ]
    guided_rows = [row for row, state in enumerate(states) if state.allowed_tokens is not None]
    if not (bias or banned or repetition_rows or frequency_rows or guided_rows):
        return logits

    logits = logits.clone()
    if bias:
        rows, tokens, values = zip(*bias)
        logits.index_put_((torch.tensor(rows), torch.tensor(tokens)), torch.tensor(values), accumulate=True)
    if banned:
        rows, tokens = zip(*banned)
        logits[torch.tensor(rows), torch.tensor(tokens)] = float("-inf")
    # Penalties touch only the tokens a sequence has seen: gather, adjust, scatter back.
    if repetition_rows:
        rows, tokens = _seen_tokens(
            repetition_rows, [states[r].prompt_token_ids + states[r].output_token_ids for r in repetition_rows]
        )
        penalty = torch.tensor([states[r].params.repetition_penalty for r in range(len(states))])[rows]
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)
    if frequency_rows:
        rows, tokens, counts = _seen_tokens(
            frequency_rows, [states[r].output_token_ids for r in frequency_rows], with_counts=True
        )
        presence = torch.tensor([states[r].params.presence_penalty for r in range(len(states))])[rows]
        frequency = torch.tensor([states[r].params.frequency_penalty for r in range(len(states))])[rows]
        logits[rows, tokens] -= frequency * counts + presence
    # Last, so that no bias or penalty can lift a token the guide forbids.
    for row in guided_rows:
        allowed = states[row].allowed_tokens[:vocab]
        logits[row, : allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
        logits[row, allowed.shape[0] :] = float("-inf")
    return logits


def _seen_tokens(rows: list[int], token_lists: list[list[int]], with_counts: bool = False):
    """(row, token[, count]) index tensors, one entry per distinct token of each row's list."""
    row_parts, token_parts, count_parts = [], [], []
    for row, token_ids in zip(rows, token_lists):
        tokens, counts = torch.tensor(token_ids, dtype=torch.long).unique(return_counts=True)
        row_parts.append(torch.full_like(tokens, row))
        token_parts.append(tokens)
        count_parts.append(counts)
    found = (torch.cat(row_parts), torch.cat(token_parts))
    return (*found, torch.cat(count_parts).float()) if with_counts else found


# Candidates searched for the nucleus first; flat rows retry with 16x more, then the whole vocabulary
# (a full sort of 49k logits costs ~50x a top-64).
TOP_P_CANDIDATES = 64
LOG2_E = math.log2(math.e)


def sample_random_rows(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    if kernels.native_sampling_available(logits):
        # One native call for the whole truncate-and-draw: ~20 us a row, where the torch ops below take
        # 0.5-1 ms (several ms on flat rows, which fall back to a full sort).
        params = [state.params for state in states]
        return kernels.sample_tokens(
            logits,
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            _uniforms(states),
        )
    return inverse_cdf_sample(target_weights(logits, states), _uniforms(states))


def _uniforms(states: list[SamplingState]) -> torch.Tensor:
    """One uniform in [0, 1) per row: a seeded row's is keyed by its seed and output position, so its token
    depends on nothing else in the batch; the rest come from torch's global generator."""
    if all(state.seed is None for state in states):
        return torch.rand(len(states))
    uniform = torch.rand(len(states))
    for i, state in enumerate(states):
        if state.seed is not None:
            uniform[i] = keyed_uniform(state.seed, len(state.output_token_ids))
    return uniform


def target_weights(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Unnormalised probabilities to sample from: temperature, top-k, top-p and min-p applied."""
    inverse_temperature = 1.0 / torch.tensor([state.params.temperature for state in states]).unsqueeze(1)
    # (logits - max) / T in one pass into one fresh tensor; every later step works in place, as
    # each extra 12 MB allocation costs about as much as the op itself.
    maxima = logits.amax(dim=-1, keepdim=True)
    logits = torch.addcmul(-maxima * inverse_temperature, logits, inverse_temperature)
    truncated = [
        i
        for i, state in enumerate(states)
        if state.params.top_k > 0 or state.params.top_p < 1.0 or state.params.min_p > 0.0
    ]
    if truncated:
        selected = _rows(logits, truncated)
        threshold = truncation_thresholds(
            selected,
            [states[i].params.top_k for i in truncated],
            [states[i].params.top_p for i in truncated],
            [states[i].params.min_p for i in truncated],
        )
        # Keep each row's logits >= its threshold. threshold_ keeps x > t, so t is the float32 just below:
        # a row at a time it is ~10x faster than masked_fill with a vocabulary-wide mask (~100 us a row).
        below = torch.nextafter(threshold, torch.tensor(float("-inf"))).squeeze(1).tolist()
        for row, limit in zip(truncated, below):
            torch.threshold_(logits[row], limit, float("-inf"))
    # exp2 rather than exp: torch's CPU exp is ~100x slower on very negative inputs (low
    # temperatures), exp2 only in its narrow denormal band, and exp2(-inf) stays exactly 0.
    return logits.mul_(LOG2_E).exp2_()


def truncation_thresholds(
    logits: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    top_p_candidates: int = TOP_P_CANDIDATES,
) -> torch.Tensor:
    """Per row, the smallest logit that top_k, top_p and min_p all keep ([rows, 1]); ties at the
    edge are kept."""
    vocab = logits.shape[1]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k]).unsqueeze(1)
    p = torch.tensor(top_p).unsqueeze(1)
    has_top_k, has_top_p = k < vocab, p < 1.0
    # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); log(0) = -inf keeps everything.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.tensor(min_p).log().unsqueeze(1)
    if not (has_top_k.any() or has_top_p.any()):
        return threshold

    needed = [
        row_k if 0 < row_k < vocab else top_p_candidates if row_p < 1.0 else 1 for row_k, row_p in zip(top_k, top_p)
    ]
    candidates = min(vocab, max(needed))
    sorted_logits = logits.topk(candidates, dim=-1).values
    kth_logit = sorted_logits.gather(1, k.clamp(max=candidates) - 1)
    threshold = torch.where(has_top_k, torch.maximum(threshold, kth_logit), threshold)
    if not has_top_p.any():
        return threshold

    in_top_k = torch.arange(candidates).unsqueeze(0) < k
    whole_row_normaliser = _logsumexp(logits) if (has_top_p & ~has_top_k).any() else 0.0
    normaliser = torch.where(
        has_top_k,
        sorted_logits.masked_fill(~in_top_k, float("-inf")).logsumexp(dim=-1, keepdim=True),
        whole_row_normaliser,
    )
    probs = (sorted_logits - normaliser).exp().masked_fill(~in_top_k, 0.0)
    # The nucleus: every token whose preceding mass is still below top_p (always at least one).
    kept = ((probs.cumsum(dim=-1) - probs) < p).sum(dim=-1, keepdim=True).clamp(max=k)
    nucleus_edge = sorted_logits.gather(1, kept - 1)
    threshold = torch.where(has_top_p, torch.maximum(threshold, nucleus_edge), threshold)

    if candidates < vocab:
        beyond = (has_top_p & ~has_top_k & (kept == candidates)).squeeze(1).nonzero().squeeze(1).tolist()
        if beyond:
            threshold[beyond] = truncation_thresholds(
                logits[beyond],
                [0] * len(beyond),
                [top_p[i] for i in beyond],
                [min_p[i] for i in beyond],
                top_p_candidates=min(vocab, top_p_candidates * 16),
            )
    return threshold


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    # torch.logsumexp meets the same slow exp; terms below e^-87 relative change nothing.
    largest = logits.amax(dim=-1, keepdim=True)
    return largest + (logits - largest).clamp_(min=-87.0).exp_().sum(dim=-1, keepdim=True).log_()


def inverse_cdf_sample(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the token where the row's cumulative weights (unnormalised probabilities) reach the row's
    uniform draw (in [0, 1)) of their total."""
    rows, vocab = weights.shape
    size = _block_size(vocab) or vocab
    # Two levels, because a cumsum over the whole vocabulary does not vectorise: pick a block by
    # the running sum of block sums, then a token by the running sum inside that block.
    blocks = weights.reshape(rows, vocab // size, size)
    block_cdf = blocks.sum(dim=-1).cumsum_(dim=-1)
    # (1 - u) lies in (0, 1], so the target is in (0, total]: the first entry reaching it always
    # belongs to a block (and then a token) of non-zero weight.
    target = (1.0 - uniform).unsqueeze(1) * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner_cdf = blocks[torch.arange(rows), block.squeeze(1)].cumsum(dim=-1)
    # Rescaled to the block's own cumsum, whose total may differ from its sum in the last bits.
    share = (target - before) / (block_cdf.gather(1, block) - before)
    inner_target = (share * inner_cdf[:, -1:]).clamp_(min=torch.finfo(weights.dtype).tiny)
    return (block * size + torch.searchsorted(inner_cdf, inner_target)).squeeze(1)


def _block_size(vocab: int) -> int | None:
    return next((size for size in (256, 128, 64) if vocab % size == 0 and vocab > size), None)


def blocked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Exactly torch.argmax (the first index of the maximum), ~10x faster on CPU, where argmax does
    not vectorise but amax does: find the first block holding the maximum, then argmax inside it."""
    rows, vocab = logits.shape
    size = _block_size(vocab)
    if size is None:
        return logits.argmax(dim=-1)
    blocks = logits.reshape(rows, vocab // size, size)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)
    return best_block * size + blocks[torch.arange(rows), best_block].argmax(dim=-1)


def token_logprobs(
    raw_logits: torch.Tensor, states: list[SamplingState], chosen: list[int]
) -> list[TokenLogprob | None]:
    """Logprobs of the distribution the model gave, before penalties and temperature (as vLLM does)."""
    result: list[TokenLogprob | None] = [None] * len(states)
    rows = [row for row, state in enumerate(states) if state.params.logprobs is not None]
    if not rows:
        return result
    logprobs = _rows(raw_logits, rows).log_softmax(dim=-1)
    chosen_logprobs = logprobs.gather(1, torch.tensor([chosen[row] for row in rows]).unsqueeze(1)).squeeze(1)
    most = max(states[row].params.logprobs for row in rows)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids, chosen_logprobs = top_values.tolist(), top_ids.tolist(), chosen_logprobs.tolist()
    for i, row in enumerate(rows):
        k = states[row].params.logprobs
        result[row] = TokenLogprob(
            token_id=chosen[row], logprob=chosen_logprobs[i], top=list(zip(top_ids[i][:k], top_values[i][:k]))
        )
    return result
