"""POST /v1/completions (legacy): one or several prompts, text or token ids, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from app.api.deps import ContextDep, PrincipalDep
from app.errors import invalid_request, server_error
from app.gateway.contract import Principal
from app.serving.body import read_body
from app.serving.context import ModelContext
from app.serving.prompts import completion_prompt_ids
from app.serving.sampling import completion_sampling_params
from app.serving.schemas import CompletionRequest
from app.serving.streaming import finished_stream, merge, sse, sse_response
from app.serving.token_text import TokenTexts, decoded
from app.serving.tracker import (
    Choice,
    EngineFailure,
    RequestTracker,
    abort_on_disconnect,
    check_fits,
    engine_outputs,
    rejection_error,
    team_of,
)
from engine.async_engine import EngineRejected
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.outputs import RequestOutput

router = APIRouter()


def completion_logprobs(token_texts: TokenTexts, logprobs: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    logprobs = token_texts.shown(logprobs)
    tokens = [token_texts.text_of(item.token_id) for item in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in logprobs],
        "top_logprobs": [{token_texts.text_of(t): lp for t, lp in item.top} for item in logprobs],
        "text_offset": offsets,
    }


class PreparedPrompt:
    def __init__(self, engine_request_id: str, ids: list[int], text: str, params: SamplingParams) -> None:
        self.engine_request_id = engine_request_id
        self.ids = ids
        self.text = text  # what echo repeats
        self.params = params


@router.post("/v1/completions")
async def create_completion(request: Request, server: ContextDep, principal: PrincipalDep) -> Any:
    accepted_at = time.monotonic()
    body = await read_body(request, CompletionRequest, server.settings.max_request_bytes)
    if body.stream_options is not None and not body.stream:
        raise invalid_request("stream_options is only allowed when stream is true.", param="stream_options")
    if body.echo and body.logprobs is not None:
        raise invalid_request("echo with logprobs (prompt logprobs) is not supported.", param="echo")
    if body.suffix:
        raise invalid_request("suffix is not supported.", param="suffix")
    return await server.with_model(
        body.model,
        lambda context: completion(request, context, principal, body, accepted_at),
        principal=principal,
        kind="chat",
    )


async def completion(
    request: Request, context: ModelContext, principal: Principal, body: CompletionRequest, accepted_at: float
) -> Any:
    request_id = f"cmpl-{uuid.uuid4().hex}"
    async with context.admission.turn(team_of(principal)):  # not first come, first served across teams
        prompts = await run_in_threadpool(prepare_prompts, context, body, request_id)
        prompt_tokens = sum(len(p.ids) for p in prompts)
        headers = await context.admit(
            principal, body.model, request_id, prompt_tokens, prompts[0].params, prompts=len(prompts)
        )
    tracker = RequestTracker(context, principal, request_id=request_id, endpoint="completions", accepted_at=accepted_at)
    tracker.priority = body.priority or 0
    try:
        for prompt in prompts:
            check_fits(context, prompt.ids, prompt.params, prompt_param="prompt", max_tokens_param="max_tokens")
    except Exception:
        tracker.finish("rejected")
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = completion_events(context, tracker, prompts, bool(body.echo), include_usage)
        context.streaming = True
        return sse_response(
            finished_stream(tracker, events, prompt_param="prompt", max_tokens_param="max_tokens"), headers, tracker
        )
    return JSONResponse(await completion_response(request, context, tracker, prompts, bool(body.echo)), headers=headers)


def prepare_prompts(context: ModelContext, body: CompletionRequest, request_id: str) -> list[PreparedPrompt]:
    tokenizer = context.tokenizer
    many = len(body.prompt) > 1
    prepared = []
    for index, prompt in enumerate(body.prompt):
        ids = completion_prompt_ids(tokenizer, prompt, index, many)
        text = prompt if isinstance(prompt, str) else decoded(tokenizer, ids)
        params = completion_sampling_params(body, len(ids), context.sampling)
        prepared.append(PreparedPrompt(f"{request_id}-{index}", ids, text, params))
    return prepared


def _engine_streams(
    context: ModelContext, tracker: RequestTracker, prompts: list[PreparedPrompt]
) -> list[AsyncIterator[RequestOutput]]:
    return [engine_outputs(context, tracker, p.engine_request_id, p.ids, p.params) for p in prompts]


async def completion_response(
    request: Request, context: ModelContext, tracker: RequestTracker, prompts: list[PreparedPrompt], echo: bool
) -> dict[str, Any]:
    n = prompts[0].params.n
    choices = [Choice() for _ in range(len(prompts) * n)]
    status = "error"

    def abort_all() -> None:
        for prompt in prompts:
            context.engine.abort(prompt.engine_request_id)

    try:
        async with abort_on_disconnect(request, abort_all):
            async for prompt_index, output in merge(_engine_streams(context, tracker, prompts)):
                for delta in output.deltas:
                    choices[prompt_index * n + delta.index].add(delta)
        status = tracker.final_status()
    except EngineRejected as error:
        status = "rejected"
        raise rejection_error(error, prompt_param="prompt", max_tokens_param="max_tokens") from None
    except EngineFailure as error:
        raise server_error(f"The engine failed this request: {error}") from None
    finally:
        tracker.finish(status)
    with_logprobs = prompts[0].params.logprobs is not None
    results = []
    for index, choice in enumerate(choices):
        prefix = prompts[index // n].text if echo else ""
        results.append(
            {
                "index": index,
                "text": prefix + choice.text,
                "logprobs": completion_logprobs(context.token_texts, choice.logprobs, len(prefix))
                if with_logprobs
                else None,
                "finish_reason": choice.finish_reason,
            }
        )
    return {
        "id": tracker.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": context.model_name,
        "system_fingerprint": None,
        "choices": results,
        "usage": tracker.usage(),
    }


async def completion_events(
    context: ModelContext, tracker: RequestTracker, prompts: list[PreparedPrompt], echo: bool, include_usage: bool
) -> AsyncIterator[str]:
    base = {
        "id": tracker.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": context.model_name,
        "system_fingerprint": None,
    }
    n = prompts[0].params.n
    with_logprobs = prompts[0].params.logprobs is not None
    text_offsets = [0] * (len(prompts) * n)

    def chunk(index: int, text: str, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None) -> str:
        text_offsets[index] += len(text)
        return sse(
            {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
        )

    if echo:
        for index in range(len(text_offsets)):
            yield chunk(index, prompts[index // n].text)
    async for prompt_index, output in merge(_engine_streams(context, tracker, prompts)):
        for delta in output.deltas:
            if delta.text or delta.finish_reason or delta.logprobs:
                index = prompt_index * n + delta.index
                logprobs = (
                    completion_logprobs(context.token_texts, delta.logprobs or [], text_offsets[index])
                    if with_logprobs
                    else None
                )
                yield chunk(index, delta.text, logprobs, delta.finish_reason)
    if include_usage:
        yield sse({**base, "choices": [], "usage": tracker.usage()})
