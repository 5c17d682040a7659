"""Tables. Usage rows are thin (numbers and ids, no text blobs); money is integer nano-dollars.
The model registry's table is here too: one metadata, one migration chain."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NANO = 1_000_000_000  # nano-dollars per dollar
BigId = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only


class Base(DeclarativeBase):
    pass


class Team(Base):
    __tablename__ = "teams"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    allowed_models: Mapped[list[str]] = mapped_column(JSON, default=list)  # empty = all
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_budget_usd: Mapped[float | None] = mapped_column(Float)
    budget_period: Mapped[str] = mapped_column(String(8), default="month")  # day | month
    blocked: Mapped[bool] = mapped_column(Boolean, default=False)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime)
    scheduling_weight: Mapped[float] = mapped_column(Float, default=1.0)  # its share of the engine vs other teams
    cache_group: Mapped[str | None] = mapped_column(String(64))  # teams in one group reuse each other's prefixes
    file_quota_bytes: Mapped[int | None] = mapped_column(BigInteger)  # Files API storage; None: the server's default

    __table_args__ = (
        Index(
            "uq_teams_live_name",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
    )


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the plaintext
    key_prefix: Mapped[str] = mapped_column(String(24))  # shown in lists: "sk-AbCd1234"
    allowed_models: Mapped[list[str]] = mapped_column(JSON, default=list)
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_budget_usd: Mapped[float | None] = mapped_column(Float)
    budget_period: Mapped[str] = mapped_column(String(8), default="month")
    expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime)
    # The most urgent `priority` its requests may ask for (lower runs first); None: 0, so only an admin
    # lets a key jump ahead, while any key may ask to go later.
    priority_floor: Mapped[int | None] = mapped_column(Integer)
    max_in_flight: Mapped[int | None] = mapped_column(Integer)  # requests at once; None: the server's setting
    # Rotation: the secret before the last rotation keeps working until previous_key_expires_at (the
    # grace period), under this same key id, so clients move over without downtime.
    previous_key_hash: Mapped[str | None] = mapped_column(String(64), unique=True)
    previous_key_prefix: Mapped[str | None] = mapped_column(String(24))
    previous_key_expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    rotated_at: Mapped[datetime | None] = mapped_column(DateTime)


class AdminCredential(Base):
    __tablename__ = "admin_credentials"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(24))
    created_at: Mapped[datetime] = mapped_column(DateTime)


class UsageRow(Base):
    """One row per request. Times are naive UTC."""

    __tablename__ = "usage"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)  # when the request arrived
    team_id: Mapped[int] = mapped_column(Integer)
    key_id: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(128))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    latency_ms: Mapped[int] = mapped_column(Integer, default=0)
    ttft_ms: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # ok aborted error rejected rate_limited over_budget forbidden
    cost_nano_usd: Mapped[int] = mapped_column(BigInteger, default=0)
    replica: Mapped[str | None] = mapped_column(String(64))  # which replica served it; None: a single process
    batch: Mapped[bool] = mapped_column(Boolean, default=False)  # a line of a batch (Batch API), at the batch price

    __table_args__ = (
        Index("ix_usage_created_at", "created_at"),
        Index("ix_usage_team_created", "team_id", "created_at"),
        Index("ix_usage_key_created", "key_id", "created_at"),
    )


class UsageDaily(Base):
    """Daily roll-up kept by the usage writer in the same transaction as the rows it sums."""

    __tablename__ = "usage_daily"

    day: Mapped[date] = mapped_column(Date, primary_key=True)
    key_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    team_id: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_nano_usd: Mapped[int] = mapped_column(BigInteger, default=0)

    __table_args__ = (
        Index("ix_usage_daily_team_day", "team_id", "day"),
        Index("ix_usage_daily_key_day", "key_id", "day"),
    )


class RegisteredModel(Base):
    """A model the operator registered: where its weights are, how to run it, what it is called and what
    it costs. Loading is a property of a running process, not of this row (see app.registry.pool)."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # chat | embedding
    source: Mapped[str] = mapped_column(String(1024))  # a safetensors folder, a .gguf file, or "default"
    architecture: Mapped[str] = mapped_column(String(64))  # as checked at registration (config model_type)
    dtype: Mapped[str] = mapped_column(String(16))
    max_model_len: Mapped[int | None] = mapped_column(Integer)  # None: the checkpoint's
    engine_settings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # EngineConfig overrides
    aliases: Mapped[list[str]] = mapped_column(JSON, default=list)
    price_input_per_1m: Mapped[float | None] = mapped_column(Float)  # USD; all None: no price sheet
    price_cached_input_per_1m: Mapped[float | None] = mapped_column(Float)
    price_output_per_1m: Mapped[float | None] = mapped_column(Float)
    # Batch API prices; None: half the interactive price (OpenAI's batch discount).
    price_batch_input_per_1m: Mapped[float | None] = mapped_column(Float)
    price_batch_output_per_1m: Mapped[float | None] = mapped_column(Float)
    hardware_cost_per_hour: Mapped[float | None] = mapped_column(Float)  # USD; None: a share of the server's
    sampling_defaults: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # what requests that set none get
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    updated_at: Mapped[datetime] = mapped_column(DateTime)
    adapter_of: Mapped[str | None] = mapped_column(String(128))  # a LoRA adapter's base model; None: a model


