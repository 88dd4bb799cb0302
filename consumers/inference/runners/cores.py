"""Threads sized to the load: an engine takes the machine's cores while it is the only
engine stepping there, and its share of them while another one steps.

One torch thread an engine (ARENA_TORCH_THREADS, arena up's share) leaves a core to the
gateway, the filter and NATS, and keeps an arena battle's two models from fighting for
the cores: with two threads each, both models' tokens a second fell to a fraction
(docs/benchmarks.md). But a model served alone (one user, or a load on one model) then
runs a step on one core of two, and two threads served it faster. So each engine notes
its steps in a directory every engine of the machine shares (a file per process, its
modification time the last step), and runs a step with ``alone`` threads when no other
engine stepped within :data:`WINDOW_S`, and with ``shared`` ones otherwise. A battle runs
both models at one thread each, as before; a model alone gets both cores.

A second thread pays only where the threads do not wait for each other between the
step's products: torch's OpenMP threads spin briefly at the end of a parallel region
(libgomp's default bounded spin, ``GOMP_SPINCOUNT``) instead of sleeping
(``OMP_WAIT_POLICY=PASSIVE``, where waking the second thread for each of a step's ~200
products costs more than it brings). One thread runs no parallel region, so an engine
back at its share spins no more. Small models (under ``prepack.MIN_PARAMS``: a step is
Python's time there) keep their share always (:func:`alone_threads`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

#: Another engine that stepped within this many seconds is stepping: longer than a step
#: of the models served (tens of ms) and than the gap between a closed-loop user's turns.
WINDOW_S = 0.25
#: How often an engine notes that it steps (a file's time each step would cost a tiny
#: model's step of about a millisecond a syscall each).
NOTE_EVERY_S = WINDOW_S / 5
#: Where the machine's engines note their steps unless ARENA_CORES_DIR says otherwise.
DEFAULT_DIR = str(Path.home() / ".cache" / "arenaflow" / "cores")


def sizing(shared: int, alone: int) -> bool:
    """Whether engines with these settings size their threads to the load (and so note
    their steps): ``alone`` above ``shared``."""
    return alone > shared


def alone_threads(shared: int, alone: int, params: int, min_params: int) -> int:
    """The threads a model's engine takes alone: ``alone`` for a model of ``min_params``
    weights or more, else ``shared`` (a small model's step is Python's time, which a
    second spinning thread slows down many times over: docs/operations.md)."""
    return alone if sizing(shared, alone) and params >= min_params else shared


class CoreShare:
    """One engine process's note in ``directory`` and the threads its next step takes.

    ``shared`` and ``alone``: torch threads with another engine stepping and without (0:
    torch's default, untouched). With ``alone == shared`` it only notes its steps (a
    llama.cpp server's runner: the built-in engines beside it see it stepping). ``set_threads``:
    what sets them (``torch.set_num_threads``; None: only notes)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        shared: int,
        alone: int,
        set_threads: Callable[[int], None] | None = None,
        window_s: float = WINDOW_S,
        name: str | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shared, self.alone, self.window_s = shared, alone, window_s
        self.name = name or str(os.getpid())  # a process's pid (its note is swept once it is gone)
        self.mine = self.dir / self.name
        self._set_threads = set_threads
        self._noted = 0.0
        self.threads = shared
        _sweep(self.dir)

    @property
    def sizing(self) -> bool:
        """Whether this engine changes its threads with the load (else it only notes)."""
        return self.alone != self.shared and self._set_threads is not None

    def before_step(self) -> int:
        """Note a step, and set the threads it takes: ``alone`` unless another engine of
        the machine stepped within the window. Returns them."""
        now = time.time()
        if now - self._noted >= NOTE_EVERY_S:
            with suppress(OSError):  # a full or vanished directory: the engine still steps
                self.mine.touch()
            self._noted = now
        if not self.sizing:
            return self.threads
        want = self.shared if self.others_stepping(now) else self.alone
        if want != self.threads:
            assert self._set_threads is not None
            self._set_threads(want)
            log.debug("engine step threads %d -> %d", self.threads, want)
            self.threads = want
        return want

    def others_stepping(self, now: float | None = None) -> bool:
        """Whether another engine of the machine noted a step within the window."""
        now = time.time() if now is None else now
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return False
        for entry in entries:
            if entry.name == self.name:
                continue
            try:
                if now - entry.stat().st_mtime < self.window_s:
                    return True
            except OSError:  # its process removed it meanwhile
                continue
        return False

    def hooks(self) -> dict[str, Any]:
        """An :class:`EngineRunner`'s keyword arguments for this note: its steps noted
        (`before_step`), and its idle probes held while another engine steps
        (`neighbours_stepping`)."""
        return {"before_step": self.before_step, "neighbours_stepping": self.others_stepping}

    def close(self) -> None:
        with suppress(OSError):
            self.mine.unlink()


def share_or_none(directory: str, shared: int, alone: int, **kwargs: Any) -> CoreShare | None:
    """A :class:`CoreShare`, or None where its directory cannot be made (a read-only home
    in a container): the engine then steps on its share, as without one (logged)."""
    try:
        return CoreShare(directory, shared, alone, **kwargs)
    except OSError as exc:
        log.warning("no step notes in %s (%s): engine threads stay at %d", directory, exc, shared)
        return None


def _sweep(directory: Path) -> None:
    """Remove the notes of processes that are gone (a killed engine leaves its file)."""
    with suppress(OSError):
        for entry in os.scandir(directory):
            if entry.name.isdigit() and not psutil.pid_exists(int(entry.name)):
                with suppress(OSError):
                    os.unlink(entry.path)
