"""Runs the model: owns the KV tensors, turns a scheduled batch into one flattened forward pass.

It sees block ids, never the block manager. Step inputs are built on the CPU and copied to the model's
device; logits come back to the CPU, where the sampler runs.
"""

from __future__ import annotations

import contextlib

import torch

from engine.config import EngineConfig, resolve_device
from engine.cuda_graphs import DecodeGraphs, DecodeInputs
from engine.loader import LoadedModel
from engine.lora import AdapterPool, LoraSegment, LoraWeights, lora_step, segments_of
from engine.models.llama import AttentionMetadata
from engine.request import Request
from engine.scheduler import ScheduledBatch
from kernels.cpu_attention import heads_major_cache


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    shape = loaded.shape
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * dtype.itemsize


def kv_cache(
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    heads_major: bool,
    pin_memory: bool = False,
) -> torch.Tensor:
    """A zeroed [blocks, block_size, kv_heads, head_dim] cache. Heads-major memory lets the CPU attention
    gather whole blocks of a head without copies; the Triton kernels want plain (token-major) memory."""
    if heads_major:
        return heads_major_cache(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    return torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device, pin_memory=pin_memory)


def uses_decode_graphs(config: EngineConfig, device: torch.device) -> bool:
    return device.type == "cuda" and not config.enforce_eager


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        self.adapters: AdapterPool | None = None  # the engine's LoRA adapters (engine/lora.py), when it has any
        self.device = resolve_device(str(loaded.device))  # "cuda" and "cuda:0" are one device
        if config.torch_device != self.device:
            raise ValueError(
                f"the model was loaded on {self.device}, but the engine is set to run on {config.torch_device}"
            )
        self.block_size = config.block_size
        self.kv_dtype = config.kv_torch_dtype(loaded.model.quantization)
        per_block = kv_bytes_per_block(loaded, config.block_size, self.kv_dtype)
        self.num_blocks = config.num_kv_blocks or max(2, int(config.kv_cache_memory_gb * 2**30 // per_block))
        self.num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            self.num_cpu_blocks = config.num_cpu_blocks or self.num_blocks
        on_cuda = self.device.type == "cuda"
        use_graphs = uses_decode_graphs(config, self.device)
        # Graph replays pad batches with rows that write one block past the pool the block manager hands out.
        self.dummy_block = self.num_blocks if use_graphs else None
        shape = loaded.shape
        layout = (config.block_size, shape.num_kv_heads, shape.head_dim, self.kv_dtype)

        def pool(
            blocks: int, device: torch.device, pin_memory: bool = False
        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
            heads_major = config.heads_major_kv and device.type == "cpu"
            return [
                tuple(kv_cache(blocks, *layout, device, heads_major=heads_major, pin_memory=pin_memory) for _ in "kv")
                for _ in range(shape.num_layers)
            ]

        self.kv_caches = pool(self.num_blocks + (1 if use_graphs else 0), self.device)
        # The swap pool stays in CPU memory (page-locked on CUDA, for full-speed copies), in the device's layout.
        self.cpu_kv_caches = pool(self.num_cpu_blocks, torch.device("cpu"), on_cuda) if self.num_cpu_blocks else []
        self._no_prefills = torch.zeros(1, dtype=torch.int32, device=self.device)  # query starts of no prefills
        # Where a plain decode step runs as one native call (kernels/decode_stack.py), a drafted sequence's
        # verification rows run in it too, each as a decode row of its own (forward, below).
        self.drafts_as_decode_rows = loaded.model.has_fused_decode(config, self.kv_dtype)
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            max_len = min(config.max_model_len or shape.max_position_embeddings, shape.max_position_embeddings)
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                max_num_seqs=config.max_num_seqs,
                max_blocks_per_seq=min(-(-max_len // config.block_size), self.num_blocks),
                dummy_block=self.dummy_block,
                block_size=config.block_size,
                device=self.device,
            )
            with self._on_device():
                self.graphs.capture()

    def _on_device(self):
        # Kernels launch on the current CUDA device, which is per thread: the engine steps in its own.
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # ---- block moves, before the forward pass --------------------------------------------------
    @staticmethod
    def _move(pairs, sources, destinations) -> None:
        """Copies blocks, also between the device and the CPU swap pool (blocking when they arrive on the CPU)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=sources[0][0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=destinations[0][0].device)
        for (src_k, src_v), (dst_k, dst_v) in zip(sources, destinations):
            dst_k[dst] = src_k[src].to(dst_k.device)
            dst_v[dst] = src_v[src].to(dst_v.device)

    def apply_block_moves(self, batch: ScheduledBatch) -> None:
        with self._on_device():
            self._move(batch.swap_out, self.kv_caches, self.cpu_kv_caches)
            self._move(batch.swap_in, self.cpu_kv_caches, self.kv_caches)
            self._move(batch.copies, self.kv_caches, self.kv_caches)

    # ---- the forward pass ------------------------------------------------------------------------
    def forward(self, requests: list[Request], num_new_tokens: list[int]) -> tuple[torch.Tensor, list[Request]]:
        """Runs the tokens; returns logits [sampling rows, vocab] and the requests those rows belong to.

        A request samples when this pass catches it up with every token it knows. One with drafts gets a
        row per draft too, after the row of its last known token: 1 + len(draft_token_ids) rows in all.
        With `drafts_as_decode_rows`, those rows attend as decode rows, one each, sharing the request's block
        table, the row at position p over the p + 1 tokens before it: the step stays one native call (a
        drafted step on the per-op path had cost more than its drafts saved), and each row is computed as
        a plain decode step computes it, so a greedy reply is the same with drafts or without.
        """

        def as_decode_rows(request: Request, count: int) -> bool:  # else one prefill chunk
            drafts = len(request.draft_token_ids)
            return count == 1 or (self.drafts_as_decode_rows and drafts > 0 and count == drafts + 1)

        decode_like = [as_decode_rows(request, count) for request, count in zip(requests, num_new_tokens)]
        # decode rows first; within each part, rows grouped by LoRA adapter (one shrink / expand per group)
        order = sorted(range(len(requests)), key=lambda i: (not decode_like[i], self._adapter_key(requests[i])))
        decode_like = [decode_like[i] for i in order]
        requests = [requests[i] for i in order]
        num_new_tokens = [num_new_tokens[i] for i in order]
        block_size = self.block_size

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        # per attention row: a decode row (one token) or a prefill chunk
        tables_rows: list[list[int]] = []
        context_lens: list[int] = []
        attention_counts: list[int] = []
        last_token_rows: list[int] = []
        samplers: list[Request] = []
        row_adapters: list[LoraWeights | None] = []
        for request, count, one_row_per_token in zip(requests, num_new_tokens, decode_like):
            start = request.num_computed_tokens
            end = start + count
            token_ids.extend(request.token_ids_with_drafts(start, end))
            row_adapters.extend([self._adapter_weights(request)] * (end - start))
            span = range(start, end)
            positions.extend(span)
            table = request.block_ids
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            if one_row_per_token:
                tables_rows.extend([table] * count)
                context_lens.extend(p + 1 for p in span)
                attention_counts.extend([1] * count)
            else:
                tables_rows.append(table)
                context_lens.append(end)
                attention_counts.append(count)
            num_drafts = len(request.draft_token_ids)
            if end == request.num_tokens + num_drafts:
                last_token_rows.extend(range(len(token_ids) - 1 - num_drafts, len(token_ids)))
                samplers.append(request)

        # Few tensors, each made once from a list: right after a decode step, whose weights have streamed through
        # every cache, each small torch call costs ~10-80 us cold, not ~2.
        max_blocks = max(len(table) for table in tables_rows)
        tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables_rows], dtype=torch.int32)
        num_decodes = sum(1 for count in attention_counts if count == 1)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions_cpu = torch.tensor(positions, dtype=torch.long)
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        lora_segments: list[LoraSegment] = segments_of(row_adapters) if self.adapters is not None else []
        with self._on_device():
            hidden = None
            # a captured graph replays the base linears only: a step with adapter rows runs eagerly
            if self.graphs is not None and num_decodes == len(attention_counts) and not lora_segments:
                hidden = self.graphs.run(DecodeInputs(ids, positions_cpu, slot_mapping, tables, lens))
            if hidden is None:
                with lora_step(self.model, lora_segments):
                    hidden = self._forward_eager(
                        ids, positions_cpu, slot_mapping, tables, lens, attention_counts, num_decodes
                    )
            if not samplers:
                return torch.empty(0), []
            if len(last_token_rows) < len(token_ids):  # else every row samples, in order (decode steps)
                rows = torch.tensor(last_token_rows, dtype=torch.long).to(self.device, non_blocking=True)
                hidden = hidden[rows]
            logits = self.model.compute_logits(hidden)
        return logits.to("cpu"), samplers

    @staticmethod
    def _adapter_key(request: Request) -> str:
        return "" if request.adapter is None else request.adapter.name

    def _adapter_weights(self, request: Request) -> LoraWeights | None:
        if request.adapter is None:
            return None
        assert self.adapters is not None  # the engine holds the adapter resident while the request runs
        return self.adapters.weights(request.adapter.name)

    def _forward_eager(self, ids, positions, slot_mapping, tables, lens, num_new_tokens, num_decodes) -> torch.Tensor:
        def to_device(tensor: torch.Tensor) -> torch.Tensor:  # a no-op on the CPU
            return tensor.to(self.device, non_blocking=True)

        tables, lens = to_device(tables), to_device(lens)
        if num_decodes < len(num_new_tokens):
            prefill_counts = torch.tensor([0] + num_new_tokens[num_decodes:], dtype=torch.int32)
            query_start_loc = to_device(torch.cumsum(prefill_counts, 0, dtype=torch.int32))
        else:
            query_start_loc = self._no_prefills
        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            num_decode_tokens=num_decodes,
            decode_block_tables=tables[:num_decodes],
            decode_context_lens=lens[:num_decodes],
            prefill_block_tables=tables[num_decodes:],
            prefill_query_start_loc=query_start_loc,
            prefill_context_lens=lens[num_decodes:],
            num_prefills=len(tables) - num_decodes,
        )
        return self.model.forward(to_device(ids), to_device(positions), meta, self.kv_caches)
