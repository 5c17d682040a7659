"""Registry rows <-> ModelSpecs. Keyword-only, blocking (run off the event loop); each call is its own
transaction, so a refused change leaves the table as it was."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

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
    }


class RegistryStore:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def all(self) -> list[ModelSpec]:
        with self.sessions() as session:
            return [spec_of(row) for row in session.scalars(select(RegisteredModel).order_by(RegisteredModel.id))]

    def insert(self, *, spec: ModelSpec) -> ModelSpec:
        now = utcnow()
        with self.sessions() as session, session.begin():
            row = RegisteredModel(**columns_of(spec), created_at=now, updated_at=now)
            session.add(row)
            session.flush()
            return spec_of(row)

    def replace(self, *, name: str, spec: ModelSpec) -> ModelSpec:
        """Overwrite the row named `name` (renames included) with `spec`."""
        with self.sessions() as session, session.begin():
            row = session.scalar(select(RegisteredModel).where(RegisteredModel.name == name))
            if row is None:
                raise LookupError(name)
            for column, value in columns_of(spec).items():
                setattr(row, column, value)
            row.updated_at = utcnow()
            session.flush()
            return spec_of(row)

    def remove(self, *, name: str) -> None:
        with self.sessions() as session, session.begin():
            session.execute(delete(RegisteredModel).where(RegisteredModel.name == name))

    def setting(self, name: str) -> float | None:
        """A server setting an administrator set (None: never set, the server's flag applies)."""
        with self.sessions() as session:
            row = session.get(ServerSetting, name)
            return None if row is None else row.value

    def set_setting(self, name: str, value: float) -> None:
        with self.sessions() as session, session.begin():
            row = session.get(ServerSetting, name)
            if row is None:
                session.add(ServerSetting(name=name, value=value, updated_at=utcnow()))
            else:
                row.value, row.updated_at = value, utcnow()