class StoredResponse(Base):
    """A response made with `store` (POST /v1/responses), as it was returned; readable by its team only
    until it expires (the retention setting)."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_...
    team_id: Mapped[int | None] = mapped_column(Integer)  # None: a server without teams (one shared key)
    model: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime] = mapped_column(DateTime)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the Response object
    # True: its items are this turn's own input only, the earlier turns are read through the chain of
    # body["previous_response_id"]; False (rows from before): its items are the whole conversation.
    chained: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))

    __table_args__ = (
        Index("ix_responses_team_created", "team_id", "created_at"),
        Index("ix_responses_expires_at", "expires_at"),
    )


class StoredResponseItem(Base):
    """One input item of a stored response, in order: the items its own request sent (earlier turns are
    stored once, with their own responses, and read back through previous_response_id)."""

    __tablename__ = "response_input_items"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    response_id: Mapped[str] = mapped_column(ForeignKey("responses.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    item: Mapped[dict[str, Any]] = mapped_column(JSON)

    __table_args__ = (Index("uq_response_input_items_position", "response_id", "position", unique=True),)


class AdminSession(Base):
    """A dashboard login: one row while it is open, so that logging out ends it on every replica and
    process. Keyed by the SHA-256 of the session id (the id itself only ever lives in the cookie). The
    role lives here, not in the cookie: the database says what a session may do."""

    __tablename__ = "admin_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    # Who: the admin key (subject None) or an SSO login; role "admin", "viewer" or "team" (of team_id).
    role: Mapped[str] = mapped_column(String(16), server_default="admin")
    subject: Mapped[str | None] = mapped_column(String(255))
    email: Mapped[str | None] = mapped_column(String(320))
    team_id: Mapped[int | None] = mapped_column(Integer)


class StoredFile(Base):
    """A file of the Files API: its bytes live in the files folder under its id, this row says whose it is."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # file-...
    team_id: Mapped[int | None] = mapped_column(Integer)
    purpose: Mapped[str] = mapped_column(String(32))  # batch | user_data | batch_output
    filename: Mapped[str] = mapped_column(String(256))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime)  # gone from then on; None: kept until deleted

    __table_args__ = (
        Index("ix_files_team_created", "team_id", "created_at"),
        Index("ix_files_expires_at", "expires_at"),
    )


class BatchJob(Base):
    """A batch of the Batch API: one input file run line by line at the lowest priority. Times are naive UTC."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # batch_...
    team_id: Mapped[int | None] = mapped_column(Integer)
    key_id: Mapped[int | None] = mapped_column(Integer)  # whose limits and budget the lines run under
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    batch_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[Any] | None] = mapped_column(JSON)  # why the whole batch failed, OpenAI's `errors.data`
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer)  # its output / error files expire then
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime] = mapped_column(DateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime)
    failed_at: Mapped[datetime | None] = mapped_column(DateTime)
    expired_at: Mapped[datetime | None] = mapped_column(DateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime)
    # The runner (one per process) that holds the batch, until when: replicas sharing the database never
    # run one batch at once, and a runner that died (SIGKILL) lets go when its lease runs out.
    runner_id: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime)

    __table_args__ = (
        Index("ix_batches_team_created", "team_id", "created_at"),
        Index("ix_batches_status", "status"),
    )


class BatchLine(Base):
    """One finished line of a batch, written as it finishes: a restart skips the lines found here, and
    the key makes a line impossible to record twice."""

    __tablename__ = "batch_lines"

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    line_number: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str | None] = mapped_column(String(512))
    status_code: Mapped[int] = mapped_column(Integer)  # 200: the output file; anything else: the error file
    result: Mapped[dict[str, Any]] = mapped_column(JSON)  # the output or error file's line, as written there


class AuditEntry(Base):
    """One admin change (app.gateway.audit): who, what, on what, the values before and after (never a
    secret). Written in the change's own transaction; pruned after the retention setting."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)  # naive UTC
    actor_kind: Mapped[str] = mapped_column(String(16))  # admin_key | sso | cli | system
    actor_id: Mapped[str] = mapped_column(String(255))
    actor_display: Mapped[str] = mapped_column(String(255), default="")
    action: Mapped[str] = mapped_column(String(64))  # "<target_type>.<verb>", e.g. key.rotate
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str | None] = mapped_column(String(255))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    __table_args__ = (
        Index("ix_audit_log_created_at", "created_at"),
        Index("ix_audit_log_actor", "actor_id", "created_at"),
        Index("ix_audit_log_target", "target_type", "target_id", "created_at"),
    )


class ServerSetting(Base):
    """A server-wide setting an administrator changed at run time (the dashboard or the admin API): it
    outlives a restart and reaches every replica sharing the database. Only the names the code reads:
    hardware_cost_per_hour (USD, the real-cost view's numerator)."""

    __tablename__ = "server_settings"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(DateTime)


class ReservationHold(Base):
    """What one process (holder) has set aside in one scope for requests in flight, where Redis is not
    configured (app/gateway/holds_store.py): nano USD against a budget, or seats of a key's in-flight
    cap. A holder's heartbeat keeps alive_until (unix seconds) ahead; past it, a dead replica's rows
    stop counting."""

    __tablename__ = "reservation_holds"

    scope: Mapped[str] = mapped_column(String(96), primary_key=True)
    holder: Mapped[str] = mapped_column(String(96), primary_key=True)
    amount: Mapped[int] = mapped_column(BigInteger, default=0)
    alive_until: Mapped[float] = mapped_column(Float)
