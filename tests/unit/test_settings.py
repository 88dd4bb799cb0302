"""Each process's settings, beside its process: typed nested config read from the same
environment variables as before, and values that cannot work refused at start naming
the field (never an API key)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from consumers.filter.settings import FilterSettings
from consumers.inference.settings import InferenceSettings
from consumers.leaderboard.settings import LeaderboardSettings
from gateway.settings import GatewaySettings, KeyLimits


def test_the_filters_config_is_a_typed_model_read_field_by_field(monkeypatch):
    monkeypatch.setenv("ARENA_FILTER__REJECT_THRESHOLD", "0.9")
    monkeypatch.setenv("ARENA_FILTER__STAGE_MODES__WORDS", "block")
    monkeypatch.setenv("ARENA_MAX_PROMPT_CHARS", "5000")
    config = FilterSettings().config()
    assert (config.reject_threshold, config.stage_modes, config.max_prompt_chars) == (0.9, {"words": "block"}, 5000)
    monkeypatch.setenv("ARENA_FILTER__MAX_PROMPT_CHARS", "77")  # the filter's own limit, over the shared one
    assert FilterSettings().config().max_prompt_chars == 77


def test_a_misspelt_filter_field_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ARENA_FILTER__REJECT_THRESHLD", "0.9")
    with pytest.raises(ValidationError, match=r"filter\.reject_threshld"):
        FilterSettings()


@pytest.mark.parametrize(
    ("variable", "settings", "field"),
    [("ARENA_ENGINE", InferenceSettings, "engine"), ("ARENA_INTERVAL", LeaderboardSettings, "interval")],
)
def test_a_choice_outside_its_values_is_refused_naming_the_field(monkeypatch, variable, settings, field):
    monkeypatch.setenv(variable, "bogus")
    with pytest.raises(ValidationError) as caught:
        settings()
    assert caught.value.errors()[0]["loc"] == (field,)


def test_per_key_limits_are_typed_and_a_bad_one_names_the_key_by_its_tail(monkeypatch):
    monkeypatch.setenv("ARENA_RATE_LIMITS", '{"sk-secret-a1b2": {"rpm": 600}}')
    assert GatewaySettings().rate_limits == {"sk-secret-a1b2": KeyLimits(rpm=600)}
    monkeypatch.setenv("ARENA_RATE_LIMITS", '{"sk-secret-a1b2": {"rph": 3}}')
    with pytest.raises(ValidationError) as caught:
        GatewaySettings()
    message = caught.value.errors()[0]["msg"]
    assert "key ...a1b2 takes only rpm and tpm" in message and "sk-secret" not in message
    assert "sk-secret" not in str(caught.value)  # nor the input, which the whole error prints
