"""Where engine processes come from: a fork server with the engine's modules imported.

An engine process started as a fresh interpreter spends seconds importing torch and
transformers (5-7 s on a busy 2-core VM) before it can step, and a worker restarted after
a ``kill -9`` waited for that on top of its own imports. The fork server imports them
once, beside the worker (it is started before the worker's own imports), and each engine
process is forked from it in a fraction of a second. It is a process of its own, never
the worker: a fork of the worker would copy its threads' locks and, on a GPU host, its
CUDA context. It ends when the worker does.

Nothing here imports torch: :func:`start` runs before the worker's imports.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver, resource_tracker
from multiprocessing.context import BaseContext

#: What the fork server imports before it forks anything.
PRELOAD = ["consumers.inference.fork_guard", "consumers.inference.engine_process", "consumers.inference.fork_freeze"]
#: Where engine processes write their logs when not where the fork server's stdout and
#: stderr go: a promoted warm spare's (infra.commands.run.promoted) started its fork server
#: while it wrote to the spare's log, and writes to the worker's from then on.
log_file: str | None = None


def context() -> BaseContext:
    """The multiprocessing context engine processes are started with."""
    return mp.get_context("forkserver")


def start() -> None:
    """Start the fork server if it is not running; it imports :data:`PRELOAD` in the
    background, so the caller goes on with its own imports meanwhile."""
    context().set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


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
