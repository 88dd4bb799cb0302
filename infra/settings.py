"""One validated settings class per process; environment variables are read only here."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ARENA_", extra="ignore")

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        validation_alias=AliasChoices("NATS_URL", "ARENA_NATS_URL"),
        description="NATS server with JetStream.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("REDIS_URL", "ARENA_REDIS_URL"),
        description="Redis for results, idempotency keys and conversation seeds.",
    )
    instance_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Names this process in heartbeats and logs.",
    )
    retention_days: float = Field(7.0, gt=0, description="Max age of events kept in the stream.")
    log_level: str = "INFO"
    heartbeat_s: float = Field(1.0, gt=0, description="How often a consumer announces itself.")
    # Consumer definitions are created by whichever process starts first, so every
    # process must compute the same ones.
    ack_wait_s: float = Field(30.0, gt=1, description="Inference AckWait; in-progress acks every third of it.")
    max_ack_pending: int = Field(256, ge=1, description="Most unacked requests the inference group holds.")

    def topology(self) -> dict:
        return {"ack_wait_s": self.ack_wait_s, "max_ack_pending": self.max_ack_pending}


class FilterSettings(CommonSettings):
    workers: int = Field(4, ge=1, le=256, description="Messages handled concurrently.")


class DeliverySettings(CommonSettings):
    workers: int = Field(8, ge=1, le=256, description="Messages handled concurrently.")
    result_ttl_s: int = Field(1800, ge=1, description="How long completed results are kept in Redis.")


class InferenceSettings(CommonSettings):
    models_config: str | None = Field(None, description="YAML/JSON file listing served models.")
    models_dir: str | None = Field(None, description="Where relative model paths are looked up.")
    default_model: str = Field("stories-260k", description="Model used when a request names none.")
    warm_models: list[str] | None = Field(None, description="Loaded at start; default: the default model.")
    engine: str = Field("continuous", description="'static' (padded micro-batches) or 'continuous'.")
    max_batch_size: int = Field(32, ge=1, le=512, description="Most requests decoded together.")
    max_wait_ms: int = Field(
        10, ge=0, le=10_000, description="Static engine: longest a micro-batch waits to fill before it starts."
    )
    chunk_tokens: int = Field(4, ge=1, le=256, description="Tokens per TokensGenerated event.")
    memory_budget_mb: float | None = Field(None, gt=0, description="Model pool budget; default: 60% of RAM.")
    cuda_memory_fraction: float = Field(0.85, gt=0, le=1)
    drain_grace_s: float = Field(10.0, ge=0, description="On SIGTERM, how long to finish held work.")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps torch's default.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 picks a free one.")

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v not in ("static", "continuous"):
            raise ValueError("engine must be 'static' or 'continuous' (set ARENA_ENGINE)")
        return v


class GatewaySettings(CommonSettings):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    default_model: str = "stories-260k"
    models_config: str | None = None
    models_dir: str | None = None
    deadline_s: float = Field(15.0, gt=0, description="Default time budget of a request.")
    max_deadline_s: float = Field(120.0, gt=0, description="Longest deadline a client may ask for.")
    max_prompt_chars: int = Field(32_000, ge=1)
    max_body_bytes: int = Field(1_000_000, ge=1024)
    max_queue_per_model: int = Field(256, ge=1, description="Requests in flight per model before 429.")
    result_ttl_s: int = Field(1800, ge=1)
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys; empty disables auth.")

    @model_validator(mode="after")
    def _deadlines(self):
        if self.deadline_s > self.max_deadline_s:
            raise ValueError("deadline_s must not exceed max_deadline_s")
        return self


def state_dir(path: str | None = None) -> Path:
    p = Path(path or os.environ.get("ARENA_STATE_DIR", ".arena"))
    p.mkdir(parents=True, exist_ok=True)
    return p
