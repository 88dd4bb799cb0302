"""The gateway's settings (`arena run gateway`)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from runtime.settings import CommonSettings


class KeyLimits(BaseModel):
    """One API key's limits over the defaults (an entry of ARENA_RATE_LIMITS)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rpm: int | None = Field(None, ge=0, description="Requests per minute for this key (unset: ARENA_RATE_LIMIT_RPM).")
    tpm: int | None = Field(None, ge=0, description="Tokens per minute for this key (unset: ARENA_RATE_LIMIT_TPM).")


class GatewaySettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP API; 0 picks a free one.")
    listen_fd: int | None = Field(
        None,
        ge=0,
        description="A listening socket inherited from `arena up` (its file descriptor), served instead of binding "
        "host:port: the supervisor holds the port for the stack's life, across the gateway's restarts.",
    )
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
        1.25,
        ge=1,
        description="Admission: measured step times are multiplied by this safety margin until 20 answered "
        "requests of the model near their deadline taught the gateway the margin its estimates really need "
        "(gateway/admission/calibrate.py; learned: 1.0-1.2 on SmolLM2, both backends, docs/admission.md).",
    )
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys; empty disables auth.")
    rate_limit_rpm: int = Field(0, ge=0, description="Default requests per minute per key (0: unlimited).")
    rate_limit_tpm: int = Field(
        0, ge=0, description="Default tokens per minute per key (prompt chars / 4 + max_tokens; 0: unlimited)."
    )
    rate_limits: dict[str, KeyLimits] = Field(
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

    @field_validator("rate_limits", mode="wrap")
    @classmethod
    def _rate_limits(cls, value: object, handler: ValidatorFunctionWrapHandler) -> dict[str, KeyLimits]:
        """A bad entry is named by its key's last four characters: the keys are secrets."""
        try:
            return handler(value)
        except ValidationError as exc:
            keys = sorted({str(e["loc"][0]) for e in exc.errors() if e["loc"]})
            named = ", ".join(f"...{k[-4:]}" for k in keys)
            raise ValueError(f"ARENA_RATE_LIMITS: key {named} takes only rpm and tpm, each >= 0") from None

    @model_validator(mode="after")
    def _deadlines(self) -> GatewaySettings:
        if self.deadline_s > self.max_deadline_s:
            raise ValueError("deadline_s must not exceed max_deadline_s (ARENA_DEADLINE_S, ARENA_MAX_DEADLINE_S)")
        return self
