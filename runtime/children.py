"""Child processes this one started (pure subprocess handling)."""

from __future__ import annotations

import subprocess


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
