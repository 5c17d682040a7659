"""The synchronous engine core: requests in, one scheduled forward pass per `step()`, deltas out."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.loader import LoadedModel
from engine.lora import AdapterError, AdapterManifest, AdapterPool, LoraDims
from engine.lora_stats import AdapterUsage
from engine.outputs import RequestOutput, SequenceDelta, TokenLogprob
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplerOutput, SamplingState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculation import NgramSpeculator
from engine.stats import EngineStats
from engine.tenancy import DEFAULT_TENANCY, Tenancy

log = logging.getLogger("tokenmill.engine")


class EngineRejected(Exception):
    """A request the engine will not take; `code` and `param` follow the OpenAI error shape."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass
class _Pending:
    """What one step produced for one sequence, before it is handed out."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RequestGroup:
    """The n sequences of one caller request."""

    request_id: str
    sequences: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    num_prompt_tokens: int

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.runner = ModelRunner(loaded, config)
        self.blocks = BlockManager(
            self.runner.num_blocks, config.block_size, self.runner.num_cpu_blocks, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.blocks)
        self.sampler = Sampler()
        max_positions = loaded.shape.max_position_embeddings
        self.max_model_len = min(config.max_model_len or max_positions, max_positions)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.speculator = NgramSpeculator(
            config, self.max_model_len, loaded.model.has_fused_decode(config, self.runner.kv_dtype)
        )
        self.groups: dict[str, RequestGroup] = {}
        self.adapters = AdapterPool(
            LoraDims.of_model(loaded.model),
            loaded.model.dtype,
            config.max_loras,
            config.max_lora_rank,
            self.runner.device,
        )
        self.runner.adapters = self.adapters
        # Requests whose adapter waits for a resident slot (every slot held by running requests), in arrival
        # order; and the requests that hold their adapter resident until they finish.
        self.waiting_for_adapter: deque[Request] = deque()
        self.holding_adapter: set[str] = set()
        self.adapter_usage = AdapterUsage()
        self.stats = EngineStats(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_blocks_total=self.blocks.num_blocks,
        )

    # ---- admission -------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *, capacity: bool = True) -> None:
        """Raises EngineRejected for a request that can never run, or (with `capacity`) when the queue is full."""
        if not prompt_token_ids:
            raise EngineRejected("invalid_prompt", "the prompt is empty", "prompt")
        vocab = self.loaded.shape.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise EngineRejected("invalid_prompt", f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if any(t >= vocab for t in params.logit_bias):
            raise EngineRejected("invalid_value", f"logit_bias token ids must be below {vocab}", "logit_bias")
        max_tokens = params.max_tokens or 1
        total = len(prompt_token_ids) + max_tokens
        if total > self.max_model_len:
            raise EngineRejected(
                "context_length_exceeded",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt_token_ids)} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                "messages",
            )
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise EngineRejected(
                "context_length_exceeded",
                f"{total} tokens need {self.blocks.blocks_for(total)} KV blocks, but the pool holds only "
                f"{self.blocks.num_blocks}. Please reduce the length of the messages or completion.",
                "messages",
            )
        if capacity and len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineRejected("queue_full", "the server is at capacity; retry shortly")

    # ---- LoRA adapters ------------------------------------------------------------------------
    def register_adapter(self, name: str, path: str) -> AdapterManifest:
        """Checks the PEFT folder against this base model and makes `name` usable (loaded on first use).
        Raises AdapterError naming the mismatch."""
        manifest = self.adapters.check(path)
        old = self.adapters.registered.get(name)
        if old is not None and old.fingerprint != manifest.fingerprint:
            self._refuse_while_waiting(name)
        self.adapters.register(name, manifest)
        return manifest

    def unregister_adapter(self, name: str) -> None:
        self._refuse_while_waiting(name)
        self.adapters.unregister(name)

    def _refuse_while_waiting(self, name: str) -> None:
        """Requests waiting for a slot hold their adapter as much as running ones do (the pool refuses those)."""
        if any(r.adapter is not None and r.adapter.name == name for r in list(self.waiting_for_adapter)):
            raise AdapterError(f"adapter {name!r} is in use by waiting requests")

    def _refresh_adapter_stats(self) -> None:
        if not self.adapters.registered and not self.stats.adapters:
            return
        scheduler = self.scheduler
        pool = self.adapters
        self.stats.adapters = self.adapter_usage.snapshot(
            [*scheduler.running, *scheduler.swapped],
            [*scheduler.waiting, *self.waiting_for_adapter],
            list(pool.resident),
        )
        self.stats.lora_loads_total = pool.stats.loads
        self.stats.lora_evictions_total = pool.stats.evictions
        self.stats.lora_load_seconds_total = pool.stats.load_seconds_total
        self.stats.lora_resident_bytes = pool.resident_nbytes

    def _admit_waiting_for_adapter(self) -> None:
        while self.waiting_for_adapter:
            parent = self.waiting_for_adapter[0]
            assert parent.adapter is not None
            if not self.adapters.try_acquire(parent.adapter.name):
                return
            self.waiting_for_adapter.popleft()
            self.holding_adapter.add(parent.request_id)
            self.scheduler.add(parent)

    def _release_adapter(self, group: RequestGroup) -> None:
        parent = group.sequences[0]
        if parent.adapter is None:
            return
        if group.request_id in self.holding_adapter:
            self.holding_adapter.discard(group.request_id)
            self.adapters.release(parent.adapter.name)
        elif parent in self.waiting_for_adapter:
            self.waiting_for_adapter.remove(parent)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenancy: Tenancy = DEFAULT_TENANCY,
        adapter: str | None = None,
    ) -> None:
        """`adapter`: the name of a registered LoRA adapter to run the request under (None: the base model)."""
        if request_id in self.groups:
            raise EngineRejected("duplicate_request", f"request id {request_id!r} is already in use")
        adapter_ref = None
        if adapter is not None:
            try:
                adapter_ref = self.adapters.ref(adapter)
            except KeyError:
                raise EngineRejected("model_not_found", f"adapter {adapter!r} is not registered", "model") from None
        # Capacity was checked where the request came in: one already accepted there is not turned
        # away here, after its caller may have started answering.
        self.check_request(prompt_token_ids, params, capacity=False)
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - len(prompt_token_ids))
        sequences = [
            Request(request_id, index, list(prompt_token_ids), params, tenancy=tenancy, adapter=adapter_ref)
            for index in range(params.n)
        ]
        parent = sequences[0]
        parent.siblings = sequences[1:]
        for sibling in parent.siblings:
            sibling.fork_parent = parent
        self.groups[request_id] = RequestGroup(
            request_id,
            sequences,
            [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) for _ in sequences],
            len(prompt_token_ids),
        )
        if adapter_ref is not None:
            self.waiting_for_adapter.append(parent)
            self._admit_waiting_for_adapter()
            self.adapter_usage.charge(adapter_ref.name, tenancy.team, prompt_tokens=len(prompt_token_ids))
        else:
            self.scheduler.add(parent)
        self.stats.prompt_tokens_total += len(prompt_token_ids)
        self.stats.refresh(self.scheduler, self.blocks)
        self._refresh_adapter_stats()

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        # still waiting for its adapter: it never reached the scheduler
        unscheduled = group.sequences[0] in self.waiting_for_adapter
        self._release_adapter(group)
        deltas = []
        for seq, detok in zip(group.sequences, group.detokenizers):
            if seq.is_finished:
                continue
            if seq.fork_parent is not None or unscheduled:  # never joined the batch
                seq.fork_parent = None
                seq.status = RequestStatus.FINISHED_ABORTED
            else:
                self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
            deltas.append(SequenceDelta(seq.index, detok.flush(), [], None, "abort"))
        self.stats.refresh(self.scheduler, self.blocks)
        self._refresh_adapter_stats()
        return self._output(group, deltas)

    def cached_prefix_digest(self) -> frozenset[bytes]:
        """What the prefix cache holds, as the block hashes a request's prompt would match (salted per
        team by Tenancy.cache_root): a router scores replicas with it (app/scaleout/prefix_routing.py)."""
        return frozenset(self.blocks.cached_block_hashes())

    @property
    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self._admit_waiting_for_adapter()
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch.is_empty():
            return []
        self.runner.apply_block_moves(batch)
        pending: dict[Request, _Pending] = {}
        failed: list[tuple[Request, str]] = []
        try:
            logits, samplers = self.runner.forward(batch.requests, batch.num_new_tokens)
            parts = [(logits, samplers)]
        except Exception:  # one bad request must not take the others down: retry them one by one
            log.exception("model step failed; retrying the batch request by request")
            parts = []
            for request, count in zip(batch.requests, batch.num_new_tokens):
                try:
                    parts.append(self.runner.forward([request], [count]))
                except Exception as error:  # reported to that request's caller
                    failed.append((request, f"{type(error).__name__}: {error}"))
        failed_set = {request for request, _ in failed}
        for request, count in zip(batch.requests, batch.num_new_tokens):
            if request in failed_set:
                request.draft_token_ids = []
                continue
            # The drafts' KV counts once the model has accepted them (_verify_drafts).
            request.num_computed_tokens += count - len(request.draft_token_ids)
            self.blocks.register_full_blocks(request)
        for logits, samplers in parts:
            if samplers:
                self._sample(logits, samplers, pending)
        outputs = self._collect(pending, failed)
        seconds = time.perf_counter() - started
        self.scheduler.step_budget.observe(batch.num_tokens, seconds)
        self.stats.record_step(batch, seconds, self.scheduler, self.blocks)
        self._refresh_adapter_stats()
        return outputs

    def _sample(self, logits: torch.Tensor, samplers: list[Request], pending: dict[Request, _Pending]) -> None:
        # Sampling rows: a sequence's one row, shared with the siblings that fork off it now, or a drafted
        # sequence's 1 + drafts rows, each sampled as if the drafts before it were accepted.
        rows: list[int] = []
        sequences: list[Request] = []
        histories: list[list[int]] = []
        drafts: list[int | None] = []
        drafted: list[tuple[Request, int]] = []  # (sequence, its first sampling row)
        logits_row = 0
        for request in samplers:
            draft = request.draft_token_ids
            if draft:
                drafted.append((request, len(rows)))
                for i in range(len(draft) + 1):
                    rows.append(logits_row + i)
                    sequences.append(request)
                    histories.append(request.output_token_ids + draft[:i])
                    drafts.append(draft[i] if i < len(draft) else None)
                logits_row += len(draft) + 1
                continue
            for seq in [request, *[s for s in request.siblings if s.fork_parent is request]]:
                rows.append(logits_row)
                sequences.append(seq)
                histories.append(seq.output_token_ids)
                drafts.append(None)
            logits_row += 1
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, dtype=torch.long)]
        states = [
            SamplingState(
                seq.params,
                seq.prompt_token_ids,
                history,
                seq.sample_seed,
                None if seq.params.ignore_eos else self.eos_token_id,
                seq.guide.allowed_tokens() if seq.guide is not None else None,
            )
            for seq, history in zip(sequences, histories)
        ]
        result = self.sampler(logits, states, drafts if drafted else None)
        for seq, first_row in drafted:
            self._verify_drafts(seq, first_row, result, pending)
        drafted_seqs = {seq for seq, _ in drafted}
        for seq, token_id, logprob in zip(sequences, result.token_ids, result.logprobs):
            if seq in drafted_seqs:
                continue
            parent = seq.fork_parent
            if parent is not None:  # the parent's prompt is in the cache: share it instead of recomputing
                self.blocks.fork(parent, seq)
                seq.num_computed_tokens = parent.num_computed_tokens
                seq.num_cached_tokens = parent.num_cached_tokens
                seq.fork_parent = None
                self.scheduler.add_running(seq)
            seq.output_token_ids.append(token_id)
            if seq.guide is not None:
                seq.guide.advance(token_id)
            entry = pending.setdefault(seq, _Pending())
            entry.token_ids.append(token_id)
            if logprob is not None:
                entry.logprobs.append(logprob)

    def _verify_drafts(
        self, seq: Request, first_row: int, result: SamplerOutput, pending: dict[Request, _Pending]
    ) -> None:
        """Keeps the drafts up to the first one the sampler rejected, then that row's token (the bonus token
        when all were accepted); rolls the KV of the rejected drafts back."""
        assert result.accepted is not None
        num_drafts = len(seq.draft_token_ids)
        entry = pending.setdefault(seq, _Pending())
        for row in range(first_row, first_row + num_drafts + 1):
            entry.token_ids.append(result.token_ids[row])
            logprob = result.logprobs[row]
            if logprob is not None:
                entry.logprobs.append(logprob)
            if not result.accepted[row]:
                break
        num_accepted = len(entry.token_ids) - 1
        seq.output_token_ids.extend(entry.token_ids)
        seq.draft_token_ids = []
        seq.num_computed_tokens += num_accepted
        self.blocks.register_full_blocks(seq)
        self.blocks.truncate(seq, seq.num_tokens)
        self.speculator.record(seq, num_drafts, num_accepted)
        self.stats.record_drafts(num_drafts, num_accepted)

    def _stops_on_token(self, seq: Request, token_id: int, num_output: int) -> bool:
        """Whether the token, the `num_output`th of the sequence, ends it."""
        params = seq.params
        if num_output < params.min_tokens:
            return False
        return token_id in params.stop_token_ids or (token_id == self.eos_token_id and not params.ignore_eos)

    def _out_of_room(self, seq: Request, num_output: int) -> bool:
        return num_output >= seq.params.max_tokens or seq.num_prompt_tokens + num_output >= self.max_model_len

    def _collect(self, pending: dict[Request, _Pending], failed: list[tuple[Request, str]]) -> list[RequestOutput]:
        by_group: dict[str, list[SequenceDelta]] = {}
        errors: dict[str, str] = {}
        for seq, entry in pending.items():
            group = self.groups[seq.request_id]
            detok = group.detokenizers[seq.index]
            text = ""
            status = None
            # A step may bring several tokens (accepted drafts): each is checked in turn, and those after
            # the one that ends the sequence are dropped, as if never generated.
            num_before = len(seq.output_token_ids) - len(entry.token_ids)
            for i, token_id in enumerate(entry.token_ids):
                num_output = num_before + i + 1
                if self._stops_on_token(seq, token_id, num_output):  # like OpenAI, the stop token adds no text
                    text, status = text + detok.flush(), RequestStatus.FINISHED_STOPPED
                else:
                    piece, hit_stop_string = detok.add_token(token_id)
                    text += piece
                    if hit_stop_string or (seq.guide is not None and seq.guide.done):
                        if not hit_stop_string:
                            text += detok.flush()
                        status = RequestStatus.FINISHED_STOPPED
                    elif self._out_of_room(seq, num_output):
                        text, status = text + detok.flush(), RequestStatus.FINISHED_LENGTH
                if status is not None:
                    del seq.output_token_ids[num_output:]
                    del entry.token_ids[i + 1 :]
                    del entry.logprobs[i + 1 :]
                    break
            self.stats.generation_tokens_total += len(entry.token_ids)
            # the fair-share charge for what each team was actually served, before a finish lets it go
            self.scheduler.ledger.charge(seq.team, output_tokens=len(entry.token_ids))
            if seq.adapter is not None:
                self.adapter_usage.charge(seq.adapter.name, seq.team, output_tokens=len(entry.token_ids))
            if status is not None:
                self.scheduler.finish(seq, status)
            by_group.setdefault(seq.request_id, []).append(
                SequenceDelta(
                    seq.index,
                    text,
                    entry.token_ids,
                    entry.logprobs if seq.params.logprobs is not None else None,
                    status.value if status else None,
                )
            )
        for request, message in failed:
            errors[request.request_id] = message
            group = self.groups[request.request_id]
            for seq in group.sequences:
                if not seq.is_finished:
                    if seq.fork_parent is None:
                        self.scheduler.finish(seq, RequestStatus.FINISHED_ERROR)
                    seq.status = RequestStatus.FINISHED_ERROR
                    by_group.setdefault(seq.request_id, []).append(SequenceDelta(seq.index, "", [], None, "error"))
        outputs = []
        for request_id, deltas in by_group.items():
            group = self.groups[request_id]
            output = self._output(group, deltas, errors.get(request_id))
            if output.finished:
                self._release_adapter(group)
                del self.groups[request_id]
            outputs.append(output)
        return outputs

    def _output(self, group: RequestGroup, deltas: list[SequenceDelta], error: str | None = None) -> RequestOutput:
        return RequestOutput(
            group.request_id,
            group.num_prompt_tokens,
            group.sequences[0].num_cached_tokens,
            sorted(deltas, key=lambda d: d.index),
            group.finished,
            error,
            group.sequences[0].first_scheduled_time,
        )
