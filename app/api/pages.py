"""OpenAI's envelope for a page of a cursor-paged list (files, batches, a response's input items)."""

from __future__ import annotations

from typing import Any


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """`first_id` / `last_id` are the cursors a client passes back as `after` (None on an empty page)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
