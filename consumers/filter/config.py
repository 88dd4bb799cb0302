"""Configuration of the prompt filter (pure data, no environment reading).

The filter consumer's settings class builds one of these; tests and the
evaluation command build their own.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class FilterConfig(BaseModel):
    """Thresholds and switches of the prompt filter.

    The defaults were chosen so that at most 0.3% of the benign arena prompts in
    the development corpus are rejected or altered (see docs/filter.md).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sanitize: bool = Field(
        True,
        description=(
            "Remove control tokens, fake role markers and word-splitting invisible "
            "characters from user text. When off, findings still raise the score "
            "but the text is sent unchanged (or rejected)."
        ),
    )
    reject_threshold: float = Field(
        0.75,
        ge=0.0,
        le=1.0,
        description=(
            "Prompts whose injection score is at or above this are rejected. "
            "0.75 takes two strong jailbreak cues, or a strong adversarial suffix; "
            "1.0 never rejects on score alone (only on length or nesting)."
        ),
    )
    max_prompt_chars: int = Field(
        100_000,
        gt=0,
        description=(
            "Longer user messages are rejected outright: scanning stays linear, "
            "but nothing this long is a chat prompt and it bounds the work per message."
        ),
    )
    strip_all_invisible: bool = Field(
        False,
        description=(
            "Remove every zero-width character, not only those that split a word. "
            "Off by default: pasted math and web text carries stray U+200B/U+FEFF "
            "that hide nothing, and removing them would count as altering benign prompts."
        ),
    )
    max_sanitize_rounds: int = Field(
        6,
        ge=1,
        le=50,
        description=(
            "Sanitizing repeats until nothing changes (removing one token can join "
            "another, e.g. '<|im_<|x|>start|>'). A prompt still changing after this "
            "many rounds is rejected as deliberately nested."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> FilterConfig:
        if not self.sanitize and self.reject_threshold >= 1.0:
            raise ValueError(
                "sanitize=False with reject_threshold=1.0 lets every injection through "
                "unchanged; lower reject_threshold or turn sanitize on"
            )
        return self


DEFAULT = FilterConfig()
