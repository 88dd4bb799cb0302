"""A warm spare's engine fork server, forked from the spare once its imports are done
(`forks.start_forked`), in a real process that imported the engine's modules as the spare
does: it shares the spare's pages (no import of its own), holds none of the spare's
descriptors but its output, forks engine processes, stops with `forks.stop()`, and ends
when the spare is killed with -9. A process that runs threads gets one started as a new
interpreter instead (a fork copies one thread)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SPARE = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import psutil
    import consumers.inference.app  # what a spare imports before it waits
    from consumers.inference.runners import forks

    held = socket.socket()  # a socket it was handed, as a spare holds the role's /metrics sockets
    held.bind(("127.0.0.1", 0))
    held.listen()
    forks.start_forked()
    forks.wait_ready()
    [server] = forks.server_pids()
    # An engine reads its pipe from the spare, and ends when the spare's end closes.
    pipe, spare_end = forks.context().Pipe(duplex=False)
    engine = forks.context().Process(target=pipe.recv)
    engine.start()
    links = {os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")}
    print(json.dumps({
        "server": server,
        "server_parent": psutil.Process(server).ppid(),
        "server_cmdline": psutil.Process(server).cmdline(),
        "server_threads": psutil.Process(server).num_threads(),
        "engine_parent": psutil.Process(engine.pid).ppid(),
        "holds_socket": os.readlink(f"/proc/self/fd/{held.fileno()}") in links,
        "holds_stdin": os.readlink("/proc/self/fd/0") in links,
    }), flush=True)
    if sys.argv[1] == "stop":
        engine.kill()
        engine.join()
        forks.stop()
        print(json.dumps({"server_alive": psutil.pid_exists(server)}), flush=True)
    else:
        time.sleep(60)
    """
)


def spare(how: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", SPARE, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def gone(pid: int, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_fork_server_is_the_spare_s_fork_holds_none_of_its_descriptors_and_stops():
    proc = spare("stop")
    try:
        assert proc.stdout is not None
        seen = json.loads(proc.stdout.readline())
        assert seen["server_parent"] == proc.pid  # a fork of the spare, not a new interpreter
        assert seen["server_cmdline"] == psutil.Process(proc.pid).cmdline()
        assert seen["server_threads"] == 1
        assert seen["engine_parent"] == seen["server"]  # engines are forked from it
        assert not seen["holds_socket"] and not seen["holds_stdin"]
        assert json.loads(proc.stdout.readline()) == {"server_alive": False}
        assert proc.wait(30) == 0
    finally:
        proc.kill()


def test_a_forked_fork_server_and_its_engines_end_when_the_spare_is_killed():
    proc = spare("wait")
    try:
        assert proc.stdout is not None
        seen = json.loads(proc.stdout.readline())
        engine = [c.pid for c in psutil.Process(seen["server"]).children()]
        assert engine, "the engine process is not there"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert gone(seen["server"], 10), "the fork server outlived the spare"
        assert all(gone(pid, 10) for pid in engine), "an engine outlived the spare"
    finally:
        proc.kill()


def test_a_process_running_threads_starts_its_fork_server_as_a_new_interpreter():
    script = textwrap.dedent(
        """
        import threading, time, psutil
        from consumers.inference.runners import forks
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        forks.start_forked()
        forks.wait_ready()
        [server] = forks.server_pids()
        print(" ".join(psutil.Process(server).cmdline()), flush=True)
        forks.stop()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "multiprocessing.forkserver" in done.stdout  # not a fork of this process
    assert "started as a new interpreter: threads run here" in done.stderr
