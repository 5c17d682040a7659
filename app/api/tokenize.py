"""POST /tokenize and POST /detokenize, in vLLM's shapes. Chat messages are rendered exactly as
/v1/chat/completions renders them (tools included), so `count` equals that request's
usage.prompt_tokens; a prompt is encoded as /v1/completions encodes it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict

from app.api.deps import ContextDep, PrincipalDep
from app.errors import invalid_request
from app.serving.body import read_body
from app.serving.context import ModelContext
from app.serving.schemas import ChatCompletionRequest
from app.serving.structured.plan import prepare_chat

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # prompt: true by default; messages: only false (the template adds them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(request: Request, server: ContextDep, principal: PrincipalDep) -> Any:
    body = await read_body(request, TokenizeRequest, server.settings.max_request_bytes)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("Give exactly one of 'prompt' and 'messages'.", param="prompt")
    if body.messages is not None and body.add_special_tokens:
        raise invalid_request(
            "'add_special_tokens' must be false with 'messages': the chat template adds them.",
            param="add_special_tokens",
        )
    if body.messages is not None and not body.add_generation_prompt:
        raise invalid_request(
            "Only add_generation_prompt=true is supported: it is what a chat request counts.",
            param="add_generation_prompt",
        )

    async def handle(context: ModelContext) -> Any:  # a JSON body; with_model passes it through
        tokenizer = context.tokenizer
        if body.messages is not None:
            chat = {
                "model": body.model,
                "messages": body.messages,
                "tools": body.tools,
                "tool_choice": body.tool_choice,
            }
            chat_body = ChatCompletionRequest.model_validate(
                {key: value for key, value in chat.items() if value is not None}
            )
            _, ids = await run_in_threadpool(prepare_chat, tokenizer, chat_body)
        else:
            ids = await run_in_threadpool(
                tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens is not False
            )
        result = {"count": len(ids), "max_model_len": context.engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return result

    return await server.with_model(body.model, handle, principal=principal, kind="chat")


@router.post("/detokenize")
async def detokenize(request: Request, server: ContextDep, principal: PrincipalDep) -> Any:
    body = await read_body(request, DetokenizeRequest, server.settings.max_request_bytes)

    async def handle(context: ModelContext) -> Any:  # a JSON body; with_model passes it through
        tokenizer = context.tokenizer
        if any(not 0 <= token < len(tokenizer) for token in body.tokens):
            raise invalid_request(f"Token ids must be between 0 and {len(tokenizer) - 1}.", param="tokens")
        return {"prompt": await run_in_threadpool(tokenizer.decode, body.tokens)}

    return await server.with_model(body.model, handle, principal=principal, kind="chat")
