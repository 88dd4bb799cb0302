"""Where engine processes come from: a fork server with the engine's modules imported.

An engine process started as a fresh interpreter spends seconds importing torch and
transformers (5-7 s on a busy 2-core VM) before it can step, and a worker restarted after
a ``kill -9`` waited for that on top of its own imports. The fork server is forked from
the worker (or its warm spare) once that has imported them and before it starts anything
else (:func:`start_forked`: no thread, no event loop, no model, no CUDA context yet), and
each engine process is forked from the server in a fraction of a second. The worker, its
server and its engines share the pages of everything imported (copy-on-write) instead of
each holding a copy: SmolLM2's worker 432 -> 232 MB PSS, its fork server 152 -> 102.
It is a process of its own, never the running worker: a fork of that would copy its
threads' locks and, on a GPU host, its CUDA context. It ends when the worker does.

:func:`start` starts one as a new interpreter instead (multiprocessing's own way), for a
process that runs threads already (the tests' workers).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import socket
import threading
from contextlib import suppress
from multiprocessing import connection, forkserver, resource_tracker, util
from multiprocessing.context import BaseContext
from typing import Any

#: What the fork server imports before it forks anything.
PRELOAD = [
    "consumers.inference.runners.fork_guard",
    "consumers.inference.runners.process",
    "consumers.inference.runners.fork_freeze",
]
#: Where engine processes write their logs when not where the fork server's stdout and
#: stderr go: a promoted warm spare's (infra.commands.run.promoted) started its fork server
#: while it wrote to the spare's log, and writes to the worker's from then on.
log_file: str | None = None


def context() -> BaseContext:
    """The multiprocessing context engine processes are started with."""
    return mp.get_context("forkserver")


def start() -> None:
    """Start the fork server as a new interpreter if none is running (one started by
    :func:`start_forked` and killed is replaced so); it imports :data:`PRELOAD` in the
    background."""
    context().set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def start_forked() -> None:
    """Start the fork server as a fork of this process, which has imported what the
    engines need already (a worker or its warm spare, before it starts anything): it
    shares this process's pages of torch and transformers (copy-on-write) instead of
    importing a copy of its own. What ``forkserver.ensure_running`` does, with a fork in
    place of a new interpreter. Only while a single Python thread runs (a fork copies the
    calling thread alone; OpenBLAS's idle pools stop themselves around a fork): else, as
    :func:`start` does."""
    if threading.active_count() != 1:  # a fork copies only the calling thread: start a new interpreter
        logging.getLogger(__name__).warning(
            "engine fork server started as a new interpreter: threads run here (%s)", threading.enumerate()
        )
        start()
        return
    context().set_forkserver_preload(PRELOAD)
    server: Any = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            return
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # the server ends once every holder of alive_w has closed it
            # Out of the collector's walks first: the server's first collection would write
            # to every object, and copy each page it wrote to (fork_freeze).
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                _forked_server(listener.fileno(), alive_r)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


def _forked_server(listener_fd: int, alive_r: int) -> None:
    """The forked fork server: no descriptor of its parent's but its output and what the
    server reads (its parent's stdin, sockets it inherited and the other end of the alive
    pipe would outlive the parent in it), then multiprocessing's own server loop."""
    try:
        keep = {0, 1, 2, listener_fd, alive_r}
        for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
            if fd not in keep:
                with suppress(OSError):
                    os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)  # sys.stdin's close() leaves descriptor 0 open
        os.dup2(null, 0)
        os.close(null)
        forkserver.main(listener_fd, alive_r, PRELOAD)
    finally:
        os._exit(0)


def wait_ready() -> None:
    """Wait until the fork server has imported :data:`PRELOAD` (it forks a process that
    does nothing, which it can only do once they are in): a worker's warm spare waits for
    this before it says it is ready to be promoted."""
    proc = context().Process(target=_nothing, name="forks-ready")  # type: ignore[attr-defined]
    proc.start()
    proc.join()


def _nothing() -> None:
    pass


def server_pids() -> list[int]:
    """The fork server's process id, when it is running (else none)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return [pid] if pid else []


def stop() -> None:
    """Stop the fork server (and the resource tracker it started) and wait for them, so a
    worker that stops leaves no process behind. Its engine processes must be stopped first."""
    # multiprocessing's own way (its tests use it): closing the "alive" pipe ends the
    # server, which exits at once, and _stop waits for it.
    forkserver._forkserver._stop()  # type: ignore[attr-defined]
    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]
