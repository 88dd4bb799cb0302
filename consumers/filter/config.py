"""Configuration of the prompt filter (pure data, no environment reading).

The filter consumer's settings class builds one of these; tests and the
evaluation command build their own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The committed artifact of `arena filter-train` (kept as a string: config is pure data).
DEFAULT_CLASSIFIER = "consumers/filter/artifacts/prompt-classifier.npz"
#: Each ensemble stage's mode unless ``stage_modes`` says otherwise; a stage not named here
#: (a new one) runs in shadow until the operator turns it on. The word stage stays in shadow:
#: measured held out, it does not add catches at the benign cap (docs/filter.md).
DEFAULT_STAGE_MODES: dict[str, Literal["block", "shadow"]] = {"chars": "block", "words": "shadow"}


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

    mode: Literal["block", "sanitize-only", "shadow"] = Field(
        "block",
        description=(
            "block: rules and classifier reject. shadow: rules act as usual; the classifier's "
            "verdict is recorded on the event and counted, but never blocks (roll-out of a new "
            "model). sanitize-only: nothing is rejected on score, by rules or classifier; "
            "sanitizing still applies and verdicts are recorded. Hard limits (max_prompt_chars, "
            "nested markup) reject in every mode."
        ),
    )
    classifier_path: str | None = Field(
        DEFAULT_CLASSIFIER,
        description=(
            "The classifier stage: an `arena filter-train` artifact (.npz), or a Hugging Face "
            "sequence-classification checkpoint directory (bring your own guard model). "
            "Relative paths are taken from the working directory. None: rules only."
        ),
    )
    classifier_threshold: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description=(
            "Attack probability at or above which the classifier flags a prompt. None: the "
            "artifact's own (chosen at training for <= 0.3% benign rejections on held-out "
            "sources); 0.5 for a guard model."
        ),
    )
    classifier_reload_s: float = Field(
        5.0,
        gt=0.0,
        description="How often the consumer checks the artifact's mtime and loads a new one (hot reload).",
    )
    classifier_explain: int = Field(
        5, ge=0, le=50, description="How many top n-grams behind the classifier's verdict the event records."
    )
    stage_modes: dict[str, Literal["block", "shadow"]] = Field(
        default_factory=dict,
        description=(
            "Ensemble stages (a manifest as classifier_path): per stage, block (its flag rejects, in mode block) "
            "or shadow (scored, recorded on the event, counted in arena_filter_stage_verdicts_total and logged; "
            "never blocks), over the defaults (DEFAULT_STAGE_MODES: chars block; words, and any stage not named, "
            "shadow), so a new stage is watched on real traffic before it can reject. "
            "E.g. ARENA_FILTER__STAGE_MODES__WORDS=block."
        ),
    )
    stage_thresholds: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Ensemble stages: a score threshold overriding the stage's one at the ensemble's operating point "
            "(which keeps held-out benign flags within 0.3%; an override gives that up)."
        ),
    )
    cascade_band: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description=(
            "Ensemble with a cascade stage (the encoder): it scores a prompt only when a lexical stage ranks it at "
            "or above this share of held-out benign prompts (its calibrated score), or when the prompt is long "
            "(cascade_long_chars); prompts the rules or an enforced stage reject skip it. 0: every prompt."
        ),
    )
    cascade_long_chars: int = Field(
        1000,
        gt=0,
        description="Prompts this long and longer go to the cascade stage whatever the lexical stages say.",
    )
    guard_attack_label: str | None = Field(
        None,
        description=(
            "Guard model only: the id2label name meaning attack. None: the first label naming "
            "injection/jailbreak/unsafe, else label 1."
        ),
    )

    def stage_mode(self, stage: str) -> Literal["block", "shadow"]:
        """The mode of an ensemble stage under this config (see ``stage_modes``)."""
        return self.stage_modes.get(stage, DEFAULT_STAGE_MODES.get(stage, "shadow"))

    @model_validator(mode="after")
    def _check(self) -> FilterConfig:
        bad = {k: v for k, v in self.stage_thresholds.items() if not 0.0 < v <= 1.0}
        if bad:
            raise ValueError(f"stage_thresholds must be scores in (0, 1]; got {bad}")
        if not self.sanitize and self.reject_threshold >= 1.0:
            raise ValueError(
                "sanitize=False with reject_threshold=1.0 lets every injection through "
                "unchanged; lower reject_threshold or turn sanitize on"
            )
        return self


DEFAULT = FilterConfig()
