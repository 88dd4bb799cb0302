"""The default model and the models warmed at start, as every process's settings take
them from the models config (runtime/models_config.py): one place says it."""

from __future__ import annotations

import pytest

from consumers.inference.settings import InferenceSettings
from runtime import models_config as config_file
from runtime.settings import CommonSettings


@pytest.fixture
def config(tmp_path, monkeypatch):
    for name in ("ARENA_MODELS_CONFIG", "ARENA_DEFAULT_MODEL", "ARENA_WARM_MODELS"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "mine.yaml"
    path.write_text("models:\n  - {name: tiny, path: stories260K-hf}\n  - {name: tinier, base: tiny}\n")
    return path


def test_every_process_takes_the_configs_first_model_as_its_default(config):
    assert CommonSettings(models_config=str(config)).default_model == "tiny"
    assert InferenceSettings(models_config=str(config)).warm_models == ["tiny"]
    named = CommonSettings(models_config=str(config), default_model="tinier")
    assert named.default_model == "tinier"
    assert CommonSettings().default_model == config_file.FALLBACK_MODEL  # no config: the one model then served


def test_the_config_may_name_its_default_and_what_is_warmed(config):
    config.write_text("default_model: tinier\nwarm: [tiny]\n" + config.read_text())
    assert CommonSettings(models_config=str(config)).default_model == "tinier"
    assert InferenceSettings(models_config=str(config)).warm_models == ["tinier", "tiny"]  # the default first


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("models: []\n", "must be a mapping with a non-empty 'models' list"),
        ("default_model: ghost\nmodels:\n  - {name: tiny, path: x}\n", "'ghost' is no model of the models config"),
        ("warm: [tiny, ghost]\nmodels:\n  - {name: tiny, path: x}\n", "warm model 'ghost' is no model"),
        ("warm: tiny\nmodels:\n  - {name: tiny, path: x}\n", "'warm' must be a list of model names"),
    ],
)
def test_a_config_that_cannot_say_is_refused_by_arena_up_naming_why(config, text, said):
    config.write_text(text)
    with pytest.raises(config_file.ConfigError, match=said):
        config_file.plan(config)
    # A process's settings take the fallback (the inference worker then refuses the config, saying why).
    assert CommonSettings(models_config=str(config)).default_model == config_file.FALLBACK_MODEL
