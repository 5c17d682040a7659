"""tokenmill on Ray Serve: N replicas, each a whole tokenmill server (engine, pool, gateway), behind one
HTTP ingress. Replicas share their state through PostgreSQL (keys, usage, registry) and Redis
(rate-limit counters); Ray Serve starts, scales, health-checks and drains them.

The ingress reads each request's body, tokenizes its prompt and hashes its blocks as the engine will
(app.scaleout.prompt_blocks), and hands it to a replica through a deployment handle, whose request router
(PrefixAwareRouter) sends it to the replica whose prefix cache holds most of it, within a load bound
(app.scaleout.prefix_routing). Each replica reports the block hashes its cache holds every
ROUTING_STATS_PERIOD_S (Serve's record_routing_stats), and after each answer which cache salt the key
used. Responses stream back chunk by chunk. A request whose replica dies before the response starts is
sent to another one.
Needs the `ray` extra (`pip install -e '.[ray]'`); `tokenmill serve --ray` (app/cli/ray.py) runs it.
"""

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, TypedDict

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from app.errors import OpenAIError
from app.observability.metrics import OPENMETRICS_ACCEPT, Expositions, exposition
from app.scaleout.asgi_forward import ForwardedRequest, ResponseStart, run_asgi
from app.scaleout.cold_placement import ColdPlacements
from app.scaleout.prefix_routing import (
    EPSILON,
    MIN_MATCH_BLOCKS,
    PREFIX_CHARS,
    digest,
    place,
    prefix_key,
    prompt_blocks,
    routing_text,
)
from app.scaleout.prompt_blocks import CacheRoot, CacheRoots, PromptTokens, cache_root_after
from app.scaleout.routing_ledger import RoutingLedger, routing_exposition
from app.settings import Settings
from engine.config import EngineConfig

log = logging.getLogger("tokenmill.scaleout")

REPLICA_HEADER = "x-tokenmill-replica"  # which replica answered: for operators, tests and the bench
DRAIN_TIMEOUT_S = 60.0  # a stopping replica finishes its requests for this long, then it is killed
ATTEMPTS = 3  # tries for a request whose replica dies before answering
SCRAPE_TIMEOUT_S = 10.0  # the ingress's /metrics waits this long for each replica's
ROUTERS = {
    "prefix": "app.scaleout.ray_serve.PrefixAwareRouter",
    "round-robin": "app.scaleout.ray_serve.RoundRobinRouter",
}
FORWARDED_ENV_PREFIXES = ("TOKENMILL_", "OMP_", "GOMP_", "HF_", "TRANSFORMERS_")
# How often each replica reports its prefix cache's block hashes to the routers (through Serve's
# controller; 8 bytes a cached block). Between reports a tenant's cold prompts follow its first one
# (app.scaleout.cold_placement), unless that replica is at the load bound. In a
# simulation of the bench's workload (16 seeds), 1 s instead of 3 s raised the worst seeds' hit rates.
ROUTING_STATS_PERIOD_S = 1.0
DIGEST_STAT = "prefix_digest"  # the routing_stats entry holding it


# ---- request routers (they run in the ingress, beside its handle to the replicas) ----


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, ForwardedRequest) else None


class RoutedReplicas:
    """The replicas the routers in this process (the ingress's) know of, by unique id: the ingress's
    /metrics asks each of them. Kept by the routers, since only they hear from Serve when replicas come
    and go; replaced whole, never mutated, as routers and the ingress may run on different threads."""

    ids: frozenset[str] = frozenset()


def routed_replica_ids() -> frozenset[str]:
    # Imported when called, by routers and ingress alike: Serve ships their code pickled by value, so a
    # global they name is each one's own copy of this module's globals, never shared between them.
    from app.scaleout import ray_serve

    return ray_serve.RoutedReplicas.ids


def _targeted_rank(
    candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
) -> list[list[RunningReplica]] | None:
    """For a request meant for one replica: that replica alone (none while it is not a candidate, and
    the ingress gives up on it after SCRAPE_TIMEOUT_S). None for every other request."""
    request = _forwarded(pending_request)
    if request is None or request.replica is None:
        return None
    return [[replica for replica in candidate_replicas if replica.replica_id.unique_id == request.replica]]


class _RemembersReplicas(RequestRouter):
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        from app.scaleout import ray_serve  # the imported module, see routed_replica_ids

        ray_serve.RoutedReplicas.ids = frozenset(replica.replica_id.unique_id for replica in replicas)


