"""One streamed chat completion, timed as a user sees it: time to the first content token, the gaps
between content chunks, end to end, and the usage the server reports at the end. The benches that drive
servers over HTTP (serve_bench, latency_bench) share it, so they time the same way."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def stream_chat(http: httpx.AsyncClient, body: dict[str, Any]) -> StreamResult:
    """POSTs `body` (with stream true and stream_options.include_usage) to /v1/chat/completions. Output
    tokens come from the final usage chunk; a server that sends none is counted by content chunks."""
    started = time.perf_counter()
    result = StreamResult(ok=False)
    last: float | None = None
    chunks = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    chunks += 1
                    if last is None:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - started
        result.output_tokens = result.output_tokens or chunks
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


def outcome(results: list[StreamResult], duration: float) -> dict[str, Any]:
    """The part of a level's summary every bench reports: how many finished, failed, and why."""
    done = [r for r in results if r.ok]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration,
    }
