"""Admin API bodies and views. Views never carry a key's hash; only create returns the plaintext."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_serializer, model_validator

from app.gateway.crud import MAX_GRACE_PERIOD_S
from app.gateway.names import check_name
from app.tables import ApiKey, Team

Period = Literal["day", "month"]
Name = Annotated[str, AfterValidator(check_name)]  # no control or bidi-control characters


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # 1e999 is infinity: no budget at all

    allowed_models: list[str] | None = Field(None, description="models this may use; empty = all")
    rpm_limit: int | None = Field(None, ge=0)
    tpm_limit: int | None = Field(None, ge=0)
    max_budget_usd: float | None = Field(None, ge=0)
    budget_period: Period | None = None
    expires_at: datetime | None = None


def _refuse_null(body: BaseModel, *names: str) -> BaseModel:
    """Fields that may be left out of an update but not set to null (the columns hold a value)."""
    for name in names:
        if name in body.model_fields_set and getattr(body, name) is None:
            raise ValueError(f"{name} can't be null; leave it out to keep it")
    return body


class TeamShare(Limits):
    scheduling_weight: float | None = Field(
        None, gt=0, le=1000, description="its share of the engine against other teams; default 1"
    )
    cache_group: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="teams in one group reuse each other's cached prompt prefixes",
    )


class TeamCreate(TeamShare):
    name: Name = Field(min_length=1, max_length=128)
    file_quota_bytes: int | None = Field(
        None, ge=0, le=2**62, description="bytes its files may take in the Files API; null: the server's default"
    )

    _not_null = model_validator(mode="after")(lambda self: _refuse_null(self, "scheduling_weight"))


class TeamUpdate(TeamShare):
    name: Name | None = Field(None, min_length=1, max_length=128)
    blocked: bool | None = None
    file_quota_bytes: int | None = Field(None, ge=0, le=2**62, description="null: the server's default")

    _not_null = model_validator(mode="after")(lambda self: _refuse_null(self, "name", "blocked", "scheduling_weight"))


class KeyCreate(Limits):
    team_id: int
    name: Name = Field("", max_length=128)
    priority_floor: int | None = Field(
        None, ge=-1000, le=1000, description="the most urgent priority its requests may ask for; default 0"
    )
    max_in_flight: int | None = Field(
        None, ge=1, le=100_000, description="requests it may have in flight at once; default: the server's"
    )


class KeyUpdate(Limits):
    name: Name | None = Field(None, max_length=128)
    priority_floor: int | None = Field(None, ge=-1000, le=1000)
    max_in_flight: int | None = Field(None, ge=1, le=100_000)

    _not_null = model_validator(mode="after")(lambda self: _refuse_null(self, "name"))


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    grace_period_s: float = Field(
        86400, ge=0, le=MAX_GRACE_PERIOD_S, description="how long the old secret keeps working; default 24 h"
    )


class _View(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    @field_serializer(
        "created_at", "last_used_at", "expires_at", "rotated_at", "previous_key_expires_at", check_fields=False
    )
    def _utc(self, value: datetime | None) -> str | None:
        return None if value is None else value.replace(tzinfo=UTC).isoformat()


class TeamView(_View):
    object: Literal["team"] = "team"
    id: int
    name: str
    allowed_models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    max_budget_usd: float | None
    budget_period: str
    blocked: bool
    scheduling_weight: float
    cache_group: str | None
    file_quota_bytes: int | None
    expires_at: datetime | None
    created_at: datetime
    last_used_at: datetime | None

    @classmethod
    def of(cls, team: Team) -> TeamView:
        return cls.model_validate(team)


class KeyView(_View):
    object: Literal["api_key"] = "api_key"
    id: int
    team_id: int
    name: str
    key_prefix: str
    allowed_models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    max_budget_usd: float | None
    budget_period: str
    priority_floor: int | None
    max_in_flight: int | None
    expires_at: datetime | None
    revoked: bool
    created_at: datetime
    last_used_at: datetime | None
    rotated_at: datetime | None = None
    previous_key_prefix: str | None = Field(None, description="the secret before the last rotation")
    previous_key_expires_at: datetime | None = Field(None, description="when that secret stops working")

    @classmethod
    def of(cls, key: ApiKey) -> KeyView:
        return cls.model_validate(
            {**{c: getattr(key, c) for c in cls.model_fields if hasattr(key, c)}, "revoked": key.revoked_at is not None}
        )


class KeyCreated(KeyView):
    key: str = Field(description="the API key itself: shown this once, stored only as a hash")


class KeyRotated(KeyCreated):
    """The rotated key with its new secret (shown this once); previous_key_* say until when the old works."""


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: int | None = None
    last_id: int | None = None


class UsageReport(BaseModel):
    object: Literal["list"] = "list"
    group_by: list[str]
    since: str | None
    until: str | None
    data: list[dict[str, Any]]
    has_more: bool


class UsageRequestView(_View):
    id: int
    created_at: datetime
    team_id: int
    key_id: int
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    latency_ms: int
    ttft_ms: int | None
    status: str
    cost_usd: float
