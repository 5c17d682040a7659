"""/v1/files: upload (multipart), list, read, download and delete a team's files."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile

from app.api.deps import BatchesDep, PrincipalDep
from app.api.pages import list_page
from app.batches.files import UPLOAD_PURPOSES, expiry_after, file_view
from app.errors import OpenAIError, invalid_request
from app.gateway.auth import KeyPrincipal
from app.gateway.contract import Principal
from app.gateway.names import without_unsafe_characters

router = APIRouter()


@router.post("/v1/files")
async def upload_file(request: Request, principal: PrincipalDep, batches: BatchesDep) -> Any:
    await count_against_rate_limits(request, principal)
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload = form.get("file")
        purpose = form.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise invalid_request(f"purpose must be one of {list(UPLOAD_PURPOSES)}; got {purpose!r}.", param="purpose")
        if not isinstance(upload, UploadFile):
            raise invalid_request("Send the file as the multipart field 'file'.", param="file")
        row = await run_in_threadpool(
            batches.files.save,
            team_id=principal.team_id,
            purpose=str(purpose),
            filename=without_unsafe_characters(upload.filename or "").strip() or "upload",
            source=upload.file,
            expires_after=upload_expiry(form.get("expires_after[anchor]"), form.get("expires_after[seconds]")),
        )
    finally:
        await form.close()
    return JSONResponse(file_view(row))


async def count_against_rate_limits(request: Request, principal: Principal) -> None:
    """An upload is a request of the key and its team: it counts against their rpm (429 past it), before
    any of its bytes are read."""
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None or not isinstance(principal, KeyPrincipal) or principal.batch:
        return
    decision = await gateway.limiter.acquire(principal.rate_scopes, 0)
    if not decision.allowed:
        headers = decision.headers()
        raise OpenAIError(
            429,
            f"Rate limit reached for {decision.exceeded} per {gateway.limiter.window_s:g}s; uploads count as requests.",
            type=decision.exceeded,
            code="rate_limit_exceeded",
            headers=headers,
        )


def upload_expiry(anchor: object, seconds: object) -> timedelta | None:
    """The upload's expires_after, as the openai client sends it (form fields expires_after[anchor] and
    expires_after[seconds]); None when it sent none."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise invalid_request("expires_after.anchor must be 'created_at'.", param="expires_after.anchor")
    try:
        whole = int(str(seconds))
    except ValueError:
        whole = -1
    return expiry_after(whole, "expires_after")


@router.get("/v1/files")
async def list_files(
    principal: PrincipalDep,
    batches: BatchesDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> dict[str, Any]:
    rows, has_more = await run_in_threadpool(
        batches.files.page,
        team_id=principal.team_id,
        purpose=purpose,
        after=after,
        limit=limit,
        ascending=order == "asc",
    )
    data = [file_view(row) for row in rows]
    return list_page(data, has_more)


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, principal: PrincipalDep, batches: BatchesDep) -> dict[str, Any]:
    row = await run_in_threadpool(batches.files.get, team_id=principal.team_id, file_id=file_id)
    return file_view(row)


@router.get("/v1/files/{file_id}/content")
async def get_file_content(file_id: str, principal: PrincipalDep, batches: BatchesDep) -> FileResponse:
    row, path = await run_in_threadpool(batches.files.open, team_id=principal.team_id, file_id=file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=row.filename)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, principal: PrincipalDep, batches: BatchesDep) -> dict[str, Any]:
    await run_in_threadpool(batches.files.delete, team_id=principal.team_id, file_id=file_id)
    return {"id": file_id, "object": "file", "deleted": True}
