"""Server settings: read once from CLI flags and TOKENMILL_* env vars, validated, passed down frozen.

Precedence: a flag given on the command line, then its environment variable, then the default.
Every flag `--some-name` has the variable `TOKENMILL_SOME_NAME`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.dashboard.sso_config import DEFAULT_SCOPES, SsoConfig
from engine.config import EngineConfig


def default_database_url(data_dir: str | os.PathLike[str]) -> str:
    """The database when none is configured: a SQLite file in the data folder."""
    return f"sqlite:///{Path(data_dir) / 'tokenmill.db'}"


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the flag and its variable."""


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: str = ".tokenmill"
    database_url: str = ""  # empty: a SQLite file in data_dir
    redis_url: str | None = None
    api_key: str | None = None  # serve: a key of team 'default'; without the gateway (tests): the only key
    admin_key: str | None = None
    max_request_bytes: int = 2 * 1024 * 1024
    max_tokens_cap: int = 4096  # upper bound for max_tokens, and the default when a request omits it
    hardware_cost_per_hour: float = 0.0  # USD per hour of this machine: the dashboard's real cost per token
    session_secret: str | None = None  # signs admin dashboard sessions; None: random per process
    secure_cookies: bool = False  # always mark dashboard cookies Secure (behind a proxy that ends TLS)
    # Proxies whose X-Forwarded-For / -Proto are believed (comma-separated IPs or CIDRs, "*": any);
    # empty: none, the peer's own address is the client's.
    forwarded_allow_ips: str = ""
    load_on_demand: bool = False  # a request for an enabled, unloaded model loads it (else 503 model_not_loaded)
    api_docs: bool = False  # /docs (Swagger UI, from a CDN) and /openapi.json, open to anyone who can connect
    min_replicas: int = 1  # Ray Serve autoscaling bounds (deploy/ray_serve.py); plain `serve` is one process
    max_replicas: int = 1
    # Which prefix-cache blocks a request may reuse: "team" (its team's, or its team's cache group's) or
    # "global" (anyone's: faster for shared prompts, but one team can time what another's prompts begin with).
    prefix_cache_scope: Literal["team", "global"] = "team"
    # Clients that never send a temperature (Codex CLI) sample at OpenAI's 1.0 unless this says otherwise.
    default_temperature: float | None = None
    response_retention_days: float = 30.0  # stored responses (Responses API, store=true) are deleted after this
    audit_retention_days: float = 365.0  # audit log rows (who changed what) are pruned after this
    # The gateway's knobs (app.gateway.config.GatewayConfig.from_settings takes them from here).
    model_prices: str = ""  # JSON, USD per 1M tokens per model for models the registry has no price for
    rate_window_s: float = 60.0  # rpm / tpm window
    key_cache_ttl_s: float = 5.0  # how stale a replica may see a key changed elsewhere
    usage_flush_interval_s: float = 0.5
    auth_failures_per_minute: int = 10  # per client address and key prefix, then 429; 0: no limit
    max_in_flight_per_key: int = 0  # requests one key may have running at once (a key's own field wins); 0: no limit
    instance_id: str | None = None  # this replica's name on its usage rows (a Ray Serve replica id, a pod name)
    files_dir: str = ""  # bytes of the Files API; empty: "files" in data_dir
    max_file_bytes: int = 100 * 1024 * 1024  # largest upload to /v1/files
    default_file_quota_bytes: int = 1024**3  # what a team's files may take in all, unless its own quota says
    max_batch_lines: int = 50_000  # most requests in one batch's input file
    batch_max_in_flight: int = 8  # batch lines in the engine at once (all batches together)
    # Single sign-on to the dashboard (OpenID Connect); empty issuer: the admin key is the only login.
    oidc_issuer: str = ""
    oidc_client_id: str = ""
    oidc_client_secret: str | None = None
    oidc_allowed_domains: str = ""  # "example.com, ops.example.com=admin": who may sign in, and a role by domain
    oidc_group_claim: str = ""  # the ID token claim that lists a user's groups, e.g. "groups"
    oidc_group_roles: str = ""  # "tokenmill-admins=admin, analysts=viewer, ml-team=team:ml"
    oidc_scopes: str = DEFAULT_SCOPES
    oidc_redirect_url: str = ""  # the callback URL registered at the provider; empty: from the request
    files_sweep_interval_s: float = 60.0  # how often expired files are deleted (they are 404 from expiry on)
    batch_lease_s: float = 30.0  # how long a killed replica's batch waits before another takes it over
    engine: EngineConfig = field(default_factory=EngineConfig)
    sso: SsoConfig | None = field(default=None, init=False, compare=False)  # parsed from the oidc_* fields

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError("port must be between 0 and 65535")
        if self.max_request_bytes < 1024:
            raise SettingsError("max_request_bytes must be at least 1024")
        if self.max_tokens_cap < 1:
            raise SettingsError("max_tokens_cap must be at least 1")
        if not 0 <= self.hardware_cost_per_hour < math.inf:
            raise SettingsError("hardware_cost_per_hour must be a finite number, not negative")
        if self.max_in_flight_per_key < 0:
            raise SettingsError("max_in_flight_per_key must be 0 (no limit) or more")
        if self.prefix_cache_scope not in ("team", "global"):
            raise SettingsError("prefix_cache_scope must be 'team' or 'global'")
        if self.default_temperature is not None and not 0 <= self.default_temperature <= 2:
            raise SettingsError("default_temperature must be between 0 and 2")
        if not 0 < self.response_retention_days < math.inf:
            raise SettingsError("response_retention_days must be a positive, finite number")
        if not 0 < self.audit_retention_days < math.inf:
            raise SettingsError("audit_retention_days must be a positive, finite number")
        if self.rate_window_s <= 0 or self.usage_flush_interval_s <= 0 or self.key_cache_ttl_s < 0:
            raise SettingsError(
                "rate_window_s and usage_flush_interval_s must be positive, key_cache_ttl_s not negative"
            )
        if self.model_prices:
            try:
                json.loads(self.model_prices)
            except ValueError:
                raise SettingsError("model_prices must be JSON, e.g. {\"my-model\": [0.15, 0.075, 0.6]}") from None
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise SettingsError("replicas: need 1 <= min_replicas <= max_replicas")
        for entry in filter(None, (part.strip() for part in self.forwarded_allow_ips.split(","))):
            if entry != "*":
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError:
                    raise SettingsError(f"forwarded_allow_ips: {entry!r} is not an IP address or network") from None
        if self.max_file_bytes < 1:
            raise SettingsError("max_file_bytes must be at least 1")
        if self.default_file_quota_bytes < 0:
            raise SettingsError("default_file_quota_bytes must not be negative")
        if self.max_batch_lines < 1:
            raise SettingsError("max_batch_lines must be at least 1")
        if self.batch_max_in_flight < 1:
            raise SettingsError("batch_max_in_flight must be at least 1")
        if self.oidc_issuer:
            try:
                sso = SsoConfig.parse(
                    issuer=self.oidc_issuer,
                    client_id=self.oidc_client_id,
                    client_secret=self.oidc_client_secret,
                    allowed_domains=self.oidc_allowed_domains,
                    group_claim=self.oidc_group_claim,
                    group_roles=self.oidc_group_roles,
                    scopes=self.oidc_scopes,
                    redirect_url=self.oidc_redirect_url,
                )
            except ValueError as error:
                raise SettingsError(str(error)) from None
            object.__setattr__(self, "sso", sso)
        if self.files_sweep_interval_s <= 0:
            raise SettingsError("files_sweep_interval_s must be positive")
        if self.batch_lease_s < 1:
            raise SettingsError("batch_lease_s must be at least 1")
        if not self.files_dir:
            object.__setattr__(self, "files_dir", str(Path(self.data_dir) / "files"))
        if not self.database_url:
            object.__setattr__(self, "database_url", default_database_url(self.data_dir))

    @property
    def response_retention_s(self) -> float:
        return self.response_retention_days * 86400

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class Option:
    flag: str
    field: str  # a Settings field, or an EngineConfig field when engine=True
    parse: Callable[[str], Any]
    help: str
    engine: bool = False
    switch: bool = False  # a flag without a value
    invert: bool = False  # the flag turns the field off (--no-prefix-caching)
    choices: tuple[str, ...] | None = None
    fallback_env: str | None = None  # a conventional unprefixed variable, read after ours

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return "TOKENMILL_" + self.dest.upper()


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none", "auto") else int(text)


