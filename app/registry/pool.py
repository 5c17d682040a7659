"""The models this process serves: the registry's specs (from the store when there is one, else only in
memory) and, for those loaded, a ServedModel each. Routes call `resolve(name_or_alias)`; the admin API
registers, changes, loads and unloads without a restart.

Unloading drains: the model stops taking requests at once (503 model_not_loaded), the ones already in
flight finish, then its engine stops and the pool drops its last reference, so the memory goes back.
All methods run on the event loop; loading, inspecting and the store run in threads."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from app.errors import OpenAIError, model_not_found
from app.gateway.audit import SYSTEM, Actor
from app.observability.costs import HardwareCostMeter
from app.registry.adapters import AdapterEngine, adapter_changes_refused, check_adapter, new_adapter_spec
from app.registry.inspection import SourceFacts, inspect_source
from app.registry.loading import loads_on_first_use, preloaded_spec, return_memory_to_os, start_serving
from app.registry.memory import check_memory_fits
from app.registry.registration import LIVE_FIELDS, changed_spec, new_spec
from app.registry.served import DRAINING, LOADED, ServedModel
from app.registry.spec import KINDS, ModelSpec, RegistryError
from app.registry.store import RegistryStore
from engine.config import EngineConfig
from engine.lora import AdapterError

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.embeddings import EmbeddingModel

log = logging.getLogger("tokenmill.registry")

LOADING, UNLOADED, DISABLED = "loading", "unloaded", "disabled"
SERVER_COST = "hardware_cost_per_hour"  # the server setting that holds the server's hardware cost


def model_not_loaded(name: str, state: str) -> OpenAIError:
    why = {DRAINING: "is being unloaded", LOADING: "is still loading", DISABLED: "is disabled"}.get(
        state, "is not loaded"
    )
    return OpenAIError(
        503,
        f"The model `{name}` {why}; an administrator can load it with POST /admin/api/models/{name}/load.",
        type="server_error",
        param="model",
        code="model_not_loaded",
        headers={"Retry-After": "5"},
    )


class ModelPool:
    def __init__(
        self,
        base: EngineConfig,
        *,
        store: RegistryStore | None = None,
        load_enabled_at_start: bool = False,
        drain_timeout_s: float = 600.0,
        first_start: tuple[Mapping[str, Any], ...] = (),
        refresh_interval_s: float | None = None,
    ) -> None:
        self.base = base  # server-wide engine settings; a spec overrides its own part
        self.store = store
        self.load_enabled_at_start = load_enabled_at_start
        self.drain_timeout_s = drain_timeout_s  # then the engine stops anyway (a request that never ended)
        self.first_start = first_start  # registered on start unless their names are taken
        self.refresh_interval_s = refresh_interval_s  # re-read the registry (changes made on other replicas)
        self._refresher: asyncio.Task[Any] | None = None
        self.cost_meter: HardwareCostMeter | None = None  # told each model's own hardware cost, if any
        self._costs_told: dict[str, float | None] = {}
        self.specs: dict[str, ModelSpec] = {}
        self.served: dict[str, ServedModel] = {}  # loaded or draining
        self._loading: dict[str, asyncio.Task[Any]] = {}
        self._draining: dict[str, asyncio.Task[Any]] = {}
        self._changes = asyncio.Lock()  # registry changes one at a time: names and aliases stay unique
        self.inspect_timeout_s = 30.0  # reading a source's config / header; it is small and local

    # ---- what routes use ---------------------------------------------------------------------
    def spec(self, requested: str) -> ModelSpec | None:
        """The spec a model name or alias refers to."""
        spec = self.specs.get(requested)
        if spec is not None:
            return spec
        return next((s for s in self.specs.values() if requested in s.aliases), None)

    def state(self, name: str) -> str:
        served = self.served.get(name)
        if served is not None:
            return served.state
        if name in self._loading:
            return LOADING
        spec = self.specs.get(name)
        return DISABLED if spec is not None and not spec.enabled else UNLOADED

    def resolve(self, requested: str) -> ServedModel:
        """The loaded model `requested` names; 404 model_not_found, or 503 model_not_loaded."""
        spec = self.spec(requested)
        if spec is None:
            raise model_not_found(requested)
        served = self.served.get(spec.name)
        if served is None or served.state != LOADED or not spec.enabled:
            raise model_not_loaded(spec.name, self.state(spec.name))
        return served

    def acquire(self, requested: str) -> ServedModel:
        """resolve() and count the caller in flight until it calls release(): unloading waits for it."""
        served = self.resolve(requested)
        served.acquire()
        return served

    def loaded(self) -> list[ServedModel]:
        return [served for served in self.served.values() if served.state == LOADED]

    @property
    def default(self) -> ServedModel | None:
        """The first loaded chat model (what /health names)."""
        return next((s for s in self.loaded() if s.kind == "chat"), None)

    # ---- start and stop ----------------------------------------------------------------------
    def add_loaded(
        self,
        engine: AsyncEngine | None = None,
        *,
        embedder: EmbeddingModel | None = None,
        spec: ModelSpec | None = None,
        owned: bool = False,
    ) -> ServedModel:
        """A chat engine or an embedding model someone else loaded (`tokenmill serve --model`, tests);
        registered on start() unless the registry has it. The spec defaults to what the engine says."""
        if spec is None:
            if engine is None:
                raise ValueError("an embedding model needs its spec")
            spec = preloaded_spec(engine)
        self.specs.setdefault(spec.name, spec)
        served = self.served[spec.name] = ServedModel(
            self.specs[spec.name], engine=engine, embedder=embedder, owned=owned
        )
        return served

    async def start(self) -> None:
        """Read the registry; register what is loaded but not registered yet (the embedded default on
        first start); then, when asked to, load every enabled model in the background, but the one that
        loads on first use (app.registry.loading.loads_on_first_use)."""
        if self.store is not None:
            stored = {spec.name: spec for spec in await run_in_threadpool(self.store.all)}
            for name, served in self.served.items():
                if name not in stored:
                    stored[name] = await run_in_threadpool(self.store.insert, spec=served.spec)
                served.spec = stored[name]
            self.specs = stored
            self._use_server_cost(await run_in_threadpool(self.store.setting, SERVER_COST))
        for fields in self.first_start:
            await self.ensure_registered(fields)
        self._tell_costs()
        if self.load_enabled_at_start:
            for spec in self.specs.values():
                if spec.enabled and spec.name not in self.served and not loads_on_first_use(spec):
                    self._start_loading(spec)
        if self.store is not None and self.refresh_interval_s:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_every(self.refresh_interval_s))

    async def stop(self) -> None:
        for task in [*self._loading.values(), *self._draining.values(), *filter(None, [self._refresher])]:
            task.cancel()
        for served in list(self.served.values()):
            if served.owned:
                await run_in_threadpool(served.shutdown)
        self.served = {name: served for name, served in self.served.items() if not served.owned}

    async def ensure_registered(self, fields: Mapping[str, Any]) -> ModelSpec | None:
        """Register a default model unless its name is taken already (first start); None if skipped."""
        if fields["name"] in self.specs:
            return None
        try:
            return await self.register(fields)
        except RegistryError as error:
            log.warning("not registering %s: %s", fields["name"], error)
            return None

    # ---- registry changes (admin API) --------------------------------------------------------
    async def refresh(self) -> None:
        """Specs as the store has them now (another replica may have changed them): new aliases and
        prices apply at once; a model served here that was disabled or removed there is unloaded."""
        if self.store is None:
            return
        stored = {spec.name: spec for spec in await run_in_threadpool(self.store.all)}
        switched_off = [
            name
            for name, served in self.served.items()
            if served.state == LOADED and (name not in stored or not stored[name].enabled)
        ]
        for name, served in self.served.items():
            stored.setdefault(name, served.spec)  # until it is unloaded
            served.spec = stored[name]
        self.specs = stored
        self._use_server_cost(await run_in_threadpool(self.store.setting, SERVER_COST))
        self._tell_costs()
        for name in switched_off:
            await self.unload(name)

    async def _refresh_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except Exception as error:  # the store may be away for a while; try again later
                log.warning("could not re-read the model registry: %s", error)

    async def register(self, fields: Mapping[str, Any], *, load: bool = False, actor: Actor = SYSTEM) -> ModelSpec:
        if fields.get("adapter_of") is not None:
            return await self._register_adapter(fields, load=load, actor=actor)
        facts = await self._inspect(fields.get("kind") or "chat", str(fields.get("path")))
        async with self._changes:
            await self.refresh()
            spec = await run_in_threadpool(
                new_spec, fields, base=self.base, others=list(self.specs.values()), facts=facts
            )
            if self.store is not None:
                try:
                    spec = await run_in_threadpool(partial(self.store.insert, spec=spec, actor=actor))
                except IntegrityError:  # another replica registered the name in between
                    raise RegistryError(
                        f"{spec.name!r} is already a registered model.", param="name", code="conflict"
                    ) from None
            self.specs[spec.name] = spec
            self._tell_costs()
        if load:
            await self.load(spec.name, actor=actor)
        return spec

    async def _register_adapter(self, fields: Mapping[str, Any], *, load: bool, actor: Actor) -> ModelSpec:
        """A LoRA adapter on a loaded chat model: checked against that model's weights (shapes, target modules,
        rank) before anything is stored."""
        base_spec = self._base_of_adapter(str(fields["adapter_of"]))
        base_served = self.served.get(base_spec.name)
        if base_served is None or base_served.state != LOADED or base_served.engine is None:
            raise RegistryError(
                f"base model {base_spec.name!r} is not loaded; load it first (an adapter is checked against it).",
                param="adapter_of",
                code="model_not_loaded",
            )
        manifest = await run_in_threadpool(check_adapter, base_served.engine, str(fields.get("path")))
        async with self._changes:
            await self.refresh()
            spec = new_adapter_spec(
                fields, base_spec=base_spec, manifest=manifest, config=self.base, others=list(self.specs.values())
            )
            if self.store is not None:
                try:
                    spec = await run_in_threadpool(partial(self.store.insert, spec=spec, actor=actor))
                except IntegrityError:
                    raise RegistryError(
                        f"{spec.name!r} is already a registered model.", param="name", code="conflict"
                    ) from None
            self.specs[spec.name] = spec
            self._tell_costs()
        if load:
            await self.load(spec.name, actor=actor)
        return spec

    def _base_of_adapter(self, requested: str) -> ModelSpec:
        base_spec = self.spec(requested)
        if base_spec is None:
            raise RegistryError(f"base model {requested!r} is not registered.", param="adapter_of")
        if base_spec.adapter_of is not None or base_spec.kind != "chat":
            raise RegistryError(
                f"{base_spec.name!r} cannot carry an adapter: the base must be a chat model, not an adapter.",
                param="adapter_of",
            )
        return base_spec

    def adapters_of(self, name: str) -> list[str]:
        return [spec.name for spec in self.specs.values() if spec.adapter_of == name]

    async def update(self, name: str, changes: Mapping[str, Any], *, actor: Actor = SYSTEM) -> ModelSpec:
        facts = None
        if self._known(name).adapter_of is not None:
            adapter_changes_refused(self._known(name), changes)
        if changes.get("path") is not None:
            facts = await self._inspect(self._known(name).kind, str(changes["path"]))
        async with self._changes:
            await self.refresh()
            spec = self._known(name)
            updated = await run_in_threadpool(
                changed_spec, spec, changes, base=self.base, others=list(self.specs.values()), facts=facts
            )
            if self.store is not None:
                updated = await run_in_threadpool(partial(self.store.replace, name=name, spec=updated, actor=actor))
            self.specs[name] = updated
            served = self.served.get(name)
            if served is not None:
                served.spec = updated
            self._tell_costs()
        if not updated.enabled:
            await self.unload(name)
        if set(changes) - set(LIVE_FIELDS) and name in self.served:
            log.info("%s: engine changes take effect at its next load", name)
        return updated

    async def set_server_hardware_cost(self, cost_per_hour: float, *, actor: Actor = SYSTEM) -> float:
        """The server's hardware cost per hour (USD), shared by the models without their own, from now on.
        Stored with the registry (it then wins over TOKENMILL_HARDWARE_COST_PER_HOUR, here, after a
        restart and on the other replicas at their next refresh)."""
        if not 0 <= cost_per_hour < math.inf:
            raise RegistryError(
                "hardware_cost_per_hour must be a finite number, not negative.", param="hardware_cost_per_hour"
            )
        async with self._changes:
            if self.store is not None:
                await run_in_threadpool(partial(self.store.set_setting, SERVER_COST, cost_per_hour, actor=actor))
            self._use_server_cost(cost_per_hour)
        return cost_per_hour

    def _use_server_cost(self, cost_per_hour: float | None) -> None:
        """Tell the meter the stored server cost, if there is one and it changed (the meter counts a cost
        from when it is set)."""
        if cost_per_hour is None:
            return
        if self.cost_meter is None:
            self.cost_meter = HardwareCostMeter(cost_per_hour)
        elif self.cost_meter.cost_per_hour != cost_per_hour:
            self.cost_meter.set_server_cost(cost_per_hour)

    @property
    def server_hardware_cost(self) -> float:
        return self.cost_meter.cost_per_hour if self.cost_meter is not None else 0.0

    def hardware_cost_of(self, name: str) -> float:
        """What `name`'s hardware costs per hour: its own cost, or else the server's."""
        spec = self.specs.get(name)
        own = spec.hardware_cost_per_hour if spec is not None else None
        return self.server_hardware_cost if own is None else own

    async def remove(self, name: str, *, actor: Actor = SYSTEM) -> None:
        """Unload (drain, waiting for it) and delete the registry row."""
        self._known(name)
        adapters = self.adapters_of(name)
        if adapters:
            raise OpenAIError(
                409, f"model {name!r} carries adapters {adapters}; remove them first.", param="model", code="conflict"
            )
        await self.unload(name, wait=True)
        async with self._changes:
            if self.store is not None:
                await run_in_threadpool(partial(self.store.remove, name=name, actor=actor))
            self.specs.pop(name, None)

    # ---- load and unload ---------------------------------------------------------------------
    def loads_on_first_use(self, requested: str, kind: str | None = None) -> bool:
        """Whether the model `requested` names loads when a request (for `kind`, if it says) first names
        it, whatever --load-on-demand says: a request for another kind is refused without loading it."""
        spec = self.spec(requested)
        return spec is not None and loads_on_first_use(spec) and kind in (None, spec.kind)

    async def load_on_demand(self, requested: str) -> None:
        """Load the enabled model `requested` names if it is not loaded (a draining one is left alone:
        it was unloaded on purpose). A load that fails is logged; the request then gets resolve()'s error."""
        spec = self.spec(requested)
        if spec is None or not spec.enabled or self.state(spec.name) not in (UNLOADED, LOADING):
            return
        try:
            await self.load(spec.name)
        except RegistryError as error:
            log.warning("load on demand: %s", error)

    async def load(self, name: str, *, actor: Actor | None = None) -> ServedModel:
        """Loads it (an admin's load, with `actor`, is audited once it serves; one on demand is not)."""
        spec = self._known(name)
        if not spec.enabled:
            raise RegistryError(f"model {name!r} is disabled; enable it first.", param="enabled", code="model_disabled")
        draining = self._draining.get(name)
        if draining is not None:  # load after unload: the old engine goes first
            await asyncio.shield(draining)
        served = self.served.get(name)
        if served is not None:
            return served
        state = self.state(name)
        task = self._loading.get(name) or self._start_loading(spec)
        loaded: ServedModel = await asyncio.shield(task)
        await self._audit(actor, "model.load", name, state, LOADED)
        return loaded

    async def unload(self, name: str, *, wait: bool = False, actor: Actor | None = None) -> None:
        """Stop taking requests for `name` now; stop its engine once those in flight are done. An
        admin's unload (`actor`) is audited when it changes anything."""
        state = self.state(name)
        for adapter in self.adapters_of(name):  # they run on its engine: they stop taking requests first
            await self.unload(adapter, wait=wait, actor=actor)
        if actor is not None and state in (LOADED, LOADING):
            await self._audit(actor, "model.unload", name, state, DRAINING)
        loading = self._loading.get(name)
        if loading is not None:
            await asyncio.gather(asyncio.shield(loading), return_exceptions=True)
        served = self.served.get(name)
        if served is not None and served.state == LOADED:
            served.state = DRAINING
            task = asyncio.get_running_loop().create_task(self._drain(served))
            self._draining[name] = task
            task.add_done_callback(lambda _: self._draining.pop(name, None))
        drain = self._draining.get(name)
        if wait and drain is not None:
            await asyncio.shield(drain)

    # ---- internals ---------------------------------------------------------------------------
    async def _audit(self, actor: Actor | None, action: str, name: str, before: str, after: str) -> None:
        if actor is None or self.store is None:
            return
        record = partial(
            self.store.record, actor=actor, action=action, name=name, before={"state": before}, after={"state": after}
        )
        await run_in_threadpool(record)

    async def _inspect(self, kind: str, source: str) -> SourceFacts | None:
        """The source's facts, read before the registry lock is taken (a slow disk must not hold up every
        other change) and given up after inspect_timeout_s. None for a kind the registration refuses."""
        if kind not in KINDS:
            return None
        try:
            return await asyncio.wait_for(run_in_threadpool(inspect_source, kind, source), self.inspect_timeout_s)
        except TimeoutError:
            raise RegistryError(
                f"reading the model at {source!r} took longer than {self.inspect_timeout_s:g}s.",
                param="path",
                code="model_source_timeout",
            ) from None

    def _tell_costs(self) -> None:
        """Models with their own hardware cost per hour, to the real-cost meter (only changes: the meter
        counts a model's cost from when it is set)."""
        if self.cost_meter is None:
            return
        for name, spec in self.specs.items():
            if self._costs_told.get(name) != spec.hardware_cost_per_hour:
                self.cost_meter.set_model_cost(name, spec.hardware_cost_per_hour)
                self._costs_told[name] = spec.hardware_cost_per_hour

    def _known(self, name: str) -> ModelSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise OpenAIError(404, f"No model named {name!r} is registered.", param="model", code="not_found")
        return spec

    def _start_loading(self, spec: ModelSpec) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(self._load(spec))
        self._loading[spec.name] = task
        task.add_done_callback(lambda _: self._loading.pop(spec.name, None))
        task.add_done_callback(_log_failure)
        return task

    async def _load(self, spec: ModelSpec) -> ServedModel:
        started = time.monotonic()
        if spec.adapter_of is not None:
            return await self._load_adapter(spec)
        await run_in_threadpool(check_memory_fits, spec, self.base)  # refused before a byte is loaded
        try:
            loaded = await run_in_threadpool(start_serving, spec, self.base)
        except Exception as error:
            raise RegistryError(
                f"could not load {spec.name!r}: {type(error).__name__}: {error}", param="path", code="model_load_failed"
            ) from error
        served = ServedModel(self.specs.get(spec.name, spec), **loaded)
        self.served[spec.name] = served
        log.info("loaded %s in %.1fs", spec.name, time.monotonic() - started)
        return served

    async def _load_adapter(self, spec: ModelSpec) -> ServedModel:
        """Loads the base model if it is not (its engine serves the adapter), then registers the adapter on
        that engine; its weights load on the first request that uses it."""
        assert spec.adapter_of is not None
        base_served = await self.load(spec.adapter_of)
        base_engine = base_served.engine
        if base_engine is None:
            raise RegistryError(
                f"{spec.adapter_of!r} is not a chat model: a LoRA adapter needs a chat base", param="adapter_of"
            )
        try:
            await run_in_threadpool(base_engine.register_adapter, spec.name, spec.source)
        except AdapterError as error:
            raise RegistryError(
                f"could not load adapter {spec.name!r}: {error}", param="path", code="model_load_failed"
            ) from None
        # AdapterEngine stands in for the base's AsyncEngine: the same interface, each request under the adapter
        adapter_engine = cast("AsyncEngine", AdapterEngine(base_engine, spec.name))
        served = ServedModel(self.specs.get(spec.name, spec), engine=adapter_engine)
        self.served[spec.name] = served
        log.info("loaded adapter %s on %s", spec.name, spec.adapter_of)
        return served

    def _in_flight_on_engine(self, served: ServedModel) -> int:
        """Requests on this model's engine: its own and its adapters'."""
        adapters = [self.served.get(name) for name in self.adapters_of(served.name)]
        return served.in_flight + sum(adapter.in_flight for adapter in adapters if adapter is not None)

    async def _drain(self, served: ServedModel) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self._in_flight_on_engine(served) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if served.in_flight > 0:
            log.warning(
                "%s: %d requests still running after %.0fs; stopping anyway",
                served.name,
                served.in_flight,
                self.drain_timeout_s,
            )
        await run_in_threadpool(served.shutdown)
        if self.served.get(served.name) is served:
            del self.served[served.name]
        served.forget()
        gc.unfreeze()  # a model loaded before start-up ended was frozen with the rest (app.main)
        gc.collect()  # the weights and the KV pool go now, not at some later collection
        gc.freeze()
        await run_in_threadpool(return_memory_to_os)
        log.info("unloaded %s", served.name)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s", task.exception())
