"""One validated settings class per process; environment variables are read only here.

Each field is documented; a value that cannot work is refused at start with a message
that says which variable to change. Defaults that two processes must agree on (the
prompt limit, the default model, how long results are kept, the consumers' AckWait)
live once, in `CommonSettings`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO = Path(__file__).resolve().parents[1]


def _default_models_dir() -> str:
    return str(REPO.parent / "shared" / "models")


def _default_state_dir() -> str:
    """The project's `.arena` (the checkout this code runs from), so the operator commands
    find `arena up`'s state from any directory; where the code is not a checkout (an
    installed wheel), `.arena` in the working directory."""
    return str(REPO / ".arena") if (REPO / "pyproject.toml").is_file() else ".arena"


class NatsClient(BaseSettings):
    """How a process, or the `arena` command, authenticates to NATS (read by
    `runtime.jetstream.connect_options`)."""

    nats_user: str | None = Field(None, description="NATS user of this process (per-role permissions).")
    nats_password: SecretStr | None = Field(None, description="Its password (from a Secret on Kubernetes).")
    nats_tls_ca: str | None = Field(None, description="CA file that signed the NATS server's certificate: TLS on.")
    nats_tls_cert: str | None = Field(None, description="Client certificate for NATS (with ARENA_NATS_TLS_KEY).")
    nats_tls_key: str | None = Field(None, description="Key of the client certificate for NATS.")

    @model_validator(mode="after")
    def _nats_tls(self) -> NatsClient:
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ValueError(
                "a NATS client certificate needs its key: set both ARENA_NATS_TLS_CERT and ARENA_NATS_TLS_KEY"
            )
        return self


class CommonSettings(NatsClient):
    model_config = SettingsConfigDict(env_prefix="ARENA_", extra="ignore", env_nested_delimiter="__")

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        validation_alias=AliasChoices("NATS_URL", "ARENA_NATS_URL"),
        description="NATS server with JetStream.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("REDIS_URL", "ARENA_REDIS_URL"),
        description="Redis for results, idempotency keys and conversation seeds; rediss:// for TLS "
        "(e.g. rediss://host:6380/0?ssl_ca_certs=/etc/arena/tls/ca.crt); "
        "redis+sentinel://[:password@]host:port[,host:port]/service[/db] for a master found through Sentinel.",
    )
    manage_topology: bool = Field(
        True,
        description="Create or update the stream and the durables at start. Off where per-role NATS users may "
        "not (then the operator creates them: `arena up`, `arena topology`) and the process waits for them.",
    )
    instance_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Names this process in heartbeats and logs.",
    )
    retention_days: float = Field(7.0, gt=0, description="Max age of events kept in the stream.")
    log_level: str = Field("INFO", description="Python log level of the process.")
    heartbeat_s: float = Field(1.0, gt=0, description="How often a process announces itself.")
    default_model: str = Field("stories-260k", description="Model used when a request names none.")
    max_prompt_chars: int = Field(
        32_000,
        ge=1,
        description="Longest prompt (all messages' characters); the gateway and the filter both refuse more.",
    )
    result_ttl_s: int = Field(1800, ge=1, description="How long results, idempotency keys and seeds are kept in Redis.")
    # Consumer definitions are created by whichever process starts first, so every
    # process must compute the same ones.
    ack_wait_s: float = Field(
        4.0,
        gt=1,
        description="Inference AckWait: a dead worker's requests go to another after it. Live workers "
        "send in-progress acks every third of it, so it can be a small part of the 15 s deadline.",
    )
    max_ack_pending: int = Field(256, ge=1, description="Most unacked requests the inference group holds.")
    stream_replicas: int = Field(
        1, ge=1, le=5, description="Replicas of the stream (and its consumers): 1 on one server, 3 on a cluster."
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Consumer processes: /healthz, /readyz and /metrics; 0 picks a free port."
    )
    http_host: str = Field("127.0.0.1", description="Address of that endpoint (0.0.0.0 in a container).")
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector (OTLP/HTTP, e.g. http://127.0.0.1:4318): each request's trace is "
        "exported there. Unset: tracing is off and costs nothing.",
    )

    def topology(self) -> dict:
        return {
            "ack_wait_s": self.ack_wait_s,
            "max_ack_pending": self.max_ack_pending,
            "replicas": self.stream_replicas,
        }


class FilterSettings(CommonSettings):
    workers: int = Field(4, ge=1, le=256, description="Messages handled concurrently.")
    filter: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of consumers.filter.config.FilterConfig, e.g. ARENA_FILTER__REJECT_THRESHOLD=0.8.",
    )


class DeliverySettings(CommonSettings):
    workers: int = Field(8, ge=1, le=256, description="Messages handled concurrently.")


class InferenceSettings(CommonSettings):
    models_config: str | None = Field(None, description="YAML/JSON file listing served models.")
    models_dir: str = Field(
        default_factory=_default_models_dir, description="Where relative model paths are looked up."
    )
    warm_models: list[str] | None = Field(None, description="Loaded at start; default: the default model.")
    model_cache: str = Field(
        str(Path.home() / ".cache" / "arenaflow" / "models"),
        description="Where a GGUF model source is converted to a checkpoint once (a directory per file hash).",
    )
    engine: str = Field("continuous", description="'static' (padded micro-batches) or 'continuous'.")
    max_batch_size: int = Field(
        64,
        ge=1,
        le=512,
        description="Most requests decoded together (stories260K on one thread: 1,786 tokens/s at 32, 2,230 at 64).",
    )
    max_wait_ms: int = Field(
        10, ge=0, le=10_000, description="Static engine: longest a micro-batch waits to fill before it starts."
    )
    chunk_tokens: int = Field(4, ge=1, le=256, description="Tokens per TokensGenerated event.")
    memory_budget_mb: float | None = Field(None, gt=0, description="Model pool budget; default: 60% of RAM.")
    kv_cache_mb: float = Field(
        4096,
        gt=0,
        description="Each model engine's KV cache budget (vLLM's CPU default): a request joins a batch only while "
        "every row at its longest fits; one that alone cannot is a 400.",
    )
    cuda_memory_fraction: float = Field(
        0.85,
        gt=0,
        le=1,
        description="On CUDA: the share of the GPU's memory this process's torch allocator may use "
        "(set_per_process_memory_fraction).",
    )
    drain_grace_s: float = Field(10.0, ge=0, description="On SIGTERM, how long to finish held work.")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps torch's default.")
    prefix_cache_mb: float = Field(
        256.0,
        ge=0,
        description="Per model engine: MB of finished sequences' keys and values kept, so a conversation's next "
        "turn on this worker prefills only its new tokens (least recently used out first; 0: off).",
    )
    engine_process: bool = Field(
        True,
        description="Step each model's engine in a child process (its own GIL), not in a thread beside the loop; "
        "false: on a thread of the worker (no second Python runtime, ~0.4 GB less).",
    )

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v not in ("static", "continuous"):
            raise ValueError("engine must be 'static' or 'continuous' (set ARENA_ENGINE)")
        return v


class GatewaySettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP API; 0 picks a free one.")
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="/metrics, /healthz and /readyz on a port of their own (on http_host), outside API keys and the "
        "edge's limits: what `arena up` and the PodMonitor scrape. 0: /metrics only on the API port (behind keys).",
    )
    deadline_s: float = Field(15.0, gt=0, description="Default time budget of a request.")
    max_deadline_s: float = Field(120.0, gt=0, description="Longest deadline a client may ask for.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body (counted as it is read).")
    body_timeout_s: float = Field(10.0, gt=0, description="A request body must arrive within this (else 408).")
    header_timeout_s: float = Field(10.0, gt=0, description="A request head must arrive within this (else 408).")
    keep_alive_s: int = Field(5, ge=1, description="Idle keep-alive connections are closed after this.")
    max_connections: int = Field(
        4096,
        ge=16,
        description="Open HTTP connections and tasks before the gateway answers 503 (slow clients cannot pile up); "
        "WebSockets are not counted here (max_websockets).",
    )
    max_ws_frame_bytes: int = Field(256 * 1024, ge=1024, description="Largest WebSocket frame.")
    ws_idle_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A WebSocket with no turn running and no frame from its client for this long is closed "
        "(code 1000, reason 'idle'); the conversation stays in the stream and a new socket carries it on.",
    )
    ws_ping_interval_s: float = Field(
        20.0, gt=0, description="Protocol pings on every WebSocket (they keep proxies and NATs from dropping it)."
    )
    ws_ping_timeout_s: float = Field(20.0, gt=0, description="A WebSocket whose pong is this late is closed (1011).")
    ws_per_message_deflate: bool = Field(
        False,
        description="Offer permessage-deflate compression to WebSocket clients: ~37 KiB of zlib state a socket "
        "(bench.connections: 80 against 43 KiB a socket) for frames of a few tokens each.",
    )
    max_websockets: int = Field(
        10_000,
        ge=1,
        description="Open WebSockets per gateway; past it a new one is told to retry (close code 1013). "
        "Bounded by the process's open-file limit, which the gateway raises to its hard limit at start.",
    )
    max_json_depth: int = Field(32, ge=2, le=512, description="Deepest JSON nesting accepted in a WebSocket frame.")
    max_queue_per_model: int = Field(
        256, ge=1, description="Backstop: requests in flight per model and gateway before 429."
    )
    admission_overhead_s: float = Field(
        0.5, ge=0, description="Admission: time a request spends outside decoding (filter, hops, prefill)."
    )
    admission_margin: float = Field(
        1.5,
        ge=1,
        description="Admission: measured step times are multiplied by this (a safety margin: a burst itself "
        "slows the steps it is measured by).",
    )
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys; empty disables auth.")
    rate_limit_rpm: int = Field(0, ge=0, description="Default requests per minute per key (0: unlimited).")
    rate_limit_tpm: int = Field(
        0, ge=0, description="Default tokens per minute per key (prompt chars / 4 + max_tokens; 0: unlimited)."
    )
    rate_limits: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description='Per-key limits over the defaults, e.g. \'{"sk-a": {"rpm": 600, "tpm": 200000}}\'.',
    )
    open_paths: list[str] = Field(
        default_factory=lambda: ["/healthz", "/readyz"],
        description="Paths served without a key when keys are on (a trailing '*' matches a prefix), e.g. "
        '\'["/healthz", "/readyz", "/docs", "/openapi.json", "/metrics", "/arena*"]\'. /readyz shows details '
        "only to a caller with a key.",
    )
    arena_weights: dict[str, float] = Field(
        default_factory=dict, description="Arena pair sampling weight per model; empty: uniform."
    )
    arena_boost: list[str] = Field(default_factory=list, description="Arena models drawn 5x as often (new ones).")
    arena_targets: dict[str, list[str]] = Field(
        default_factory=dict, description="Arena model -> rivals it should mostly meet."
    )
    arena_min_dwell_s: float = Field(
        0.0, ge=0.0, description="A vote sooner than this after both answers finished does not count (0: off)."
    )
    arena_daily_vote_cap: int = Field(200, ge=1, description="Counted arena votes per voter per UTC day.")
    arena_prompt_cap: int = Field(25, ge=1, description="Counted arena votes per prompt (FastChat caps at 25).")
    arena_boost_until_votes: int = Field(
        3000, ge=0, description="Arena models with fewer counted votes are drawn 5x as often (LMArena's; 0: off)."
    )
    arena_sampling: Literal["weighted", "active"] = Field(
        "weighted", description="'weighted' (weights, boosts, targets) or 'active' (the pair one vote informs most)."
    )

    @field_validator("rate_limits")
    @classmethod
    def _rate_limits(cls, v: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        for key, limits in v.items():
            if set(limits) - {"rpm", "tpm"} or any(n < 0 for n in limits.values()):
                raise ValueError(f"ARENA_RATE_LIMITS: key ...{key[-4:]} takes only rpm and tpm, each >= 0")
        return v

    @model_validator(mode="after")
    def _deadlines(self) -> GatewaySettings:
        if self.deadline_s > self.max_deadline_s:
            raise ValueError("deadline_s must not exceed max_deadline_s (ARENA_DEADLINE_S, ARENA_MAX_DEADLINE_S)")
        return self


class OperatorSettings(NatsClient):
    """What the `arena` command itself reads (the processes it starts read their own)."""

    model_config = SettingsConfigDict(env_prefix="ARENA_", extra="ignore")

    state_dir: str = Field(
        default_factory=_default_state_dir,
        description="NATS store, logs and endpoints of `arena up` (`--state-dir`, else this, else the project's "
        "`.arena`, from any directory).",
    )
    nats_url: str | None = Field(
        None,
        validation_alias=AliasChoices("NATS_URL", "ARENA_NATS_URL"),
        description="An existing NATS server; unset: `arena up` starts one.",
    )
    redis_url: str | None = Field(
        None,
        validation_alias=AliasChoices("REDIS_URL", "ARENA_REDIS_URL"),
        description="An existing Redis; unset: `arena up` starts one.",
    )
    log_level: str = Field("INFO", description="Log level of `arena up` and of the processes it starts.")


MIN_VOTES = 30
"""Votes below which a model is provisional: the one default of ARENA_MIN_VOTES and LeaderboardConfig."""


class LeaderboardSettings(CommonSettings):
    min_votes: int = Field(MIN_VOTES, ge=0, description="Models with fewer counted votes are flagged provisional.")
    interval: str = Field("sandwich", description="'sandwich' or 'bootstrap' intervals.")
    refresh_s: float = Field(0.5, gt=0, description="Longest a new vote waits before the leaderboard is refit.")

    @field_validator("interval")
    @classmethod
    def _interval(cls, v: str) -> str:
        if v not in ("sandwich", "bootstrap"):
            raise ValueError("interval must be 'sandwich' or 'bootstrap' (set ARENA_INTERVAL)")
        return v
