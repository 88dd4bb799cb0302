"""What the `arena` command itself reads (`arena up` and the operator commands)."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from runtime.settings import REPO, NatsClient


def _default_state_dir() -> str:
    """The project's `.arena` (the checkout this code runs from), so the operator commands
    find `arena up`'s state from any directory; where the code is not a checkout (an
    installed wheel), `.arena` in the working directory."""
    return str(REPO / ".arena") if (REPO / "pyproject.toml").is_file() else ".arena"


class OperatorSettings(NatsClient):
    """What the `arena` command itself reads (the processes it starts read their own)."""

    model_config = SettingsConfigDict(env_prefix="ARENA_", extra="ignore", hide_input_in_errors=True)

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
