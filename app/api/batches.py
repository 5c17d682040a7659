"""/v1/batches: create a batch from an uploaded file, list, read and cancel a team's batches."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import BatchesDep, PrincipalDep
from app.api.pages import list_page
from app.batches.files import expiry_after
from app.batches.jobs import ENDPOINTS, batch_view, completion_window_length
from app.batches.lines import count_lines
from app.errors import invalid_request
from app.serving.body import read_body

router = APIRouter()


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]  # the output file's own creation, as OpenAI counts it
    seconds: int


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    output_expires_after: ExpiresAfter | None = None  # the output and error files expire that long after written


@router.post("/v1/batches")
async def create_batch(request: Request, principal: PrincipalDep, batches: BatchesDep) -> dict[str, Any]:
    body = await read_body(request, BatchCreate, 64 * 1024)
    if body.endpoint not in ENDPOINTS:
        raise invalid_request(f"endpoint must be one of {list(ENDPOINTS)}; got {body.endpoint!r}.", param="endpoint")
    completion_window_length(body.completion_window)
    expires_after = body.output_expires_after
    if expires_after is not None:
        expiry_after(expires_after.seconds, "output_expires_after")
    row, path = await run_in_threadpool(batches.files.open, team_id=principal.team_id, file_id=body.input_file_id)
    if row.purpose != "batch":
        raise invalid_request(
            f"The input file's purpose is {row.purpose!r}; upload it with purpose 'batch'.", param="input_file_id"
        )
    total = await run_in_threadpool(count_lines, path, batches.max_line_bytes)
    if total == 0:
        raise invalid_request("The input file has no requests.", param="input_file_id", code="empty_file")
    if total > batches.max_batch_lines:
        raise invalid_request(
            f"The input file has {total} requests; a batch may have at most {batches.max_batch_lines}.",
            param="input_file_id",
            code="too_many_requests",
        )
    job = await run_in_threadpool(
        batches.jobs.create,
        team_id=principal.team_id,
        key_id=principal.key_id,
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        metadata=body.metadata,
        total=total,
        output_expires_after_s=None if expires_after is None else expires_after.seconds,
    )
    batches.runner.wake()
    return batch_view(job)


@router.get("/v1/batches")
async def list_batches(
    principal: PrincipalDep,
    batches: BatchesDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    rows, has_more = await run_in_threadpool(batches.jobs.page, team_id=principal.team_id, after=after, limit=limit)
    data = [batch_view(row) for row in rows]
    return list_page(data, has_more)


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, principal: PrincipalDep, batches: BatchesDep) -> dict[str, Any]:
    return batch_view(await run_in_threadpool(batches.jobs.get, team_id=principal.team_id, batch_id=batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, principal: PrincipalDep, batches: BatchesDep) -> dict[str, Any]:
    job = await run_in_threadpool(batches.jobs.cancel, team_id=principal.team_id, batch_id=batch_id)
    batches.runner.wake(cancelled=batch_id)
    return batch_view(job)
