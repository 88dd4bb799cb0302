"""The cyclic garbage collector in a long-running server.

A full collection walks every object the process holds: a gateway's hundred thousand,
an inference process's several times that (torch, transformers and a model), tens to
hundreds of milliseconds each (docs/admission.md, "The garbage collector out of the
way"). Each stalls the event loop or the decode loop,
at moments set by allocation counts, i.e. in the middle of a burst. What startup
allocated (modules, settings, the warm models) lives as long as the process, so it is
frozen out of the collector's reach once the process is up: a full collection then
takes well under a millisecond (`python -m bench.heap` measures both).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import time

log = logging.getLogger(__name__)

#: A collection longer than this is logged (a warning: it stalled the process).
SLOW_MS = 20.0
_started: list[float] = []
#: Only a process of the topology freezes its heap (`arena run <role>` calls `enable`), not
#: one that builds an app in-process (tests, an embedding program).
_enabled: list[bool] = []


def enable() -> None:
    _enabled[:] = [True]


def freeze() -> None:
    """Everything alive now (startup's objects) is left out of later collections; from
    now on a collection longer than SLOW_MS is logged. A no-op until `enable`d."""
    if not _enabled:
        return
    gc.collect()
    gc.freeze()
    log.info("startup's %d objects frozen out of garbage collection", gc.get_freeze_count())
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started and (ms := (time.perf_counter() - _started[0]) * 1000) > SLOW_MS:
        log.warning(
            "garbage collection of generation %d took %.0f ms (%d freed)", info["generation"], ms, info["collected"]
        )


def release() -> None:
    """After dropping something frozen (a model evicted from the pool): collect its
    reference cycles too, then freeze what is still alive again."""
    if _enabled:
        gc.unfreeze()
        freeze()


#: Allocations from this size on are mapped on their own and unmapped when freed
#: (`mmap_threshold`).
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `size` bytes, for a process that steps a model.

    glibc maps a large allocation on its own and unmaps it when freed, but raises the
    threshold to the largest block freed so (up to 32 MB): a decode loop's activations
    and KV copies, of sizes that change with every batch and prompt, then come from the
    heap, which fragments and keeps what it once held. SmolLM2's engine, 3 waves of 48
    prompts of varied lengths: 5.2 GB resident by default, 1.6 GB at 1 MB (1.4 at 64 KB,
    4.8 at 4 MB), decode steps as fast. False where it is not glibc or the threshold is
    set by the environment (`MALLOC_MMAP_THRESHOLD_`, which wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, size))
    except (OSError, AttributeError):
        return False
