"""The delivery process's settings (`arena run delivery`)."""

from __future__ import annotations

from pydantic import Field

from runtime.settings import CommonSettings


class DeliverySettings(CommonSettings):
    workers: int = Field(8, ge=1, le=256, description="Messages handled concurrently.")
