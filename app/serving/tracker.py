"""One HTTP request's engine work: latencies for /metrics, token counts for usage, abort on early exit."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from app.errors import OpenAIError, invalid_request
from app.gateway.contract import Principal, UsageRecord
from app.observability.metrics import ModelMetrics
from app.serving.context import ModelContext
from engine.async_engine import EngineRejected
from engine.outputs import RequestOutput, SequenceDelta, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tenancy import DEFAULT_TEAM, Tenancy

log = logging.getLogger("tokenmill.generation")


class EngineFailure(Exception):
    """The engine failed a request it had accepted (RequestOutput.error)."""


def rejection_error(error: EngineRejected, *, prompt_param: str, max_tokens_param: str) -> OpenAIError:
    if error.code in ("queue_full", "shutting_down"):
        return OpenAIError(503, str(error), type="server_error", code=error.code, headers={"Retry-After": "1"})
    if error.param == "max_tokens":
        param = max_tokens_param
    elif error.param in (None, "messages", "prompt"):  # the engine does not know which endpoint asked
        param = prompt_param
    else:
        param = error.param
    return invalid_request(str(error), param=param, code=error.code)


@dataclass
class Choice:
    """The text, tokens and logprobs one sequence has produced so far."""

    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: SequenceDelta) -> None:
        self.text_parts.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def team_of(principal: Principal) -> str:
    return DEFAULT_TEAM if principal.team_id is None else f"team:{principal.team_id}"


def cache_salt(principal: Principal, prefix_cache_scope: str) -> str:
    """Whose cached prefixes the principal's requests may reuse (Tenancy.cache_salt). The Ray Serve
    replicas tell their router the same salt, so that routing never matches another team's blocks."""
    if prefix_cache_scope == "global":
        return ""
    if principal.cache_group:
        return f"group:{principal.cache_group}"
    return team_of(principal)


