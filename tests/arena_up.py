"""`arena up` run as a user runs it, for the tests that drive the whole command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import httpx
import psutil

from tests.conftest import REPO, SHARED


def user_env() -> dict:
    """The environment of a user's shell: none of the test stacks' ARENA_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_") and k not in ("NATS_URL", "REDIS_URL")}
    env.update({"ARENA_MODELS_DIR": str(SHARED / "models"), "HF_HUB_OFFLINE": "1"})
    return env


def arena(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """One `arena` command, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class ArenaUp:
    """`arena up --port 0` in a state dir of its own, waited until it says it is ready."""

    def __init__(self, tmp_path, *args: str, ready_s: float = 180, env: dict | None = None):
        self.env = user_env() | (env or {})
        self.state = tmp_path / "state"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infra.cli", "up", "--port", "0", "--state-dir", str(self.state), *args],
            env=self.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        end = time.monotonic() + ready_s
        while time.monotonic() < end:
            self.lines.append(self.proc.stdout.readline())
            if "ready at" in self.lines[-1] or self.proc.poll() is not None:
                break
        assert any("ready at" in line for line in self.lines), "".join(self.lines)
        self.endpoints = json.loads((self.state / "endpoints.json").read_text())
        self.url, self.nats_url = self.endpoints["gateway_url"], self.endpoints["nats_url"]

    def roster(self) -> dict:
        """The supervisor's processes.json: each child's pid by name, each role's warm spare."""
        return json.loads((self.state / "processes.json").read_text())

    def inference_pids(self) -> list[int]:
        """The live inference workers (a promoted warm spare among them; a waiting one not)."""
        out = []
        for name, pid in self.roster()["children"].items():
            try:
                if name.startswith("inference") and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    @contextmanager
    def engines_stalled(self) -> Iterator[None]:
        """The engine processes that step the models stopped (SIGSTOP), as a machine too
        busy to run them would; the workers go on pulling requests and sending heartbeats."""
        engines = [
            p
            for pid in self.inference_pids()
            for p in psutil.Process(pid).children(recursive=True)
            if p.name() == "arena-engine"
        ]
        assert engines, "no engine process under the inference workers"
        for p in engines:
            p.suspend()
        try:
            yield
        finally:
            for p in engines:
                with suppress(psutil.NoSuchProcess):
                    p.resume()

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, as Ctrl-C would; killed if it does not stop in time. Its exit code."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        assert self.proc.stdout is not None
        self.lines += self.proc.stdout.readlines()  # what it printed since it was ready
        return self.proc.returncode


def battle_and_vote(url: str) -> str:
    """One arena battle, one turn streamed and a vote for side a: its id."""
    with httpx.Client(base_url=url, timeout=30) as client:
        bid = client.post("/arena/battles").json()["battle_id"]
        with client.stream("POST", f"/arena/battles/{bid}/turns", json={"prompt": "A cat", "max_tokens": 8}) as t:
            assert t.status_code == 200
            list(t.iter_lines())
        vote = client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"})
        assert vote.status_code == 200, vote.text
    return bid


def replayed_rejection(up: ArenaUp, prompt: str) -> dict:
    """Send ``prompt`` to the stack, check the client got 400 prompt_rejected, and return the filter's
    report on the rejection as `arena replay` reads it from the stream."""
    body = {"model": "stories-260k", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    r = httpx.post(up.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_rejected", r.text
    request_id = r.headers["x-request-id"]
    replay = arena("replay", "--request-id", request_id, "--state-dir", str(up.state), "--json", env=up.env)
    assert replay.returncode == 0, replay.stderr
    events = [json.loads(line) for line in replay.stdout.splitlines()]
    assert [e["type"] for e in events] == ["chat.requested", "prompt.rejected"]
    return events[1]["filter"]
