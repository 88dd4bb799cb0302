"""What every process's settings share; each process's own class lives beside it
(`consumers/<role>/settings.py`, `gateway/settings.py`, `infra/settings.py` for the
`arena` command), and `infra.configdoc.sections()` lists them all.

Environment variables are read only by these classes. Each field is documented; a value
that cannot work is refused at start with a message that names the variable. Defaults
that two processes must agree on (the prompt limit, the default model, how long results
are kept, the consumers' AckWait) live once, in `CommonSettings`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime import models_config as config_file

REPO = Path(__file__).resolve().parents[1]


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
    model_config = SettingsConfigDict(
        env_prefix="ARENA_", extra="ignore", env_nested_delimiter="__", hide_input_in_errors=True
    )

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
    models_config: str | None = Field(None, description="YAML/JSON file listing served models.")
    default_model: str = Field(
        default_factory=lambda fields: config_file.default_model(fields.get("models_config")),
        description="Model used when a request names none, and which /readyz waits for. Unset: the models "
        "config's `default_model:`, else its first model; stories-260k without a models config "
        "(runtime/models_config.py).",
    )
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
    metrics_fd: int | None = Field(
        None,
        ge=0,
        description="A listening socket inherited from `arena up` (its file descriptor) for that endpoint, served "
        "instead of binding metrics_port: the supervisor holds the port Prometheus scrapes for the stack's life, "
        "across the process's restarts and a warm spare's promotion.",
    )
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