OPTIONS: tuple[Option, ...] = (
    Option("--host", "host", str, "address to bind"),
    Option("--port", "port", int, "port to bind"),
    Option("--data-dir", "data_dir", str, "folder for the SQLite file and converted weights"),
    Option(
        "--database-url",
        "database_url",
        str,
        "SQLAlchemy URL (default: SQLite in the data folder)",
        fallback_env="DATABASE_URL",
    ),
    Option("--redis-url", "redis_url", str, "Redis for shared rate-limit counters", fallback_env="REDIS_URL"),
    Option(
        "--api-key",
        "api_key",
        str,
        "a key clients may use, stored hashed under team 'default' (more keys: tokenmill keys create)",
    ),
    Option("--admin-key", "admin_key", str, "admin key (default: created on first start)"),
    Option("--max-request-bytes", "max_request_bytes", int, "largest request body accepted"),
    Option("--max-tokens-cap", "max_tokens_cap", int, "largest max_tokens a request may ask for"),
    Option(
        "--hardware-cost-per-hour",
        "hardware_cost_per_hour",
        float,
        "USD per hour this machine costs (the dashboard's real cost per token)",
    ),
    Option("--session-secret", "session_secret", str, "signs admin dashboard sessions (default: random per process)"),
    Option(
        "--forwarded-allow-ips",
        "forwarded_allow_ips",
        str,
        "proxies trusted to set X-Forwarded-For / -Proto: comma-separated IPs or CIDRs (default: none)",
    ),
    Option(
        "--secure-cookies",
        "secure_cookies",
        parse_bool,
        "always mark dashboard cookies Secure (set it behind a proxy that terminates TLS)",
        switch=True,
    ),
    Option(
        "--load-on-demand",
        "load_on_demand",
        parse_bool,
        "load an enabled registered model when a request asks for it (default: 503 model_not_loaded)",
        switch=True,
    ),
    Option(
        "--api-docs",
        "api_docs",
        parse_bool,
        "serve /docs and /openapi.json to anyone (Swagger UI loads from a CDN; default: off)",
        switch=True,
    ),
    Option("--min-replicas", "min_replicas", int, "fewest replicas Ray Serve keeps (deploy/ray_serve.py)"),
    Option("--max-replicas", "max_replicas", int, "most replicas Ray Serve scales to (deploy/ray_serve.py)"),
    Option(
        "--default-temperature",
        "default_temperature",
        float,
        "temperature for requests that set none (default: 1.0, as OpenAI's)",
    ),
    Option(
        "--model-prices",
        "model_prices",
        str,
        'USD per 1M tokens for models the registry prices not: JSON, '
        '{"model": {"input": 0.15, "cached_input": 0.075, "output": 0.6}}, "*" for any other model',
    ),
    Option("--rate-window-s", "rate_window_s", float, "the window of rpm / tpm limits, in seconds"),
    Option(
        "--key-cache-ttl-s",
        "key_cache_ttl_s",
        float,
        "how long a key's limits are cached (a change made on another replica shows up after this)",
    ),
    Option("--usage-flush-interval-s", "usage_flush_interval_s", float, "how often queued usage rows are written"),
    Option(
        "--auth-failures-per-minute",
        "auth_failures_per_minute",
        int,
        "failed authentications per client address and key prefix before 429 (0: no limit)",
    ),
    Option(
        "--max-in-flight-per-key",
        "max_in_flight_per_key",
        int,
        "requests one key may have in flight on a replica (a key's max_in_flight wins; 0: no limit)",
    ),
    Option(
        "--instance-id",
        "instance_id",
        str,
        "this replica's name on its usage rows (Ray Serve sets it per replica; in Kubernetes, the pod name)",
    ),
    Option(
        "--response-retention-days",
        "response_retention_days",
        float,
        "how long stored responses (Responses API) are kept before they are pruned",
    ),
    Option(
        "--audit-retention-days",
        "audit_retention_days",
        float,
        "how long audit log rows (who changed what, when) are kept before they are pruned",
    ),
    Option(
        "--files-dir",
        "files_dir",
        str,
        "folder for the bytes of uploaded and batch output files (default: files in the data folder)",
    ),
    Option("--max-file-bytes", "max_file_bytes", int, "largest file /v1/files accepts"),
    Option(
        "--default-file-quota-bytes",
        "default_file_quota_bytes",
        int,
        "bytes a team's files may take in all (a team's own file_quota_bytes goes over it)",
    ),
    Option("--max-batch-lines", "max_batch_lines", int, "most requests in one batch"),
    Option(
        "--batch-max-in-flight",
        "batch_max_in_flight",
        int,
        "batch lines in the engine at once; each runs at the lowest priority",
    ),
    Option(
        "--oidc-issuer", "oidc_issuer", str, "OpenID Connect issuer URL for dashboard single sign-on (off when empty)"
    ),
    Option("--oidc-client-id", "oidc_client_id", str, "the dashboard's client id at the identity provider"),
    Option("--oidc-client-secret", "oidc_client_secret", str, "the dashboard's client secret (none: a public client)"),
    Option(
        "--oidc-allowed-domains",
        "oidc_allowed_domains",
        str,
        "email domains that may sign in, each with an optional role: example.com, ops.example.com=admin",
    ),
    Option("--oidc-group-claim", "oidc_group_claim", str, "the ID token claim listing a user's groups (e.g. groups)"),
    Option(
        "--oidc-group-roles",
        "oidc_group_roles",
        str,
        "group=role pairs: tokenmill-admins=admin, analysts=viewer, ml-team=team:ml",
    ),
    Option("--oidc-scopes", "oidc_scopes", str, f"scopes asked for (default: {DEFAULT_SCOPES})"),
    Option(
        "--oidc-redirect-url",
        "oidc_redirect_url",
        str,
        "the callback registered at the provider, https://HOST/admin/sso/callback (default: from the request)",
    ),
    Option(
        "--batch-lease-s",
        "batch_lease_s",
        float,
        "seconds a batch stays with a replica that stopped renewing it (one killed) before another resumes it",
    ),
    Option("--model", "model", str, "'default' (embedded SmolLM2), a HF folder or a .gguf file", engine=True),
    Option("--served-model-name", "served_model_name", str, "model id clients use", engine=True),
    Option(
        "--dtype",
        "dtype",
        str,
        "activations, unquantized weights and (see --kv-cache-dtype) KV cache dtype",
        engine=True,
        choices=("float32", "bfloat16"),
    ),
    Option(
        "--quantization",
        "quantization",
        str,
        "weight-only quantization of the linears (CPU): int8 per channel, "
        "int4 in groups of 32; auto (default): int4 for Q4_0/Q4_1 GGUF files such as the embedded model, "
        "on CPUs with AVX2 or AVX-512",
        engine=True,
        choices=("auto", "none", "int8", "int4"),
    ),
    Option(
        "--kv-cache-dtype",
        "kv_cache_dtype",
        str,
        "KV cache element type: auto (default): the activations' (--dtype), except bfloat16 under float32 "
        "activations with int8/int4 weights, where it holds twice the tokens per GiB and decodes many "
        "sequences faster; float32 or bfloat16 to choose",
        engine=True,
        choices=("auto", "float32", "bfloat16"),
    ),
    Option(
        "--speculation",
        "speculation",
        str,
        "speculative decoding from n-gram drafts of each sequence's own text (greedy output unchanged): "
        "ngram, off, or auto (default): ngram in float32 unless decode steps replay CUDA graphs",
        engine=True,
        choices=("auto", "ngram", "off"),
    ),
    Option("--block-size", "block_size", int, "tokens per KV block", engine=True),
    Option(
        "--num-kv-blocks",
        "num_kv_blocks",
        _optional_int,
        "KV pool size in blocks (wins over --kv-cache-memory-gb)",
        engine=True,
    ),
    Option("--kv-cache-memory-gb", "kv_cache_memory_gb", float, "KV pool size in GiB", engine=True),
    Option("--max-num-seqs", "max_num_seqs", int, "most sequences in one step", engine=True),
    Option("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step", engine=True),
    Option(
        "--max-step-seconds",
        "max_step_seconds",
        float,
        "a step's budget shrinks to about this much measured time (0: tokens only)",
        engine=True,
    ),
    Option("--max-model-len", "max_model_len", _optional_int, "context length (default: the model's)", engine=True),
    Option("--max-waiting", "max_waiting", int, "waiting requests before new ones get 503", engine=True),
    Option(
        "--preemption-mode",
        "preemption_mode",
        str,
        "how to make room when KV blocks run out",
        engine=True,
        choices=("recompute", "swap"),
    ),
    Option(
        "--no-prefix-caching",
        "enable_prefix_caching",
        parse_bool,
        "turn off prefix caching",
        engine=True,
        switch=True,
        invert=True,
    ),
    Option(
        "--prefix-cache-scope",
        "prefix_cache_scope",
        str,
        "who reuses whose cached prompt prefixes: team (own team or cache group) or global",
        choices=("team", "global"),
    ),
    Option(
        "--scheduling",
        "scheduling",
        str,
        "fair (least-served team first) or fcfs (arrival order)",
        engine=True,
        choices=("fair", "fcfs"),
    ),
    Option("--num-threads", "num_threads", _optional_int, "torch threads (default: torch's choice)", engine=True),
    Option("--device", "device", str, "auto (cuda when available), cpu, cuda or cuda:N", engine=True),
    Option(
        "--enforce-eager", "enforce_eager", parse_bool, "no CUDA-graph replay of decode steps", engine=True, switch=True
    ),
)


