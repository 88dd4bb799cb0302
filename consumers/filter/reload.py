"""Hot reload of the classifier artifact: a new file is picked up without a restart.

The consumer asks :meth:`ClassifierSlot.current` for every message; at most once
per ``check_s`` that costs one ``stat`` of the artifact. When the modification
time (or size) changed, the file is loaded again. A file that fails to load
(half written, wrong format) leaves the previous classifier in service: a bad
deploy must not open the filter. Writers should still replace the file
atomically (write elsewhere, then rename).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from consumers.filter.config import FilterConfig
from consumers.filter.ensemble import Ensemble
from consumers.filter.interface import Classifier
from consumers.filter.loader import load_classifier

__all__ = ["ClassifierSlot", "artifact_path", "slot_for"]

log = logging.getLogger(__name__)


class ClassifierSlot:
    """Holds the classifier in service and swaps it when its artifact changes."""

    def __init__(
        self,
        path: str | Path,
        check_s: float = 5.0,
        loader: Callable[[Path], Classifier | Ensemble] = load_classifier,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = Path(path)
        self.check_s = check_s
        self._loader = loader
        self._clock = clock
        self._stamp = self._stat()
        self._classifier = loader(self.path)  # fails at start: a missing artifact is a config error
        self._next_check = clock() + check_s
        self.reloads = 0
        self.failures = 0

    def _stat(self) -> tuple[int, int] | None:
        # A checkpoint directory is watched through its config.json.
        target = self.path / "config.json" if self.path.is_dir() else self.path
        try:
            st = target.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def current(self) -> Classifier | Ensemble:
        """The classifier to use now (reloaded first when the artifact changed)."""
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self.check_s
            stamp = self._stat()
            if stamp is not None and stamp != self._stamp:
                self._swap(stamp)
        return self._classifier

    def _swap(self, stamp: tuple[int, int]) -> None:
        try:
            fresh = self._loader(self.path)
        except Exception as exc:  # noqa: BLE001 - any load failure keeps the old model in service
            self.failures += 1
            log.warning("classifier reload from %s failed, keeping %s: %s", self.path, self._classifier.version, exc)
            return
        self._stamp = stamp
        log.info("classifier reloaded: %s -> %s", self._classifier.version, fresh.version)
        self._classifier = fresh
        self.reloads += 1


def artifact_path(configured: str) -> Path:
    """``classifier_path`` as the filter process reads it: relative paths from the working
    directory, else (the committed default, from any directory) from the repository."""
    path = Path(configured)
    if not path.is_absolute() and not path.exists():
        path = Path(__file__).resolve().parents[2] / path
    return path


def slot_for(config: FilterConfig) -> ClassifierSlot | None:
    """The classifier stage the filter process serves under ``config`` (None: rules only);
    `arena filter-eval` measures through the same function."""
    if config.classifier_path is None:
        return None
    return ClassifierSlot(
        artifact_path(config.classifier_path),
        config.classifier_reload_s,
        loader=lambda p: load_classifier(p, config.guard_attack_label),
    )
