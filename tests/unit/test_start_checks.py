"""`arena up`'s checks before it starts anything: the state dir's lock (held by a real
second process, released when it is killed with -9) and the gateway's port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from infra.start_checks import LOCK_FILE, StartRefused, hold_state_dir, listen_on
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)

HOLDER = "import sys, time; from pathlib import Path; from infra.start_checks import hold_state_dir; "
HOLDER += "lock = hold_state_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"


def test_a_held_state_dir_is_refused_with_the_holders_pid_and_freed_by_its_death(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(StartRefused, match=rf"in use by another `arena up` \(pid {holder.pid}\)"):
            hold_state_dir(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = hold_state_dir(tmp_path)  # no stale lock after a kill -9
    assert (tmp_path / LOCK_FILE).read_text().split() == [str(os.getpid())]
    lock.close()


def test_a_listening_port_is_refused_and_a_free_one_is_held():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartRefused, match=f"port {port} on 127.0.0.1: address already in use"):
            listen_on("127.0.0.1", port)
    with listen_on("127.0.0.1", port) as held:
        assert held.getsockname()[1] == port
        with pytest.raises(StartRefused, match="address already in use"):
            listen_on("127.0.0.1", port)  # nobody else takes it while it is held
    with listen_on("127.0.0.1", 0) as any_port:
        assert any_port.getsockname()[1] > 0
