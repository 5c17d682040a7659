"""CUDA-graph replay of pure-decode steps: one graph per batch size, captured once at start.

A decode step is hundreds of small kernel launches; replaying a captured graph issues them at once.
A graph reads fixed input buffers, so a batch is padded up to the next captured size. Padding rows read
and write only the dummy block: one KV block beyond the pool the block manager hands out, so it never
belongs to a request. Mixed prefill/decode steps, and batches larger than every graph, run eagerly.
The bucketing and padding are plain functions. On the CPU there is nothing to capture: a "replay" runs
the same forward pass over the same padded buffers, which lets tests check the padding end to end.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.models.llama import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself: padding wastes less than half a batch."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def padded_size(rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `rows`, or None (too large: run eagerly)."""
    return next((size for size in sizes if size >= rows), None)


@dataclass
class DecodeInputs:
    """One token per sequence: what a decode forward pass reads."""

    token_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    block_tables: torch.Tensor  # [rows, width] int32
    context_lens: torch.Tensor  # [rows] int32


def pad_decode_inputs(inputs: DecodeInputs, size: int, width: int, dummy_block: int, block_size: int) -> DecodeInputs:
    """`size` rows and `width` table columns. A padding row is a one-token sequence at position 0 that lives
    in the dummy block: it stores its key there and attends to that key alone. Unused table columns point
    at the dummy block too, though no row reads past its context length."""
    rows = inputs.token_ids.shape[0]
    extra = size - rows
    if extra < 0 or inputs.block_tables.shape[1] > width:
        raise ValueError(f"{rows} rows x {inputs.block_tables.shape[1]} blocks do not fit {size} x {width}")
    tables = torch.full((size, width), dummy_block, dtype=torch.int32)
    tables[:rows, : inputs.block_tables.shape[1]] = inputs.block_tables
    return DecodeInputs(
        token_ids=torch.cat((inputs.token_ids, torch.zeros(extra, dtype=torch.long))),
        positions=torch.cat((inputs.positions, torch.zeros(extra, dtype=torch.long))),
        slot_mapping=torch.cat((inputs.slot_mapping, torch.full((extra,), dummy_block * block_size, dtype=torch.long))),
        block_tables=tables,
        context_lens=torch.cat((inputs.context_lens, torch.ones(extra, dtype=torch.int32))),
    )


def decode_metadata(inputs: DecodeInputs) -> AttentionMetadata:
    rows = inputs.token_ids.shape[0]
    return AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        num_decode_tokens=rows,
        decode_block_tables=inputs.block_tables,
        decode_context_lens=inputs.context_lens,
        prefill_block_tables=inputs.block_tables[:0],
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=inputs.context_lens.device),
        prefill_context_lens=inputs.context_lens[:0],
        num_prefills=0,
    )


def _rows(inputs: DecodeInputs, rows: int) -> DecodeInputs:
    return DecodeInputs(*(getattr(inputs, f.name)[:rows] for f in fields(DecodeInputs)))


class DecodeGraphs:
    """The captured decode graphs of one model and KV cache; the runner owns it."""

    def __init__(
        self,
        model,
        kv_caches,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        dummy_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.width = max_blocks_per_seq
        self.dummy_block = dummy_block
        self.block_size = block_size
        self.device = device
        empty = DecodeInputs(
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, 0, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32),
        )
        all_padding = pad_decode_inputs(empty, self.sizes[-1], self.width, dummy_block, block_size)
        self.buffers = DecodeInputs(*(getattr(all_padding, f.name).to(device) for f in fields(DecodeInputs)))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        if self.device.type != "cuda":
            return
        # Largest first, all in one memory pool: the smaller graphs reuse the larger ones' scratch memory,
        # which is safe because graphs replay one at a time and an output is read before the next replay.
        pool = None
        for size in reversed(self.sizes):
            inputs = _rows(self.buffers, size)
            meta = decode_metadata(inputs)
            self.model.forward(inputs.token_ids, inputs.positions, meta, self.kv_caches)  # compiles the kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[size] = self.model.forward(inputs.token_ids, inputs.positions, meta, self.kv_caches)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def run(self, inputs: DecodeInputs) -> torch.Tensor | None:
        """Hidden states [rows, hidden] of a decode batch given as CPU tensors, or None when no graph fits."""
        rows = inputs.token_ids.shape[0]
        size = padded_size(rows, self.sizes)
        if size is None or inputs.block_tables.shape[1] > self.width:
            return None
        padded = pad_decode_inputs(inputs, size, self.width, self.dummy_block, self.block_size)
        for f in fields(DecodeInputs):
            getattr(self.buffers, f.name)[:size].copy_(getattr(padded, f.name), non_blocking=True)
        if self.device.type == "cuda":
            self.graphs[size].replay()
            return self.outputs[size][:rows]
        inputs = _rows(self.buffers, size)
        hidden = self.model.forward(inputs.token_ids, inputs.positions, decode_metadata(inputs), self.kv_caches)
        return hidden[:rows]
