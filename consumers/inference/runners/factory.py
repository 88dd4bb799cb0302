"""The one place that decides how a loaded model is stepped: which backend (the built-in
batch engine, llama.cpp's server, an upstream's) and where (a thread beside the event
loop, or a process of its own), from its spec and the :class:`EngineConfig`; and the
runners it built, one per model version the pool holds."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from consumers.inference.config import EngineConfig
from consumers.inference.engine.batch import BatchEngine
from consumers.inference.engine_io import StepOutput
from consumers.inference.llamacpp.build import locate
from consumers.inference.llamacpp.engine import LlamaCppEngine
from consumers.inference.model_loading import LoadedModel, ModelSpec, machine, weights_nbytes
from consumers.inference.runners.base import Runner
from consumers.inference.runners.cores import CoreShare, share_or_none, sizing
from consumers.inference.runners.process import ProcessRunner, shm_room
from consumers.inference.runners.thread import EngineRunner
from consumers.inference.upstream.engine import UpstreamEngine

log = logging.getLogger(__name__)


class RunnerFactory:
    """Builds the :class:`Runner` of a loaded model. ``reload(spec, version)`` loads a
    model again (the pool's loader): an engine process gives back the pool's row-major
    copy of what it packs, and has it written back from a reload before it restarts."""

    def __init__(
        self,
        config: EngineConfig,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], None],
        reload: Callable[[ModelSpec, int], LoadedModel] | None = None,
    ) -> None:
        self.config = config
        self.loop = loop
        self.on_outputs = on_outputs
        self.reload = reload
        self._core_notes: CoreShare | Literal[False] | None = None  # _noted(); False: none can be made

    def build(self, loaded: LoadedModel) -> Runner:
        c = self.config
        figures = figures_path(loaded, c)
        if loaded.spec.backend == "llamacpp":  # llama-server steps it; the runner's thread reads its steps
            llama = LlamaCppEngine(loaded, locate(c.llama_cpp_dir), c.max_batch_size, c.llama_cpp_threads)
            return EngineRunner(
                llama,
                self.loop,
                self.on_outputs,
                profile=c.step_profile,
                figures=figures,
                **self._noted(),
            )
        # An upstream's streams time it, and its server is someone's: no idle probes.
        if (options := loaded.spec.upstream) is not None:
            upstream = UpstreamEngine(loaded)
            return EngineRunner(
                upstream,
                self.loop,
                self.on_outputs,
                profile=c.step_profile and options.profile,
                available=lambda: not upstream.circuit.open,
                idle_probes=False,
            )
        if c.in_process and shareable(loaded):
            reload = functools.partial(self.reload, loaded.spec, loaded.version) if self.reload else None
            return ProcessRunner(loaded, c, self.loop, self.on_outputs, figures=figures, reload=reload)
        return EngineRunner(
            BatchEngine.configured(loaded, c),
            self.loop,
            self.on_outputs,
            c.max_wait_s,
            profile=c.step_profile,
            figures=figures,
            **self._noted(),
        )

    def _noted(self) -> dict[str, Any]:
        """This process's note of its engines' steps (a llama.cpp server's, an engine on a
        thread) as a runner's keyword arguments (`CoreShare.hooks`), so the machine's
        engine processes size their threads to them (cores.py) and an idle one here does
        not probe beside theirs; none where they do not (ARENA_TORCH_THREADS_ALONE unset)
        or the notes' directory cannot be made."""
        c = self.config
        if not sizing(c.torch_threads, c.torch_threads_alone):
            return {}
        if self._core_notes is None:
            self._core_notes = (c.cores_dir and share_or_none(c.cores_dir, 0, 0)) or False
        return self._core_notes.hooks() if self._core_notes else {}


class Runners:
    """The runners the worker holds, one per model version (by the loaded model's id),
    each built by the factory on its model's first request (the factory comes with the
    event loop: the worker's start)."""

    def __init__(self, factory: RunnerFactory | None = None) -> None:
        self.factory = factory
        self._runners: dict[int, Runner] = {}

    def get(self, loaded: LoadedModel) -> Runner:
        runner = self._runners.get(id(loaded))
        if runner is None or runner.loaded is not loaded:
            assert self.factory is not None, "start() the worker first"
            runner = self._runners[id(loaded)] = self.factory.build(loaded)
        return runner

    def values(self) -> Iterator[Runner]:
        return iter(list(self._runners.values()))

    def prune(self, holds: Callable[[LoadedModel], bool]) -> list[Runner]:
        """Take out the runners of model versions the pool let go (evicted, or replaced
        and no longer borrowed), for the caller to stop: a runner holds its engine, the
        engine its weights (and an engine process its own copy), so the pool's eviction
        frees nothing while the runner stays."""
        stale = {key: runner for key, runner in self._runners.items() if not holds(runner.loaded)}
        for key, runner in stale.items():
            del self._runners[key]
            log.info("engine of %s v%d stopped: its model left the pool", runner.name, runner.loaded.version)
        return list(stale.values())


def shareable(loaded: LoadedModel) -> bool:
    """An engine process reads the pool's weights from shared memory; where /dev/shm
    is too small for them, the model's engine runs on a thread instead (and says so)."""
    if loaded.spec.device != "cpu" or shm_room(shared := weights_nbytes(loaded.model)):
        return True
    log.warning(
        "/dev/shm has no room for %s's %.0f MB of weights: its engine runs on a thread, not in a process "
        "(give the container more shared memory, e.g. docker run --shm-size, to have it in one)",
        loaded.spec.name,
        shared / 1e6,
    )
    return False


def figures_path(loaded: LoadedModel, config: EngineConfig) -> str | None:
    """Where ``loaded``'s engine keeps its measured steps (:data:`figures.FIGURES_MAX_AGE_S`):
    one file per model, engine settings, machine and engine code; None without a step
    profile or with ARENA_STEP_FIGURES_DIR empty."""
    if not config.step_profile or not config.step_figures_dir:
        return None
    key = {
        "spec": loaded.spec.model_dump(mode="json"),
        "version": loaded.version,
        "engine": config.timing_key(),
        "machine": machine(),
        "code": engine_code(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return str(Path(config.step_figures_dir).expanduser() / f"{loaded.spec.name}-{digest}.json")


@functools.cache
def engine_code() -> str:
    """A digest of the code that steps a model (the inference package's sources) and of
    torch's and transformers' versions: kept step figures are another code's after an upgrade."""
    import torch  # noqa: PLC0415 - loaded by now wherever a model is
    import transformers  # noqa: PLC0415

    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for source in sorted(Path(__file__).parents[1].rglob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]