class RequestTracker:
    """Counts what the engine reports for one HTTP request (one or more engine requests) and reports it
    once at the end, to /metrics and to the gateway's usage hook."""

    def __init__(
        self,
        context: ModelContext,
        principal: Principal,
        *,
        request_id: str,
        endpoint: str,
        accepted_at: float | None = None,
    ) -> None:
        self.context = context
        self.principal = principal
        self.request_id = request_id
        self.endpoint = endpoint
        self.started_at = time.monotonic()  # admitted: the template, tokenization and holds are done
        # when the route took the HTTP request (None: a caller that doesn't say, e.g. a batch line)
        self.accepted_at = accepted_at
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.prompt_tokens_by_request: dict[str, tuple[int, int]] = {}
        self.completion_tokens = 0
        self.finish_reasons: list[str] = []
        self.finished = False
        self.priority = 0  # the body's `priority`, once the route has read it

    def tenancy(self) -> Tenancy:
        """Whose share the engine charges, how urgent it is, and which cached prefixes it may reuse."""
        principal = self.principal
        # A key may always ask to go later; going earlier than its floor is quietly capped.
        priority = max(self.priority, principal.priority_floor)
        return Tenancy(
            team=team_of(principal),
            weight=principal.team_weight,
            priority=priority,
            cache_salt=cache_salt(principal, self.context.settings.prefix_cache_scope),
            background=principal.batch,
        )

    @property
    def prompt_tokens(self) -> int:
        return sum(prompt for prompt, _ in self.prompt_tokens_by_request.values())

    @property
    def cached_tokens(self) -> int:
        return sum(cached for _, cached in self.prompt_tokens_by_request.values())

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def observe(self, output: RequestOutput) -> None:
        self.prompt_tokens_by_request[output.request_id] = (output.num_prompt_tokens, output.num_cached_tokens)
        new_tokens = sum(len(delta.token_ids) for delta in output.deltas)
        if new_tokens:
            now = time.monotonic()
            metrics = self.context.metrics
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.time_to_first_token.observe(now - self.started_at)
                self._observe_stages(metrics, output.scheduled_at, now)
            else:
                assert self.last_token_at is not None  # set with first_token_at
                # Tokens that arrive together (accepted speculative drafts) share the wait evenly: one
                # observation per token, so that the histogram keeps reading as time per output token.
                burst = max(len(delta.token_ids) for delta in output.deltas)
                for _ in range(burst):
                    metrics.inter_token_latency.observe((now - self.last_token_at) / burst)
            self.last_token_at = now
            self.completion_tokens += new_tokens
        self.finish_reasons.extend(delta.finish_reason for delta in output.deltas if delta.finish_reason)

    def _observe_stages(self, metrics: ModelMetrics, scheduled_at: float | None, first_token_at: float) -> None:
        """Where the time to first token went: admission (HTTP accepted to admitted), queue (admitted to the
        engine's first step for it), prefill (that step to the first token)."""
        if self.accepted_at is not None:
            metrics.request_stage.labels("admission").observe(self.started_at - self.accepted_at)
        if scheduled_at is not None:
            metrics.request_stage.labels("queue").observe(max(scheduled_at - self.started_at, 0.0))
            metrics.request_stage.labels("prefill").observe(max(first_token_at - scheduled_at, 0.0))

    def finish(self, status: str) -> None:
        if self.finished:
            return
        self.finished = True
        latency = time.monotonic() - self.started_at
        metrics = self.context.metrics
        if status != "rejected":
            metrics.e2e_request_latency.observe(latency)
        for reason in self.finish_reasons:
            metrics.request_finished(reason)
        ttft = None if self.first_token_at is None else self.first_token_at - self.started_at
        record = UsageRecord(
            request_id=self.request_id,
            team_id=self.principal.team_id,
            key_id=self.principal.key_id,
            model=self.context.model_name,
            endpoint=self.endpoint,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            latency_seconds=latency,
            time_to_first_token_seconds=ttft,
            status=status,
            finished_at=time.time(),
            price=self.context.price,
            batch=self.principal.batch,
        )
        self.context.release()
        if self.context.cost_meter is not None:  # real cost: what the hardware hour produced
            self.context.cost_meter.record(self.completion_tokens, self.context.model_name)
        try:
            self.context.gateway.request_finished(record)
        except Exception:  # metering must never break a response that is already on its way
            log.exception("usage hook failed for %s", self.request_id)

    def final_status(self) -> str:
        return "aborted" if "abort" in self.finish_reasons else "ok"


def check_fits(
    context: ModelContext, prompt_ids: list[int], params: SamplingParams, *, prompt_param: str, max_tokens_param: str
) -> None:
    try:
        context.engine.check_request(prompt_ids, params)
    except EngineRejected as error:
        raise rejection_error(error, prompt_param=prompt_param, max_tokens_param=max_tokens_param) from None


async def engine_outputs(
    context: ModelContext,
    tracker: RequestTracker,
    engine_request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request; stopping early (disconnect, error) aborts it in the engine."""
    finished = False
    try:
        # The route checked the queue's room (check_fits) before it answered; a stream's 200 may be out now.
        generation = context.engine.generate(engine_request_id, prompt_ids, params, tracker.tenancy(), capacity=False)
        assert isinstance(generation, AsyncGenerator)  # an async generator function's (typed AsyncIterator)
        async with aclosing(generation) as outputs:
            while True:
                try:
                    output = await anext(outputs)
                except StopAsyncIteration:
                    break
                except EngineRejected:
                    raise
                except Exception as error:  # a failed engine step reaches us as its exception
                    raise EngineFailure(f"{type(error).__name__}: {error}") from error
                tracker.observe(output)
                finished = output.finished
                if output.error:
                    raise EngineFailure(output.error)
                yield output
    finally:
        if not finished:
            context.engine.abort(engine_request_id)


@asynccontextmanager
async def abort_on_disconnect(request: Request, abort: Callable[[], None]) -> AsyncIterator[None]:
    """For responses sent in one piece: the body is read, so the next ASGI message is the disconnect."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        abort()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
