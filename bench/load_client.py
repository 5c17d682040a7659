"""A cheap HTTP/1.1 load generator, so a server benchmark measures the server and not its client.

Keep-alive connections on asyncio protocols (uvloop when installed); each request is pre-built bytes
(one per API key, used in turn); a response is read by its Content-Length and judged by its status
line only. On one core it drives thousands of requests/s, so at the rates we measure it needs a few
percent of a core (reported as `client_cpu_s`, next to what it measured).

Two ways to load a server:
  closed(...)  `concurrency` connections, each sends its next request as soon as the last is answered:
               the most the server can do (latency is then mostly queueing: Little's law).
  paced(...)   requests arrive at a fixed rate over `concurrency` connections (open loop); latency counts
               from the moment a request was due, so a server that falls behind is charged for it
               (no coordinated omission). This is "N requests/s sustained, at what latency".
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)  # of answered requests, in completion order
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0  # connections lost, malformed responses
    elapsed_s: float = 0.0
    client_cpu_s: float = 0.0  # user + system CPU of this process during the run

    @property
    def answered(self) -> int:
        return len(self.latencies_s)

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)

    @property
    def failures(self) -> int:
        return self.errors + sum(n for status, n in self.statuses.items() if status != 200)


def build_requests(host: str, port: int, path: str, body: bytes, tokens: list[str] | None) -> list[bytes]:
    """One pre-built POST per token (or a single one without auth)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
    )
    if not tokens:
        return [head.encode() + b"\r\n" + body]
    return [(head + f"Authorization: Bearer {token}\r\n\r\n").encode() + body for token in tokens]


class _Connection(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("connection closed")
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(self.lost)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is None or self.waiter.done():
            return
        try:
            status = self._complete_response()
        except ValueError as error:
            self.waiter.set_exception(error)
            return
        if status is not None:
            self.waiter.set_result(status)

    def _complete_response(self) -> int | None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buffer[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            raise ValueError("response without Content-Length (chunked responses are not supported)")
        line_end = head.find(b"\r\n", at + 2)
        length = int(head[at + 17 : line_end if line_end >= 0 else len(head)])
        total = end + 4 + length
        if len(self.buffer) < total:
            return None
        status = int(head[9:12])
        del self.buffer[:total]
        return status

    async def request(self, payload: bytes) -> int:
        if self.lost is not None:
            raise self.lost
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return await self.waiter


async def _connect(host: str, port: int, count: int) -> list[_Connection]:
    loop = asyncio.get_running_loop()
    connections = []
    for _ in range(count):
        _, protocol = await loop.create_connection(_Connection, host, port)
        connections.append(protocol)
    return connections


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _send(connection: _Connection, payload: bytes, due: float, result: LoadResult) -> bool:
    """One request; False when the connection is gone."""
    try:
        status = await connection.request(payload)
    except (ConnectionError, OSError, ValueError):
        result.errors += 1
        return False
    result.latencies_s.append(time.perf_counter() - due)
    result.statuses[status] = result.statuses.get(status, 0) + 1
    return True


async def closed(host: str, port: int, requests: list[bytes], total: int, concurrency: int) -> LoadResult:
    """`total` requests over `concurrency` connections, each as fast as the server answers."""
    connections = await _connect(host, port, concurrency)
    result = LoadResult()
    counter = iter(range(total))

    async def worker(connection: _Connection) -> None:
        for i in counter:
            if not await _send(connection, requests[i % len(requests)], time.perf_counter(), result):
                return

    cpu, started = _cpu_s(), time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    result.elapsed_s, result.client_cpu_s = time.perf_counter() - started, _cpu_s() - cpu
    for connection in connections:
        connection.transport.close()
    return result


async def paced(
    host: str, port: int, requests: list[bytes], rate: float, duration_s: float, concurrency: int
) -> LoadResult:
    """Requests due every 1/rate seconds for `duration_s`, each on a free connection (or queued for one)."""
    connections = await _connect(host, port, concurrency)
    idle: asyncio.Queue[_Connection] = asyncio.Queue()
    for connection in connections:
        idle.put_nowait(connection)
    result = LoadResult()
    total = int(rate * duration_s)
    pending: set[asyncio.Task] = set()

    async def one(i: int, due: float) -> None:
        connection = await idle.get()
        if await _send(connection, requests[i % len(requests)], due, result):
            idle.put_nowait(connection)

    cpu, started = _cpu_s(), time.perf_counter()
    for i in range(total):
        due = started + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i, due))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending)
    result.elapsed_s, result.client_cpu_s = time.perf_counter() - started, _cpu_s() - cpu
    for connection in connections:
        connection.transport.close()
    return result


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coroutine):
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()
