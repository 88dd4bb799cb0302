"""Servers under test as subprocesses: a free port, readiness, and no leftovers.

Each server starts in its own session (process group). Stopping it sends SIGTERM to
the group and to every descendant seen at that moment (a server may start children in
sessions of their own, like arenaflow's nats-server and redis), then SIGKILL to
whatever is still alive after a grace period. An atexit hook and SIGTERM/SIGINT
handlers stop everything still running when the harness itself ends.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil

_RUNNING: set[ServerProcess] = set()


class ServerFailed(RuntimeError):
    """The server exited or never became ready; the message ends with its log's tail."""


class ServerProcess:
    """One server command, its log file, and the URL that answers 200 once it is ready."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        ready_url: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name, self.cmd, self.ready_url, self.log_path = name, cmd, ready_url, log_path
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        _RUNNING.add(self)
        return self

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.proc is not None, "start() the server first"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.ready_url, timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerFailed(f"{self.name} not ready at {self.ready_url} after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        _RUNNING.discard(self)
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            # Already gone: its orphans were re-parented, but they are still in its group.
            _killpg(self.proc.pid, signal.SIGKILL)
            return
        family = [*_descendants(self.proc.pid)]
        _killpg(self.proc.pid, signal.SIGTERM)
        for p in family:
            _signal(p, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        _, alive = psutil.wait_procs(family, timeout=max(1.0, grace_s / 3))
        for p in alive:
            _signal(p, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        _killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=5)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class PssSampler:
    """The memory a server holds: the PSS (proportional set size: shared pages split among
    the processes sharing them, so a sum over processes counts each page once) of it and
    every descendant, sampled on a thread while it serves; keeps the peak sum and each
    process's share at that peak.

        with PssSampler(server.proc.pid) as memory:
            ...  # the load
        memory.result()
    """

    def __init__(self, pid: int, every_s: float = 2.0) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak = 0
        self.at_peak: list[tuple[str, int]] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss", daemon=True)

    def sample(self) -> None:
        shares = tree_pss(self.pid)
        total = sum(pss for _, pss in shares)
        self.samples += 1
        if total > self.peak:
            self.peak, self.at_peak = total, shares

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def result(self) -> dict:
        processes = sorted(self.at_peak, key=lambda x: -x[1])
        return {
            "pss_peak_bytes": self.peak,
            "processes": len(processes),
            "pss_by_process": [{"name": name, "pss_bytes": pss} for name, pss in processes],
            "samples": self.samples,
        }

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # one after the load too: a short run may end between two samples


def tree_pss(pid: int) -> list[tuple[str, int]]:
    """(name, PSS bytes) of the process and each descendant alive now."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in [root, *_descendants(pid)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            out.append((_label(proc), proc.memory_full_info().pss))
    return out


def _label(proc: psutil.Process) -> str:
    """A process's name; for `python -m MODULE ...`, the module and its words up to the
    first option (`infra.cli run gateway`: which of arenaflow's roles it is)."""
    cmd = proc.cmdline()
    if "-m" not in cmd[:-1]:
        return proc.name()
    words = cmd[cmd.index("-m") + 1 :]
    return " ".join(next(iter([words[:i] for i, w in enumerate(words) if w.startswith("-")]), words)[:3])


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _signal(proc: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(sig)


def stop_all() -> None:
    for server in list(_RUNNING):
        server.stop(grace_s=5.0)


def _on_signal(signum, frame) -> None:
    stop_all()
    raise SystemExit(128 + signum)


def install_cleanup() -> None:
    """Stop every started server when the harness exits or is told to stop."""
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