def routing_ledger() -> RoutingLedger:
    from app.scaleout import routing_ledger  # the imported module, see routed_replica_ids

    return routing_ledger.LEDGER


class PrefixAwareRouter(_RemembersReplicas):
    """The replica holding the longest cached prefix of the prompt among those under the load bound,
    else the prompt's hash order (app.scaleout.prefix_routing.place). Load: the requests this router
    has placed and Serve has not reported finished (the routing ledger). Serve probes the ranks in order
    and skips replicas at max_ongoing_requests, so a full replica is passed over too."""

    def initialize_state(self, epsilon: float = EPSILON, min_match_blocks: int = MIN_MATCH_BLOCKS, **_: object) -> None:
        self.epsilon = epsilon
        self.min_match_blocks = min_match_blocks
        self.cold: ColdPlacements[str] = (
            ColdPlacements()
        )  # where cold prompts went, until the replicas' reports show them

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (targeted := _targeted_rank(candidate_replicas, pending_request)) is not None:
            return targeted
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        ledger = routing_ledger()
        held = {
            unique_id: (replica.routing_stats or {}).get(DIGEST_STAT, frozenset())
            for unique_id, replica in by_id.items()
        }
        request = _forwarded(pending_request)
        placement = place(
            request.prefix_key if request else None,
            request.prompt_blocks if request else (),
            ledger.loads(by_id),
            held,
            epsilon=self.epsilon,
            min_match_blocks=self.min_match_blocks,
            cold=self.cold,
        )
        if placement.ranks and pending_request is not None:
            ledger.placed(pending_request.metadata.internal_request_id, placement.ranks[0][0], placement.by)
        return [[by_id[unique_id] for unique_id in rank] for rank in placement.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        # Serve may have passed over the first choice (full): count the request where it went.
        routing_ledger().moved(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routing_ledger().finished(internal_request_id)


class RoundRobinRouter(_RemembersReplicas):
    """Replicas in turn, whatever the prompt: the baseline bench/scale_bench.py compares against."""

    def initialize_state(self, **_: object) -> None:
        self.turns = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (targeted := _targeted_rank(candidate_replicas, pending_request)) is not None:
            return targeted
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        first = next(self.turns) % len(ordered)
        return [[ordered[first]], ordered[first + 1 :] + ordered[:first]]


# ---- the replica: one tokenmill server ----


class TokenmillReplica:
    async def __init__(self, settings: Settings) -> None:  # type: ignore[misc]  # Ray Serve awaits an async __init__
        from app.scaleout.replica_app import build_server

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.prefix_cache_scope = settings.prefix_cache_scope
        # Its usage rows carry its name. The database was migrated once, before the replicas started
        # (app.gateway.wiring.prepare_store): replicas don't migrate.
        settings = dataclasses.replace(settings, instance_id=self.replica_id)
        # Loading the model blocks for seconds: off this replica's event loop.
        self.app, self.engine = await asyncio.to_thread(build_server, settings, migrated=True, replica=self.replica_id)
        self.identity = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # gateway, pool, usage writer: as uvicorn would start them

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes | CacheRoot]:
        state: dict[str, Any] = {}
        status = None
        async for item in run_asgi(self.app, request, self.identity, state):
            if isinstance(item, ResponseStart):
                status = item.status
            yield item
        # After the body: the ingress learns which cache root this key's prompts are hashed from.
        if (note := cache_root_after(request.path, status, state, self.prefix_cache_scope)) is not None:
            yield note

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls it every ROUTING_STATS_PERIOD_S; the routers read it as replica.routing_stats."""
        return {DIGEST_STAT: digest(self.engine.cached_prefix_digest())}

    async def __del__(self) -> None:
        # Serve calls this after the drain: in-flight requests have finished; flush usage, stop the engine.
        try:
            await self.lifespan.__aexit__(None, None, None)
        finally:
            await asyncio.to_thread(self.engine.shutdown)


# ---- the ingress: one HTTP front for all replicas ----

ingress_api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the replicas' own docs pass through
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def _shutting_down() -> Response:
    error = OpenAIError(
        503,
        "The server is shutting down; try again.",
        type="server_error",
        code="shutting_down",
        headers={"Retry-After": "2"},
    )
    return error.response()


def _replica_lost() -> Response:
    error = OpenAIError(
        503, "No replica could take the request; try again.", type="server_error", code="replica_unavailable"
    )
    return error.response()


class Ingress:
    def __init__(
        self, replicas: DeploymentHandle[Any], prefix_chars: int = PREFIX_CHARS, engine: EngineConfig | None = None
    ) -> None:
        self.replicas = replicas.options(stream=True, method_name="handle")
        self.prefix_chars = prefix_chars
        self.prompt_tokens = PromptTokens(engine) if engine is not None else None
        self.cache_roots = CacheRoots()
        self.draining = False
        self.in_flight = 0  # requests forwarded whose response has not ended

    def drain(self) -> int:
        """From now on refuse new requests (503 shutting_down); returns how many are still in flight."""
        self.draining = True
        return self.in_flight

    def in_flight_requests(self) -> int:
        return self.in_flight

    @ingress_api.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def forward(self, request: Request, path: str) -> Response:
        if self.draining:
            return _shutting_down()
        self.in_flight += 1
        try:
            response = await self._forward(request)
        except BaseException:
            self.in_flight -= 1
            raise
        if not isinstance(response, StreamingResponse):
            self.in_flight -= 1
        return response

    async def _forward(self, request: Request) -> Response:
        # The path inside this app: Serve keeps an application's route prefix in the path and in root_path.
        path = request.url.path.removeprefix(request.scope.get("root_path", "")) or "/"
        if request.method == "GET" and path == "/metrics":
            return await self._metrics_of_every_replica(request.headers.get("accept"))
        body = await request.body()
        authorization = request.headers.get("authorization")
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.scope.get("query_string", b""),
            headers=list(request.scope["headers"]),
            body=body,
            client=request.scope.get("client"),
            prefix_key=prefix_key(routing_text(path, body), self.prefix_chars, salt=authorization),
            prompt_blocks=await self._prompt_blocks(path, body, authorization),
            scheme=request.url.scheme,
        )
        for _ in range(ATTEMPTS):
            stream = self._stream(forwarded)
            try:
                start = await stream.__anext__()
            except (RayActorError, ActorUnavailableError):
                continue  # the replica died before it answered: nothing was sent, another one takes it
            response = StreamingResponse(self._rest_of(stream, authorization), status_code=start.status)
            response.raw_headers = list(start.headers)  # as the replica sent them, repeated headers too
            return response
        return _replica_lost()

    def _stream(self, request: ForwardedRequest) -> DeploymentResponseGenerator[Any]:
        """The replicas' `handle`, called: a stream, as the handle has stream=True."""
        stream = self.replicas.remote(request)
        assert isinstance(stream, DeploymentResponseGenerator)
        return stream

    async def _prompt_blocks(self, path: str, body: bytes, authorization: str | None) -> tuple[bytes, ...]:
        """The prompt's block hashes under its key's cache root; none while no replica has told us the root."""
        known, root = self.cache_roots.of(authorization)
        if not known or self.prompt_tokens is None:
            return ()
        try:
            token_ids = await asyncio.to_thread(self.prompt_tokens.of, path, body)
            return prompt_blocks(token_ids, self.prompt_tokens.block_size, root) if token_ids else ()
        except Exception:  # affinity is an optimisation: a request never fails for want of it
            log.exception("could not hash a prompt's blocks; it routes by load")
            return ()

    async def _metrics_of_every_replica(self, accept: str | None) -> Response:
        """Every replica's /metrics as one exposition; each replica labels its own series (replica=<id>).
        The first scrape goes to any replica, which also wakes the router that knows the others."""
        first_replica, first_text = await self._scrape(None)
        texts = {first_replica: first_text}
        for replica in sorted(routed_replica_ids() - texts.keys()):
            try:
                _, texts[replica] = await asyncio.wait_for(self._scrape(replica), SCRAPE_TIMEOUT_S)
            except (TimeoutError, RayActorError, ActorUnavailableError):
                continue  # gone since the router last heard of it: its series go with it
        texts["router"] = routing_exposition(routing_ledger(), routed_replica_ids())
        body, content_type = exposition(Expositions(texts.values()), accept)
        return Response(body, media_type=content_type)

    async def _scrape(self, replica: str | None) -> tuple[str, str]:
        """(the replica that answered, its /metrics in OpenMetrics: the format that loses nothing)."""
        forwarded = ForwardedRequest(
            method="GET",
            path="/metrics",
            query_string=b"",
            headers=[(b"accept", OPENMETRICS_ACCEPT.encode())],
            body=b"",
            client=None,
            replica=replica,
        )
        stream = self._stream(forwarded)
        start = await stream.__anext__()
        body = b"".join([chunk async for chunk in stream])
        answered = dict(start.headers)[REPLICA_HEADER.encode()].decode()
        return answered, body.decode()

    async def _rest_of(
        self, stream: DeploymentResponseGenerator[Any], authorization: str | None
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in stream:
                if isinstance(chunk, CacheRoot):
                    self.cache_roots.learn(authorization, chunk.root)
                    continue
                yield chunk
            finished = True
        finally:
            self.in_flight -= 1
            if not finished:
                stream.cancel()  # the client went away: the replica sees a disconnect and aborts the generation


# At import, in every process: serve.ingress turns `forward` into a route bound to the replica's instance.
IngressDeployment = serve.deployment(name="Ingress")(serve.ingress(ingress_api)(Ingress))


# ---- the application ----


def drain_and_shutdown(app_name: str = "tokenmill", timeout_s: float = DRAIN_TIMEOUT_S) -> int:
    """Stop taking requests, let those in flight finish (up to `timeout_s`), then shut Serve down: its own
    shutdown stops the HTTP proxy at once, cutting streams short. Returns the requests cut short."""
    ingress = serve.get_app_handle(app_name)
    in_flight: int = ingress.drain.remote().result()
    deadline = time.monotonic() + timeout_s
    while in_flight and time.monotonic() < deadline:
        time.sleep(0.2)
        in_flight = ingress.in_flight_requests.remote().result()
    serve.shutdown()
    return in_flight


def forwarded_env() -> dict[str, str]:
    """The environment the replicas inherit (torch threads, the hub libraries' offline switches); their
    settings travel as the Settings object itself."""
    return {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_ENV_PREFIXES)}


class Scaling(TypedDict, total=False):  # the replica deployment's options: a count, or autoscaling
    num_replicas: int
    autoscaling_config: dict[str, int]


def build_application(
    settings: Settings,
    *,
    router: str = "prefix",
    initial_replicas: int | None = None,
    replica_cpus: float = 1.0,
    prefix_chars: int = PREFIX_CHARS,
    epsilon: float = EPSILON,
    app_name_suffix: str = "",
) -> serve.Application:
    """The Ingress bound to the TokenmillReplica deployment, with autoscaling between the settings'
    min_replicas and max_replicas (a fixed count when they are equal)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}")
    if not epsilon >= 0:
        raise ValueError("the routing epsilon must be 0 or more")
    max_ongoing = settings.engine.max_num_seqs  # more than the engine batches would only queue inside it
    scaling: Scaling
    if settings.min_replicas == settings.max_replicas:
        scaling = {"num_replicas": settings.min_replicas}
    else:
        scaling = {
            "autoscaling_config": {
                "min_replicas": settings.min_replicas,
                "max_replicas": settings.max_replicas,
                "initial_replicas": initial_replicas or settings.min_replicas,
                "target_ongoing_requests": max(1, max_ongoing // 2),
            }
        }
    router_kwargs = {"epsilon": epsilon} if router == "prefix" else {}
    # Passed as **fields: RequestRouterConfig annotates its **kwargs as dict[str, Any] each (its fields are typed).
    router_fields: dict[str, Any] = {
        "request_router_class": ROUTERS[router],
        "request_router_kwargs": router_kwargs,
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }
    # The classes stay undecorated module names, so Ray pickles them by reference (by value, their
    # methods would not see this module's other functions).
    replica = (
        serve.deployment()(TokenmillReplica)
        .options(
            name="TokenmillReplica" + app_name_suffix,
            max_ongoing_requests=max_ongoing,
            graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S,
            graceful_shutdown_wait_loop_s=0.5,
            request_router_config=RequestRouterConfig(**router_fields),
            ray_actor_options={"num_cpus": replica_cpus, "runtime_env": {"env_vars": forwarded_env()}},
            **scaling,
        )
        .bind(settings)
    )
    return IngressDeployment.options(
        name="Ingress" + app_name_suffix,
        num_replicas=1,
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},  # it only forwards: leave the cores to the engines
    ).bind(replica, prefix_chars, settings.engine)
