"""POST /v1/chat/completions, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from app.api.deps import ContextDep, PrincipalDep
from app.errors import invalid_request, server_error
from app.gateway.contract import Principal
from app.serving.body import read_body
from app.serving.context import ModelContext
from app.serving.sampling import chat_sampling_params
from app.serving.schemas import ChatCompletionRequest
from app.serving.streaming import finished_stream, sse, sse_response
from app.serving.structured.plan import StructuredPlan, prepare_chat
from app.serving.token_text import TokenTexts
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

router = APIRouter()


def chat_logprobs(token_texts: TokenTexts, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_texts.text_of(token_id),
            "logprob": logprob,
            "bytes": list(token_texts.bytes_of(token_id)),
        }

    return [
        {**entry(item.token_id, item.logprob), "top_logprobs": [entry(t, lp) for t, lp in item.top]}
        for item in token_texts.shown(logprobs)
    ]


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, server: ContextDep, principal: PrincipalDep) -> Any:
    accepted_at = time.monotonic()
    body = await read_body(request, ChatCompletionRequest, server.settings.max_request_bytes)
    if body.stream_options is not None and not body.stream:
        raise invalid_request("stream_options is only allowed when stream is true.", param="stream_options")
    return await server.with_model(
        body.model,
        lambda context: chat_completion(request, context, principal, body, accepted_at),
        principal=principal,
        kind="chat",
    )


async def chat_completion(
    request: Request, context: ModelContext, principal: Principal, body: ChatCompletionRequest, accepted_at: float
) -> Any:
    async with context.admission.turn(team_of(principal)):  # not first come, first served across teams
        plan, prompt_ids = await run_in_threadpool(prepare_chat, context.tokenizer, body)
        params = plan.constrain(chat_sampling_params(body, len(prompt_ids), context.sampling))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        headers = await context.admit(principal, body.model, request_id, len(prompt_ids), params)
    tracker = RequestTracker(
        context, principal, request_id=request_id, endpoint="chat.completions", accepted_at=accepted_at
    )
    tracker.priority = body.priority or 0
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    try:
        check_fits(context, prompt_ids, params, prompt_param="messages", max_tokens_param=max_tokens_param)
    except Exception:
        tracker.finish("rejected")
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = chat_events(context, tracker, prompt_ids, params, include_usage, plan)
        context.streaming = True
        return sse_response(
            finished_stream(tracker, events, prompt_param="messages", max_tokens_param=max_tokens_param),
            headers,
            tracker,
        )
    response = await chat_response(
        request, context, tracker, prompt_ids, params, bool(body.logprobs), max_tokens_param, plan
    )
    return JSONResponse(response, headers=headers)


async def chat_response(
    request: Request,
    context: ModelContext,
    tracker: RequestTracker,
    prompt_ids: list[int],
    params: SamplingParams,
    with_logprobs: bool,
    max_tokens_param: str,
    plan: StructuredPlan,
) -> dict[str, Any]:
    choices = [Choice() for _ in range(params.n)]
    status = "error"
    try:
        async with abort_on_disconnect(request, lambda: context.engine.abort(tracker.request_id)):
            async for output in engine_outputs(context, tracker, tracker.request_id, prompt_ids, params):
                for delta in output.deltas:
                    choices[delta.index].add(delta)
        status = tracker.final_status()
    except EngineRejected as error:
        status = "rejected"
        raise rejection_error(error, prompt_param="messages", max_tokens_param=max_tokens_param) from None
    except EngineFailure as error:
        raise server_error(f"The engine failed this request: {error}") from None
    finally:
        tracker.finish(status)
    messages = [plan.message(choice.text, choice.finish_reason) for choice in choices]
    return {
        "id": tracker.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": context.model_name,
        "system_fingerprint": None,
        "choices": [
            {
                "index": index,
                "message": message,
                "logprobs": {"content": chat_logprobs(context.token_texts, choice.logprobs), "refusal": None}
                if with_logprobs
                else None,
                "finish_reason": finish_reason,
            }
            for index, (choice, (message, finish_reason)) in enumerate(zip(choices, messages))
        ],
        "usage": tracker.usage(),
    }


async def chat_events(
    context: ModelContext,
    tracker: RequestTracker,
    prompt_ids: list[int],
    params: SamplingParams,
    include_usage: bool,
    plan: StructuredPlan,
) -> AsyncIterator[str]:
    base = {
        "id": tracker.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": context.model_name,
        "system_fingerprint": None,
    }

    def chunk(
        index: int, delta: dict[str, Any], logprobs: list[TokenLogprob] | None = None, finish_reason: str | None = None
    ) -> str:
        choice = {
            "index": index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": None
            if logprobs is None
            else {"content": chat_logprobs(context.token_texts, logprobs), "refusal": None},
        }
        return sse({**base, "choices": [choice]})

    for index in range(params.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    streams = plan.streams(params.n)
    async for output in engine_outputs(context, tracker, tracker.request_id, prompt_ids, params):
        for delta in output.deltas:
            logprobs = delta.logprobs if params.logprobs is not None else None
            pieces = streams.pieces(delta.index, delta.text, delta.finish_reason, bool(delta.logprobs))
            for number, (content, finish_reason) in enumerate(pieces):
                yield chunk(delta.index, content, logprobs if number == 0 else None, finish_reason)
    if include_usage:
        yield sse({**base, "choices": [], "usage": tracker.usage()})
