"""Runs the model: owns the KV tensors, turns a scheduled batch into one flattened forward pass.

It sees block ids, never the block manager.
"""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from kernels.cpu_attention import heads_major_cache
from engine.loader import LoadedModel
from engine.models.llama import AttentionMetadata
from engine.request import Request
from engine.scheduler import ScheduledBatch


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    shape = loaded.shape
    element = torch.empty((), dtype=loaded.dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * element


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        self.block_size = config.block_size
        per_block = kv_bytes_per_block(loaded, config.block_size)
        self.num_blocks = config.num_kv_blocks or max(2, int(config.kv_cache_memory_gb * 2**30 // per_block))
        self.num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            self.num_cpu_blocks = config.num_cpu_blocks or self.num_blocks
        shape = loaded.shape
        layout = (shape.num_kv_heads, shape.head_dim)

        def pool(blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            # Heads-major memory: the CPU attention path gathers whole blocks of a head without copies.
            return [
                (heads_major_cache(blocks, config.block_size, *layout, dtype=loaded.dtype),
                 heads_major_cache(blocks, config.block_size, *layout, dtype=loaded.dtype))
                for _ in range(shape.num_layers)
            ]

        self.kv_caches = pool(self.num_blocks)
        self.cpu_kv_caches = pool(self.num_cpu_blocks) if self.num_cpu_blocks else []

    # ---- block moves, before the forward pass --------------------------------------------------
    @staticmethod
    def _move(pairs, sources, destinations) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for (src_k, src_v), (dst_k, dst_v) in zip(sources, destinations):
            dst_k[dst] = src_k[src]
            dst_v[dst] = src_v[src]

    def apply_block_moves(self, batch: ScheduledBatch) -> None:
        self._move(batch.swap_out, self.kv_caches, self.cpu_kv_caches)
        self._move(batch.swap_in, self.cpu_kv_caches, self.kv_caches)
        self._move(batch.copies, self.kv_caches, self.kv_caches)

    # ---- the forward pass ------------------------------------------------------------------------
    def forward(self, requests: list[Request], num_new_tokens: list[int]) -> tuple[torch.Tensor, list[Request]]:
        """Runs the tokens; returns logits [sampling rows, vocab] and the requests those rows belong to.

        A request samples when this pass catches it up with every token it knows.
        """
        order = sorted(range(len(requests)), key=lambda i: num_new_tokens[i] != 1)
        requests = [requests[i] for i in order]
        num_new_tokens = [num_new_tokens[i] for i in order]
        num_decodes = sum(1 for n in num_new_tokens if n == 1)
        block_size = self.block_size

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        last_token_rows: list[int] = []
        samplers: list[Request] = []
        for request, count in zip(requests, num_new_tokens):
            start = request.num_computed_tokens
            end = start + count
            token_ids.extend(request.token_ids_between(start, end))
            span = range(start, end)
            positions.extend(span)
            table = request.block_ids
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            context_lens.append(end)
            if end == request.num_tokens:
                last_token_rows.append(len(token_ids) - 1)
                samplers.append(request)

        max_blocks = max(len(r.block_ids) for r in requests)
        tables = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
        for row, request in enumerate(requests):
            tables[row, : len(request.block_ids)] = torch.tensor(request.block_ids, dtype=torch.int32)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        prefill_counts = torch.tensor([0] + num_new_tokens[num_decodes:], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode_tokens=num_decodes,
            decode_block_tables=tables[:num_decodes],
            decode_context_lens=lens[:num_decodes],
            prefill_block_tables=tables[num_decodes:],
            prefill_query_start_loc=torch.cumsum(prefill_counts, 0, dtype=torch.int32),
            prefill_context_lens=lens[num_decodes:],
            num_prefills=len(requests) - num_decodes,
        )
        hidden = self.model.forward(
            torch.tensor(token_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta, self.kv_caches
        )
        if not samplers:
            return torch.empty(0), []
        logits = self.model.compute_logits(hidden[torch.tensor(last_token_rows, dtype=torch.long)])
        return logits, samplers
