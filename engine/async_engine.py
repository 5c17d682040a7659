"""The engine as the app sees it: `generate()` streams deltas, `abort()`, `stats()`.

The step loop runs in its own thread; commands reach it through a queue and outputs come back to each
caller's event loop through a per-request asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator

import torch

from engine.config import EngineConfig
from engine.llm_engine import EngineRejected, LLMEngine
from engine.loader import LoadedModel, load_model
from engine.lora import AdapterManifest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.tenancy import DEFAULT_TENANCY, Tenancy

log = logging.getLogger("tokenmill.engine")

__all__ = ["AsyncEngine", "EngineRejected"]

# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The engine thread
# drops the GIL in every native kernel and needs it back between them, while the event loop thread frames
# the streamed tokens: with the default, a step could wait for the loop's turn to run out. At 0.2 ms, servers
# started alternately on a 2-core EPYC Zen 5 served one sampled stream at 291 tok/s against 265 (means of 7
# runs, inter-token p50 3.6 against 3.9 ms) and 64 mixed requests at 768 against 721 tok/s (3 runs); 1 ms
# sat between the two. Process-wide, so never raised here: a smaller interval set by the host stays.
GIL_SWITCH_INTERVAL_S = 0.0002


class AsyncEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.core = LLMEngine(config, loaded)
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = self.core.max_model_len
        self.weight_format = loaded.weight_format  # what its weights run as, e.g. "gguf Q4_K/Q6_K -> int4k/int6k"
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats = self.core.stats.snapshot()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: EngineConfig, loaded: LoadedModel | None = None) -> AsyncEngine:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        return cls(config, loaded or load_model(config))

    # ---- caller side (any thread / event loop) ------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *, capacity: bool = True) -> None:
        self.core.check_request(prompt_token_ids, params, capacity=capacity)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenancy: Tenancy = DEFAULT_TENANCY,
        adapter: str | None = None,
        *,
        capacity: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """`adapter`: a registered LoRA adapter's name (register_adapter); None runs the base model.
        `capacity=False`: the caller checked the queue's room already (check_request) and may have answered
        the client since; a full queue now does not refuse it (max_waiting is overshot by the requests
        between the two), so a stream whose 200 went out is never refused in its first event."""
        if self._stopping.is_set():
            raise EngineRejected("shutting_down", "the engine is shutting down")
        self.check_request(prompt_token_ids, params, capacity=capacity)
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise EngineRejected("duplicate_request", f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("add", request_id, list(prompt_token_ids), params, tenancy, adapter))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # the caller went away (client disconnect, cancellation)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def register_adapter(self, name: str, path: str) -> AdapterManifest:
        """Blocking (reads the folder): checks a PEFT LoRA folder against this model and makes `name` usable.
        Raises engine.lora.AdapterError naming the mismatch."""
        return self.core.register_adapter(name, path)

    def unregister_adapter(self, name: str) -> None:
        self.core.unregister_adapter(name)

    def stats(self) -> EngineStats:
        return self._stats

    def cached_prefix_digest(self) -> frozenset[bytes]:
        """The block hashes the prefix cache holds now (LLMEngine.cached_prefix_digest); safe while it steps."""
        return self.core.cached_prefix_digest()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is None:
            return
        loop, outputs = target
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _handle(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "stop":
            return False
        if kind == "add":
            _, request_id, prompt_token_ids, params, tenancy, adapter = command
            try:
                self.core.add_request(request_id, prompt_token_ids, params, tenancy, adapter)
            except Exception as error:  # refused to its caller; the loop must live on
                if not isinstance(error, EngineRejected):
                    log.exception("could not add request %s", request_id)
                self._deliver(request_id, error)
        elif kind == "abort":
            output = self.core.abort(command[1])
            if output is not None:
                self._deliver(output.request_id, output)
        return True

    def _run(self) -> None:
        running = True
        while running:
            try:
                block = not self.core.has_unfinished
                command = self._commands.get(block=block, timeout=None if block else 0)
                running = self._handle(command)
                while running:
                    running = self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not running:
                break
            try:
                for output in self.core.step():
                    self._deliver(output.request_id, output)
            except Exception as error:  # a broken step fails its requests, not the engine
                log.exception("engine step failed")
                for request_id in list(self.core.groups):
                    self.core.abort(request_id)
                    self._deliver(request_id, RuntimeError(f"engine step failed: {error}"))
            self._stats = self.core.stats.snapshot()
        for request_id in list(self.core.groups):
            output = self.core.abort(request_id)
            if output is not None:
                self._deliver(request_id, output)
