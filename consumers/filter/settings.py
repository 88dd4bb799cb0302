"""The filter process's settings (`arena run filter`)."""

from __future__ import annotations

from pydantic import Field

from consumers.filter.config import FilterConfig
from runtime.settings import CommonSettings


class FilterSettings(CommonSettings):
    workers: int = Field(4, ge=1, le=256, description="Messages handled concurrently.")
    filter: FilterConfig = Field(
        default_factory=FilterConfig,
        description="The filter's thresholds and stages, a variable per field below, e.g. "
        "ARENA_FILTER__REJECT_THRESHOLD=0.8 (or all of them as JSON in ARENA_FILTER). Unless "
        "ARENA_FILTER__MAX_PROMPT_CHARS is set, the filter's prompt limit is ARENA_MAX_PROMPT_CHARS.",
    )

    def config(self) -> FilterConfig:
        """The filter's config, with the prompt limit every process shares unless
        ARENA_FILTER__MAX_PROMPT_CHARS sets the filter's own."""
        if "max_prompt_chars" in self.filter.model_fields_set:
            return self.filter
        return self.filter.model_copy(update={"max_prompt_chars": self.max_prompt_chars})
