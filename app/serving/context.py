"""The server context a request runs in: the settings, the model pool and the gateway; and one request's
view of the model it names (`ModelContext`), held in flight until release()."""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Response
from fastapi.responses import StreamingResponse

from app.errors import invalid_request, model_not_found
from app.gateway.contract import Gateway, Principal
from app.observability.costs import HardwareCostMeter
from app.registry.pool import ModelPool
from app.registry.served import ServedModel, tokenizer_of
from app.serving.admission import FairAdmission
from app.serving.responses.store import ResponseStore, response_store
from app.serving.sampling import ModelSampling, sampling_defaults
from app.settings import Settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from app.gateway.config import ModelPrice
    from app.observability.metrics import ModelMetrics
    from app.serving.token_text import TokenTexts
    from engine.async_engine import AsyncEngine
    from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ServerContext:
    settings: Settings
    models: ModelPool
    gateway: Gateway
    cost_meter: HardwareCostMeter | None = None  # the real-cost view: tokens produced per hardware hour
    # Stored responses of the Responses API: the gateway's database, else this process's memory.
    responses: ResponseStore = field(default_factory=lambda: response_store(None, retention_s=30 * 86400))
    # Template, tokenization and holds in fair turns across teams (app/serving/admission.py).
    admission: FairAdmission = field(default_factory=FairAdmission)

    async def check_access(self, principal: Principal, requested_model: str) -> None:
        spec = self.models.spec(requested_model)
        if spec is None:
            raise model_not_found(requested_model)
        if principal.allows(requested_model) or principal.allows(spec.name):  # an alias the key lists, or the model
            return
        # The gateway refuses it (and meters the refusal) in the words of what was asked for.
        await self.gateway.admit(principal, model=requested_model, prompt_tokens=0, max_tokens=0)
        raise model_not_found(requested_model)

    def bind(self, requested_model: str, kind: str | None = None) -> ModelContext:
        """The loaded model a request names (name or alias), of `kind` when given, counted in flight
        until release(). The kind is checked first: a model of another kind is a 400 whether it is
        loaded or not."""
        spec = self.models.spec(requested_model)
        if kind is not None and spec is not None and spec.kind != kind:
            raise invalid_request(
                f"`{requested_model}` is a model of kind {spec.kind}; this endpoint needs kind {kind}.",
                param="model",
                code="wrong_model_kind",
            )
        served = self.models.resolve(requested_model)
        served.acquire()
        return ModelContext(self.settings, self.gateway, served, self.cost_meter, self.admission)

    async def with_model(
        self,
        requested_model: str,
        handle: Callable[[ModelContext], Awaitable[Response]],
        *,
        principal: Principal,
        kind: str | None = None,
    ) -> Response:
        """handle(context) for the model a request names; the model counts it in flight until the
        response is complete (a streamed one: until its tracker finishes). The caller's access comes
        first: a model the key may not use is a 404 naming only what was asked for, before its kind,
        its state or a load on demand could tell that it exists."""
        await self.check_access(principal, requested_model)
        if self.settings.load_on_demand or self.models.loads_on_first_use(requested_model, kind):
            await self.models.load_on_demand(requested_model)
        context = self.bind(requested_model, kind)
        try:
            response = await handle(context)
        finally:
            if not context.streaming:
                context.release()
        if context.streaming:  # also when the stream never starts (client gone first): no drain waits forever
            assert isinstance(response, StreamingResponse)  # what a route that set streaming returns
            weakref.finalize(response.body_iterator, context.release)
        return response


@dataclass
class ModelContext:
    """One request's view of the server: its model's engine, metrics and token texts. release() once
    the request is over (RequestTracker.finish does), so an unload can drain."""

    settings: Settings
    gateway: Gateway
    served: ServedModel
    cost_meter: HardwareCostMeter | None = None
    admission: FairAdmission = field(default_factory=FairAdmission)
    streaming: bool = False  # the response outlives the route: its tracker releases the model
    released: bool = field(default=False)

    @property
    def engine(self) -> AsyncEngine:
        engine = self.served.engine
        assert engine is not None  # a chat model's: routes of other kinds (embeddings) never ask
        return engine

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return tokenizer_of(self.engine)

    @property
    def metrics(self) -> ModelMetrics:
        return self.served.metrics

    @property
    def token_texts(self) -> TokenTexts:
        token_texts = self.served.token_texts
        assert token_texts is not None  # a chat model's, made with its engine
        return token_texts

    @property
    def model_name(self) -> str:
        return self.served.name

    @property
    def price(self) -> ModelPrice | None:
        return self.served.spec.price

    @property
    def sampling(self) -> ModelSampling:
        """The model's sampling defaults, read per request (an admin's change applies to the next one); a
        default max_tokens must fit the context and the KV pool, or the engine refuses it."""
        pool_tokens = self.engine.stats().kv_blocks_total * self.engine.config.block_size
        return ModelSampling(
            min(self.engine.max_model_len, pool_tokens),
            self.settings.max_tokens_cap,
            sampling_defaults(self.served.spec, self.settings),
        )

    def access_name(self, principal: Principal, requested: str) -> str:
        """What the gateway checks access against: the name the caller used if its key lists it (an
        alias), else the registered name."""
        return requested if requested != self.model_name and principal.allows(requested) else self.model_name

    async def admit(
        self,
        principal: Principal,
        requested: str,
        request_id: str,
        prompt_tokens: int,
        params: SamplingParams,
        *,
        prompts: int = 1,
    ) -> dict[str, str]:
        """The gateway's admission of a request for this model (access under the name the caller used, its
        price), reserving what `prompts` prompts of `prompt_tokens` in all can cost under `params`; the
        response headers (x-ratelimit-*)."""
        return await self.gateway.admit(
            principal,
            model=self.access_name(principal, requested),
            prompt_tokens=prompt_tokens,
            max_tokens=params.max_tokens,
            sequences=params.n * prompts,
            request_id=request_id,
            price=self.price,
        )

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.served.release()
