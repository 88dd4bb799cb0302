"""What `arena up` checks before it starts anything: that no other `arena up` holds its
state dir, and that the gateway's port is free.

A second stack on one state dir would start a second nats-server on the same JetStream
store and a second redis-server on the same append-only file, and rewrite
`nats-auth.conf` and `endpoints.json` under the first stack (which then cannot be
operated); a taken port would leave the gateway restarting on `address already in use`
while a readiness probe reached the other server.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import IO

#: In the state dir; holds the pid of the `arena up` that has it locked.
LOCK_FILE = "arena-up.lock"


class StartRefused(RuntimeError):
    """`arena up` cannot start as asked; the message says why and what to do."""


def hold_state_dir(state: Path) -> IO[str]:
    """Lock `state` for this process's life (flock: the kernel lets go when the process
    ends, even by kill -9, so a stale lock file never blocks the next start). Keep the
    returned file open as long as the stack runs."""
    state.mkdir(parents=True, exist_ok=True)
    lock = open(state / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the stack's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise StartRefused(
            f"{state} is in use by another `arena up` (pid {holder}): stop it first, "
            "or give this one a --state-dir of its own"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


#: The gateway's listening socket's backlog (uvicorn's default).
BACKLOG = 2048


def listen_on(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound (SO_REUSEADDR, like uvicorn, so a socket of a
    stopped stack in TIME_WAIT does not count; port 0: a free one) and listening: `arena
    up` holds it for the stack's life and hands it to each gateway process it starts, so
    no other server takes the port between this check and the gateway's start, nor while
    a gateway restarts (connections wait in the backlog). StartRefused when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise StartRefused(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        raise StartRefused(
            f"port {port} on {host}: address already in use (another server listens there); "
            "pass another --port, or --port 0 for a free one"
        ) from None
    sock.listen(BACKLOG)
    return sock
