"""POST /v1/embeddings: strings or token ids in, vectors out as floats or base64 (little-endian float32,
which the official openai client asks for unless told otherwise). Admitted and metered through the
gateway like the other /v1 routes; the encoder runs on the process's one embedding worker
(app/serving/encoder_queue.py), a batch at a time."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, Literal

import torch
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import field_validator

from app.api.deps import ContextDep, PrincipalDep
from app.errors import OpenAIError, invalid_request
from app.gateway.contract import Principal, UsageRecord
from app.serving.body import read_body
from app.serving.context import ModelContext
from app.serving.encoder_queue import EncoderQueue
from app.serving.schemas import Body
from app.serving.tracker import abort_on_disconnect
from engine.embeddings import EmbeddingModel, length_sorted_batches

log = logging.getLogger("tokenmill.embeddings")
router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's limits per request
MAX_TOTAL_TOKENS = 300_000
ENCODER_QUEUE = EncoderQueue()

EmbeddingInput = str | list[int]


def _is_token_ids(item: Any) -> bool:
    return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)


class EmbeddingRequest(Body):
    model: str
    input: list[EmbeddingInput]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> list[EmbeddingInput]:
        """A string, a list of strings, a list of token ids, or a list of token-id lists."""
        if isinstance(value, str) or (_is_token_ids(value) and value):
            value = [value]
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(item, str) or _is_token_ids(item) for item in value)
        ):
            raise ValueError(
                "input must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists, and not empty"
            )
        if len(value) > MAX_INPUTS:
            raise ValueError(f"input may hold at most {MAX_INPUTS} items, got {len(value)}")
        if any(len(item) == 0 for item in value):
            raise ValueError("input must not contain an empty string or an empty token list")
        return value


def embedder_of(context: ModelContext) -> EmbeddingModel:
    served = context.served
    if served.kind != "embedding" or served.embedder is None:
        raise invalid_request(f"`{served.name}` is not an embedding model; /v1/embeddings needs one.", param="model")
    embedder: EmbeddingModel = served.embedder
    return embedder


def check_dimensions(name: str, model: EmbeddingModel, dimensions: int | None) -> None:
    if dimensions is not None and dimensions != model.dimensions:
        raise invalid_request(
            f"`{name}` makes {model.dimensions}-dimensional embeddings and cannot shorten them: "
            f"omit dimensions or set it to {model.dimensions}.",
            param="dimensions",
        )


def input_token_ids(model: EmbeddingModel, inputs: list[EmbeddingInput]) -> list[list[int]]:
    """Texts tokenized (with the encoder's special tokens); token ids checked against its vocabulary."""
    texts = [(i, text) for i, text in enumerate(inputs) if isinstance(text, str)]
    token_ids: list[list[int]] = [item if not isinstance(item, str) else [] for item in inputs]
    for (index, _), ids in zip(texts, model.token_ids([text for _, text in texts]) if texts else []):
        token_ids[index] = ids
    for index, item in enumerate(inputs):
        if not isinstance(item, str) and any(t < 0 or t >= model.vocab_size for t in item):
            raise invalid_request(
                f"Input {index} holds token ids outside this model's vocabulary (0 to {model.vocab_size - 1}).",
                param="input",
            )
    return token_ids


def check_lengths(name: str, model: EmbeddingModel, token_ids: list[list[int]]) -> None:
    """Over-long input is refused, as OpenAI refuses it, rather than silently embedded in part."""
    for index, ids in enumerate(token_ids):
        if len(ids) > model.max_input_tokens:
            raise invalid_request(
                f"Input {index} is {len(ids)} tokens long; `{name}` accepts at most {model.max_input_tokens} "
                "tokens per input. Shorten it or split it into several inputs.",
                param="input",
                code="context_length_exceeded",
            )
    total = sum(len(ids) for ids in token_ids)
    if total > MAX_TOTAL_TOKENS:
        raise invalid_request(
            f"The inputs add up to {total} tokens; at most {MAX_TOTAL_TOKENS} per request.",
            param="input",
            code="context_length_exceeded",
        )


async def embed(request: Request, model: EmbeddingModel, token_ids: list[list[int]]) -> torch.Tensor | None:
    """Vectors in input order, or None when the client went away (the remaining batches are skipped)."""
    vectors = torch.empty(len(token_ids), model.dimensions, dtype=torch.float32)
    gone = asyncio.Event()
    async with abort_on_disconnect(request, gone.set):
        for batch in length_sorted_batches(token_ids):
            if gone.is_set():
                return None
            vectors[batch] = await ENCODER_QUEUE.encode(model, [token_ids[i] for i in batch])
    return vectors


def encoded(vector: torch.Tensor, encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


def report_usage(
    context: ModelContext, principal: Principal, *, request_id: str, prompt_tokens: int, started_at: float, status: str
) -> None:
    record = UsageRecord(
        request_id=request_id,
        team_id=principal.team_id,
        key_id=principal.key_id,
        model=context.model_name,
        endpoint="embeddings",
        prompt_tokens=prompt_tokens,
        cached_tokens=0,
        completion_tokens=0,
        latency_seconds=time.monotonic() - started_at,
        time_to_first_token_seconds=None,
        status=status,
        finished_at=time.time(),
        price=context.price,
    )
    try:
        context.gateway.request_finished(record)
    except Exception:  # metering must never break a response that is already on its way
        log.exception("usage hook failed for %s", request_id)
    meter = getattr(context, "cost_meter", None)  # real cost: an embedding model produces the tokens it reads
    if meter is not None and status == "ok":
        meter.record(prompt_tokens, context.model_name)


@router.post("/v1/embeddings")
async def create_embeddings(request: Request, context: ContextDep, principal: PrincipalDep) -> Any:
    body = await read_body(request, EmbeddingRequest, context.settings.max_request_bytes)
    return await context.with_model(
        body.model, lambda bound: serve_embeddings(request, bound, principal, body), principal=principal
    )


async def serve_embeddings(
    request: Request, context: ModelContext, principal: Principal, body: EmbeddingRequest
) -> JSONResponse:
    name, model = context.model_name, embedder_of(context)
    check_dimensions(name, model, body.dimensions)
    request_id = f"embd-{uuid.uuid4().hex}"
    started_at = time.monotonic()
    token_ids = await run_in_threadpool(input_token_ids, model, body.input)
    prompt_tokens = sum(len(ids) for ids in token_ids)
    # Reserved like any request: its priced tokens against the budgets, a seat of the key's in-flight cap.
    headers = await context.gateway.admit(
        principal,
        model=context.access_name(principal, body.model),
        prompt_tokens=prompt_tokens,
        max_tokens=0,
        request_id=request_id,
        price=context.price,
    )
    status, metered_tokens, vectors = "error", prompt_tokens, None
    try:
        try:
            check_lengths(name, model, token_ids)
        except OpenAIError:
            status, metered_tokens = "rejected", 0
            raise
        vectors = await embed(request, model, token_ids)
        status = "ok" if vectors is not None else "aborted"
    except asyncio.CancelledError:
        status = "aborted"
        raise
    finally:
        report_usage(
            context,
            principal,
            request_id=request_id,
            prompt_tokens=metered_tokens,
            started_at=started_at,
            status=status,
        )
    if vectors is None:
        return JSONResponse({}, status_code=499)  # nobody is listening any more
    data = [
        {"object": "embedding", "index": index, "embedding": encoded(vector, body.encoding_format)}
        for index, vector in enumerate(vectors)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        },
        headers=headers,
    )
