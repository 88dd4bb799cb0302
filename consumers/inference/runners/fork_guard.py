"""Imported first by the fork server (forks.PRELOAD): while it imports the engine's
modules (seconds: torch, transformers), a thread watches its parent (a worker, or a warm
spare) and ends the process if the parent is gone; `fork_freeze`, imported last, stops
the thread, so none runs when the server forks, and from then on the server's own loop
sees its parent go. Without it a stack stopped while a spare's fork server was still
importing left that process behind for seconds. (Not PR_SET_PDEATHSIG: it fires when the
thread that started the server ends, and an engine's start thread may be that thread.)"""

import os
import threading

_parent = os.getppid()
done = threading.Event()


def _watch() -> None:
    while not done.wait(0.2):
        if os.getppid() != _parent:
            os._exit(0)


watcher = threading.Thread(target=_watch, name="fork-guard", daemon=True)
watcher.start()
