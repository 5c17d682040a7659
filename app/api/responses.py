"""The Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}, its
input items, and cancel (which only background responses allow; we run none).

A response runs as a chat completion does (app.structured plans tools and formats, the gateway admits
and meters, the engine generates); only the shapes in and out differ (app.serving.responses)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from app.api.deps import ContextDep, PrincipalDep
from app.api.pages import list_page
from app.errors import OpenAIError, invalid_request, server_error
from app.gateway.contract import Principal
from app.serving.body import read_body
from app.serving.context import ModelContext
from app.serving.responses.items import chat_messages, message_text, new_item_id, normalize_input, output_items
from app.serving.responses.output import ResponseEvents, ResponseHeader, final_status, response_usage
from app.serving.responses.request import ResponsesRequest, check_fields
from app.serving.responses.store import ResponseStore
from app.serving.responses.translate import chat_request, renamed_errors
from app.serving.sampling import chat_sampling_params
from app.serving.schemas import ChatCompletionRequest
from app.serving.streaming import sse_response
from app.serving.structured.plan import StructuredPlan, prepare_chat
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
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("tokenmill.responses")
router = APIRouter()
PROMPT_PARAM, MAX_TOKENS_PARAM = "input", "max_output_tokens"

Saver = Callable[[dict[str, Any]], None]
Result = TypeVar("Result")


async def in_store(call: Callable[..., Result], *args: object) -> Result:
    """A store call off the event loop; a database that is away is a 503 to retry, not a 500."""
    try:
        return await run_in_threadpool(call, *args)
    except SQLAlchemyError as error:
        log.warning("response store unavailable: %s", type(error).__name__)
        raise OpenAIError(
            503,
            "The response store is unavailable; please retry shortly.",
            type="server_error",
            code="service_unavailable",
            headers={"Retry-After": "2"},
        ) from None


def response_not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


@router.post("/v1/responses")
async def create_response(request: Request, server: ContextDep, principal: PrincipalDep) -> Any:
    accepted_at = time.monotonic()
    body = await read_body(request, ResponsesRequest, server.settings.max_request_bytes)
    check_fields(body)
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:  # another team's response is as absent as a missing one
        previous = await in_store(server.responses.get, body.previous_response_id, principal.team_id)
        if previous is None:
            raise response_not_found(body.previous_response_id, param="previous_response_id")
        earlier = previous.conversation
    assert body.input is not None  # check_fields refused a request without one
    own_input = normalize_input(body.input, earlier)
    conversation = [*earlier, *own_input]
    return await server.with_model(
        body.model,
        lambda context: run_response(
            request, context, principal, body, conversation, own_input, server.responses, accepted_at
        ),
        principal=principal,
        kind="chat",
    )


async def run_response(
    request: Request,
    context: ModelContext,
    principal: Principal,
    body: ResponsesRequest,
    conversation: list[dict[str, Any]],
    own_input: list[dict[str, Any]],
    store: ResponseStore,
    accepted_at: float,
) -> Any:
    check_before_rendering(body, conversation, context.engine.max_model_len)
    async with context.admission.turn(team_of(principal)):  # not first come, first served across teams
        chat_body, plan, prompt_ids = await run_in_threadpool(
            prepare, context.tokenizer, body, conversation, context.engine.max_model_len
        )
        tools = [{"type": "function", **tool["function"]} for tool in chat_body.tools or ()]  # as run: strict
        params = renamed_errors(
            lambda: plan.constrain(chat_sampling_params(chat_body, len(prompt_ids), context.sampling))
        )
        header = ResponseHeader(
            id=new_item_id("resp"),
            model=context.model_name,
            body=body,
            tools=tools,
            temperature=params.temperature,
            top_p=params.top_p,
        )
        headers = await context.admit(principal, body.model, header.id, len(prompt_ids), params)
    tracker = RequestTracker(context, principal, request_id=header.id, endpoint="responses", accepted_at=accepted_at)
    try:
        check_fits(context, prompt_ids, params, prompt_param=PROMPT_PARAM, max_tokens_param=MAX_TOKENS_PARAM)
    except Exception:
        tracker.finish("rejected")
        raise
    # Only this turn's items: the earlier ones are stored with their own responses (the chain rebuilds them).
    save = functools.partial(store.save, principal.team_id, input_items=own_input) if body.stores else None
    if body.stream:
        obfuscate = bool((body.stream_options or {}).get("include_obfuscation"))
        context.streaming = True
        return sse_response(
            response_events(context, tracker, header, prompt_ids, params, plan, save, obfuscate), headers, tracker
        )
    response = await whole_response(request, context, tracker, header, prompt_ids, params, plan, save)
    return JSONResponse(response, headers=headers)


MAX_CONVERSATION_ITEMS = 10_000  # input items of one request, earlier turns included


def check_before_rendering(body: ResponsesRequest, conversation: list[dict[str, Any]], max_model_len: int) -> None:
    """What can be refused without rendering or tokenizing anything: a conversation of too many items, and
    a max_output_tokens that leaves no room for any input (truncation would drop every turn to find out)."""
    if len(conversation) > MAX_CONVERSATION_ITEMS:
        raise invalid_request(
            f"The conversation has {len(conversation)} items; at most {MAX_CONVERSATION_ITEMS} are supported.",
            param="input",
        )
    if body.max_output_tokens is not None and body.max_output_tokens >= max_model_len:
        raise invalid_request(
            f"max_output_tokens ({body.max_output_tokens}) leaves no room for the input in this model's context "
            f"of {max_model_len} tokens.",
            param=MAX_TOKENS_PARAM,
        )


def prepare(
    tokenizer: PreTrainedTokenizerBase, body: ResponsesRequest, conversation: list[dict[str, Any]], max_model_len: int
) -> tuple[ChatCompletionRequest, StructuredPlan, list[int]]:
    """The request in chat's shape, the plan and the prompt's token ids. With truncation 'auto', the oldest
    turns are left out of the prompt (never out of what is stored) until it fits: each turn's size is
    counted once and as many turns as the overflow needs are dropped at a time, so the conversation is
    rendered a few times, not once per dropped turn (2,000 items took 76 s that way). Blocking."""

    def render(items: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, StructuredPlan, list[int]]:
        chat_body = renamed_errors(lambda: chat_request(body, chat_messages(body.instructions, items)))
        plan, prompt_ids = renamed_errors(lambda: prepare_chat(tokenizer, chat_body))
        return chat_body, plan, prompt_ids

    prepared = render(conversation)
    room = max_model_len - (body.max_output_tokens or 1)
    if body.truncation != "auto" or len(prepared[2]) <= room:
        return prepared
    kept, turns = split_turns(conversation)
    sizes = turn_sizes(tokenizer, turns, len(prepared[2]), len(conversation))
    dropped = 0
    while len(prepared[2]) > room and dropped < len(turns) - 1:
        overflow, freed = len(prepared[2]) - room, 0
        while dropped < len(turns) - 1 and freed < overflow:  # drop from the front by counting
            freed += sizes[dropped]
            dropped += 1
        prepared = render(kept + [item for turn in turns[dropped:] for item in turn])
    return prepared


def split_turns(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """The system and developer messages (always kept), and the rest as turns: each user message with what
    follows it up to the next one (anything before the first user message belongs to the first turn)."""
    kept = [item for item in conversation if item.get("role") in ("system", "developer")]
    turns: list[list[dict[str, Any]]] = []
    for item in conversation:
        if item.get("role") in ("system", "developer"):
            continue
        if item.get("role") == "user" and turns and any(i.get("role") == "user" for i in turns[-1]):
            turns.append([item])
        elif turns:
            turns[-1].append(item)
        else:
            turns.append([item])
    return kept, turns


def turn_sizes(tokenizer: Any, turns: list[list[dict[str, Any]]], rendered_tokens: int, item_count: int) -> list[int]:
    """Each turn's tokens, estimated in one pass: its texts tokenized once (in one batch), plus each item's
    share of what the template adds around them."""
    texts = [item_text(item) for turn in turns for item in turn]
    counts = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    overhead = max(0, rendered_tokens - sum(counts)) // max(1, item_count)
    sizes, position = [], 0
    for turn in turns:
        sizes.append(sum(counts[position : position + len(turn)]) + overhead * len(turn))
        position += len(turn)
    return sizes


def item_text(item: dict[str, Any]) -> str:
    if item["type"] == "message":
        return message_text(item)
    if item["type"] == "function_call":
        return f"{item['name']} {item['arguments']}"
    return str(item.get("output", ""))


async def whole_response(
    request: Request,
    context: ModelContext,
    tracker: RequestTracker,
    header: ResponseHeader,
    prompt_ids: list[int],
    params: SamplingParams,
    plan: StructuredPlan,
    save: Saver | None,
) -> dict[str, Any]:
    choice = Choice()
    status = "error"
    try:
        async with abort_on_disconnect(request, lambda: context.engine.abort(tracker.request_id)):
            async for output in engine_outputs(context, tracker, tracker.request_id, prompt_ids, params):
                for delta in output.deltas:
                    choice.add(delta)
        status = tracker.final_status()
    except EngineRejected as error:
        status = "rejected"
        raise rejection_error(error, prompt_param=PROMPT_PARAM, max_tokens_param=MAX_TOKENS_PARAM) from None
    except EngineFailure as error:
        raise server_error(f"The engine failed this request: {error}") from None
    finally:
        tracker.finish(status)
    message, finish_reason = plan.message(choice.text, choice.finish_reason)
    state, incomplete_reason = final_status(finish_reason)
    items = output_items(message, "completed" if state == "completed" else "incomplete")
    response = header.response(state, items, response_usage(tracker.usage()), incomplete_reason=incomplete_reason)
    if save is not None and status == "ok":
        await in_store(save, response)
    return response


async def response_events(
    context: ModelContext,
    tracker: RequestTracker,
    header: ResponseHeader,
    prompt_ids: list[int],
    params: SamplingParams,
    plan: StructuredPlan,
    save: Saver | None,
    obfuscate: bool,
) -> AsyncIterator[str]:
    """The typed events, ending with response.completed (or .incomplete, .failed). The response is stored
    before the last event goes out, so a client that reads it back at once finds it. A client that goes
    away cancels us: the engine request is aborted and nothing is stored."""
    events = ResponseEvents(header, obfuscate)
    status = "aborted"
    try:
        for event in events.started():
            yield event
        streams = plan.streams(1)
        finish_reason = None
        async for output in engine_outputs(context, tracker, tracker.request_id, prompt_ids, params):
            for delta in output.deltas:
                for piece, _ in streams.pieces(0, delta.text, delta.finish_reason, False):
                    for event in events.feed(piece):
                        yield event
                finish_reason = delta.finish_reason or finish_reason
        for event in events.finished(finish_reason):
            yield event
        state, incomplete_reason = final_status(finish_reason)
        response = header.response(
            state, events.output, response_usage(tracker.usage()), incomplete_reason=incomplete_reason
        )
        if save is not None:
            await in_store(save, response)
        status = tracker.final_status()
        yield events.event(f"response.{state}", response=response)
    except EngineRejected as error:
        status = "rejected"
        yield failed(events, rejection_error(error, prompt_param=PROMPT_PARAM, max_tokens_param=MAX_TOKENS_PARAM))
    except EngineFailure as error:
        status = "error"
        yield failed(events, server_error(f"The engine failed this request: {error}"))
    except OpenAIError as error:  # the store was away: the answer was made but could not be kept
        status = "error"
        yield failed(events, error)
    except Exception:
        status = "error"
        log.exception("response stream %s failed", tracker.request_id)
        yield failed(events, server_error())
    finally:
        tracker.finish(status)


def failed(events: ResponseEvents, error: OpenAIError) -> str:
    response = events.header.response(
        "failed", events.output, None, error={"code": error.code or "server_error", "message": error.message}
    )
    return events.event("response.failed", response=response)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, server: ContextDep, principal: PrincipalDep) -> Any:
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise invalid_request(
            "Streaming a stored response again is not supported.", param="stream", code="unsupported_parameter"
        )
    stored = await in_store(server.responses.get, response_id, principal.team_id)
    if stored is None:
        raise response_not_found(response_id)
    return stored.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, server: ContextDep, principal: PrincipalDep) -> dict[str, Any]:
    if not await in_store(server.responses.delete, response_id, principal.team_id):
        raise response_not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, server: ContextDep, principal: PrincipalDep) -> Any:
    if await in_store(server.responses.get, response_id, principal.team_id) is None:
        raise response_not_found(response_id)
    raise invalid_request(
        "Only responses created with background=true can be cancelled; this server runs none.", code="not_background"
    )


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str, request: Request, server: ContextDep, principal: PrincipalDep
) -> dict[str, Any]:
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request("Invalid value for 'order': expected 'asc' or 'desc'.", param="order")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise invalid_request("Invalid value for 'limit': expected an integer from 1 to 100.", param="limit")
    stored = await in_store(server.responses.get, response_id, principal.team_id)
    if stored is None:
        raise response_not_found(response_id)
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid_request(f"No input item with id '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return list_page(page, has_more=len(items) > len(page))
