"""Registry rows <-> ModelSpecs. Keyword-only, blocking (run off the event loop); each call is its own
transaction, its audit row included, so a refused change leaves the table (and the log) as it was."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.audit import SYSTEM, Actor, changed, record_change
from app.gateway.crud import utcnow
from app.registry.spec import ModelSpec, price_of
from app.tables import RegisteredModel, ServerSetting

PRICE_COLUMNS = (
    "price_input_per_1m",
    "price_cached_input_per_1m",
    "price_output_per_1m",
    "price_batch_input_per_1m",
    "price_batch_output_per_1m",
)


def spec_of(row: RegisteredModel) -> ModelSpec:
    return ModelSpec(
        name=row.name,
        kind=row.kind,
        source=row.source,
        architecture=row.architecture,
        dtype=row.dtype,
        max_model_len=row.max_model_len,
        engine_settings=dict(row.engine_settings or {}),
        aliases=tuple(row.aliases or ()),
        price=price_of(*(getattr(row, c) for c in PRICE_COLUMNS)),
        enabled=row.enabled,
        hardware_cost_per_hour=row.hardware_cost_per_hour,
        sampling_defaults=dict(row.sampling_defaults or {}),
        created_at=row.created_at,
        updated_at=row.updated_at,
        adapter_of=row.adapter_of,
    )


def columns_of(spec: ModelSpec) -> dict[str, Any]:
    price = spec.price
    return {
        "name": spec.name,
        "kind": spec.kind,
        "source": spec.source,
        "architecture": spec.architecture,
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "engine_settings": dict(spec.engine_settings),
        "aliases": list(spec.aliases),
        "enabled": spec.enabled,
        "hardware_cost_per_hour": spec.hardware_cost_per_hour,
        "sampling_defaults": dict(spec.sampling_defaults),
        "price_input_per_1m": None if price is None else price.input_per_1m,
        "price_cached_input_per_1m": None if price is None else price.cached_input_per_1m,
        "price_output_per_1m": None if price is None else price.output_per_1m,
        "price_batch_input_per_1m": None if price is None else price.batch_input_per_1m,
        "price_batch_output_per_1m": None if price is None else price.batch_output_per_1m,
        "adapter_of": spec.adapter_of,
    }


class RegistryStore:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def all(self) -> list[ModelSpec]:
        with self.sessions() as session:
            return [spec_of(row) for row in session.scalars(select(RegisteredModel).order_by(RegisteredModel.id))]

    def insert(self, *, spec: ModelSpec, actor: Actor = SYSTEM) -> ModelSpec:
        now = utcnow()
        with self.sessions() as session, session.begin():
            row = RegisteredModel(**columns_of(spec), created_at=now, updated_at=now)
            session.add(row)
            session.flush()
            _record(session, actor, "model.register", spec.name, None, columns_of(spec))
            return spec_of(row)

    def replace(self, *, name: str, spec: ModelSpec, actor: Actor = SYSTEM) -> ModelSpec:
        """Overwrite the row named `name` (renames included) with `spec`."""
        with self.sessions() as session, session.begin():
            row = session.scalar(select(RegisteredModel).where(RegisteredModel.name == name))
            if row is None:
                raise LookupError(name)
            before = columns_of(spec_of(row))
            for column, value in columns_of(spec).items():
                setattr(row, column, value)
            row.updated_at = utcnow()
            session.flush()
            _record(session, actor, model_action(before, columns_of(spec)), name, *changed(before, columns_of(spec)))
            return spec_of(row)

    def remove(self, *, name: str, actor: Actor = SYSTEM) -> None:
        with self.sessions() as session, session.begin():
            row = session.scalar(select(RegisteredModel).where(RegisteredModel.name == name))
            if row is None:
                return
            before = columns_of(spec_of(row))
            session.delete(row)
            _record(session, actor, "model.remove", name, before, None)

    def setting(self, name: str) -> float | None:
        """A server setting an administrator set (None: never set, the server's flag applies)."""
        with self.sessions() as session:
            row = session.get(ServerSetting, name)
            return None if row is None else row.value

    def set_setting(self, name: str, value: float, *, actor: Actor = SYSTEM) -> None:
        with self.sessions() as session, session.begin():
            row = session.get(ServerSetting, name)
            before = None if row is None else {name: row.value}
            if row is None:
                session.add(ServerSetting(name=name, value=value, updated_at=utcnow()))
            else:
                row.value, row.updated_at = value, utcnow()
            record_change(
                session,
                actor=actor,
                action="setting.update",
                target_type="setting",
                target_id=name,
                before=before,
                after={name: value},
            )

    def record(
        self, *, actor: Actor, action: str, name: str, before: dict[str, Any] | None, after: dict[str, Any] | None
    ) -> None:
        """A change that is not a row (a load, an unload), in a transaction of its own."""
        with self.sessions() as session, session.begin():
            _record(session, actor, action, name, before, after)


def model_action(before: dict[str, Any], after: dict[str, Any]) -> str:
    """model.enable / model.disable when that is what changed, else model.update."""
    if before.get("enabled") != after.get("enabled"):
        return "model.enable" if after.get("enabled") else "model.disable"
    return "model.update"


def _record(
    session: Session, actor: Actor, action: str, name: str, before: dict[str, Any] | None, after: dict[str, Any] | None
) -> None:
    if before == after == {}:  # an update that changed nothing is no change to record
        return
    record_change(session, actor=actor, action=action, target_type="model", target_id=name, before=before, after=after)
