"""Child processes this one started (pure subprocess handling), and a child's tie to its parent."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess

_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1


def die_with_parent(sig: int = signal.SIGKILL, name: str | None = None) -> None:
    """In a child (before its exec, or first thing in a forked one): the kernel sends it
    ``sig`` when the thread that started it ends (its parent killed with -9 included);
    ``name``: what ``ps`` and ``psutil`` call it. Linux; elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
        if name is not None:
            libc.prctl(_PR_SET_NAME, name.encode())


def end(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if it has not ended in ``timeout_s``; nothing if it has ended."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