# Variables read where they are used, not through Settings, and why: the kernels are built and loaded
# (also by deploy/bundle.py, with no server and no Settings) on the first call into kernels/, far below
# where Settings reach; the memory check's switch is for tests and for an operator who knows better than the
# estimate. `tokenmill serve --help` lists them after the flags.
ENVIRONMENT_ONLY: dict[str, str] = {
    "TOKENMILL_NATIVE_KERNELS": "0 turns the compiled CPU kernels off (the torch paths run)",
    "TOKENMILL_KERNEL_CACHE": "where compiled kernels are cached (default ~/.cache/tokenmill/kernels)",
    "TOKENMILL_PREBUILT_KERNELS": "a folder of prebuilt kernels (default: kernels/prebuilt in the package)",
    "TOKENMILL_SKIP_MEMORY_CHECK": "1 loads a model even where the memory estimate says it won't fit",
}


def environment_only_help() -> str:
    return "environment only:\n" + "\n".join(f"  {name}  {text}" for name, text in ENVIRONMENT_ONLY.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags default to None so that an unset flag falls through to its variable."""
    for option in OPTIONS:
        help_text = f"{option.help} [env {option.env}]"
        if option.switch:
            parser.add_argument(
                option.flag, dest=option.dest, action="store_const", const=True, default=None, help=help_text
            )
        else:
            parser.add_argument(
                option.flag, dest=option.dest, default=None, choices=option.choices, type=option.parse, help=help_text
            )


def settings_from(args: Mapping[str, Any], env: Mapping[str, str]) -> Settings:
    server_values: dict[str, Any] = {}
    engine_values: dict[str, Any] = {}
    for option in OPTIONS:
        value = _resolve(option, args, env)
        if value is None:
            continue
        (engine_values if option.engine else server_values)[option.field] = (not value) if option.invert else value
    try:
        data_dir = server_values.get("data_dir", Settings.data_dir)
        engine_values.setdefault("quantization", "auto")  # the server's default; EngineConfig's stays none
        engine_config = EngineConfig(data_dir=data_dir, **engine_values)
        return Settings(engine=engine_config, **server_values)
    except (ValueError, TypeError) as error:
        raise SettingsError(str(error)) from error


def _env_value(option: Option, env: Mapping[str, str]) -> str | None:
    for name in (option.env, option.fallback_env):
        if name and env.get(name) not in (None, ""):
            return env[name]
    return None


def _resolve(option: Option, args: Mapping[str, Any], env: Mapping[str, str]) -> Any:
    if args.get(option.dest) is not None:
        return args[option.dest]
    text = _env_value(option, env)
    if text is None:
        return None
    try:
        value = option.parse(text)
    except ValueError as error:
        raise SettingsError(f"{option.env}={text!r} is not valid for {option.flag}: {error}") from error
    if option.choices and value not in option.choices:
        raise SettingsError(f"{option.env} must be one of {', '.join(option.choices)}, got {text!r}")
    return value
