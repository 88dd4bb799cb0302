"""An LRU pool of loaded models under a memory budget.

Callers borrow a model with ``async with pool.use(name) as loaded:``; while borrowed
it is *pinned* and never evicted. Loading a model that is not resident first evicts
least-recently-used unpinned models until its estimated size fits the budget; when
everything resident is pinned the load waits up to ``wait_timeout`` seconds for a
release and then raises :class:`PoolExhausted` (retryable). Concurrent requests for
the same cold model share one load (single flight), which runs in a worker thread so
the event loop keeps serving.

Memory: on CPU the pool counts the weights' bytes of what it holds; when any spec is
on CUDA it reads ``torch.cuda.memory_allocated()`` (which also sees KV caches) and caps
the process with ``torch.cuda.set_per_process_memory_fraction``. Single GPU assumed.

All methods must be called from one event loop; state is only touched between awaits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from consumers.inference.catalog import Catalog
from consumers.inference.errors import PermanentError, PoolExhausted
from consumers.inference.model_loading import LoadedModel, ModelSpec, load_model
from runtime import heap

log = logging.getLogger(__name__)

Loader = Callable[[ModelSpec, int], LoadedModel]


@dataclass(frozen=True)
class PoolStats:
    hits: int  # acquires served by a resident model
    misses: int  # acquires that had to wait for a load (their own or a shared one)
    evictions: int
    loads: int  # loader calls, reloads included
    load_seconds: float  # total time spent in the loader
    resident_bytes: int


@dataclass
class PoolCounts:
    """The pool's counters so far (what :class:`PoolStats` reports of them)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    loads: int = 0
    load_seconds: float = 0.0


class ModelPool:
    """LRU cache of :class:`LoadedModel` objects keyed by served name."""

    def __init__(
        self,
        specs: list[ModelSpec],
        budget_bytes: int,
        loader: Loader = load_model,
        *,
        gpu_memory_fraction: float = 0.85,
        wait_timeout: float = 30.0,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.catalog = Catalog(specs)  # what it serves: specs, variants, context lengths
        self.budget_bytes = budget_bytes
        self._loader = loader
        self._wait_timeout = wait_timeout
        self._cuda = torch.cuda.is_available() and any(s.device.startswith("cuda") for s in specs)
        if self._cuda:
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction)
        self._resident: OrderedDict[str, LoadedModel] = OrderedDict()  # least recent first
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self._pins: dict[int, int] = {}  # id(LoadedModel) -> borrowers
        self._retired: dict[int, LoadedModel] = {}  # replaced or removed, still borrowed
        self._versions: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # last measured size per name
        self._reserved = 0  # bytes promised to loads in flight
        self._released: list[asyncio.Future[None]] = []  # loads waiting for room
        self._awaiting: dict[str, int] = {}  # borrowers waiting on a load; protects it from eviction
        self.counts = PoolCounts()

    @property
    def loader(self) -> Loader:
        """How the pool loads a model (``loader(spec, version)``): an engine process's
        runner loads one again with it to write back weights it gave back."""
        return self._loader

    # ---- borrowing -----------------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[LoadedModel]:
        """Borrow ``name``'s current version, pinned for the block's duration."""
        loaded = await self.acquire(name)
        try:
            yield loaded
        finally:
            self.release(loaded)

    async def acquire(self, name: str) -> LoadedModel:
        """Pin and return ``name``'s current version; pair with :meth:`release`."""
        counted = False
        name = self.catalog.spec(name).base or name  # a variant borrows its base's weights
        while True:
            self.catalog.spec(name)  # removed meanwhile: UnknownModel
            loaded = self._resident.get(name)
            if loaded is not None:
                if not counted:
                    self.counts.hits += 1
                self._resident.move_to_end(name)
                self._pin(loaded)
                return loaded
            if not counted:
                self.counts.misses += 1
                counted = True
            task = self._loading.get(name)
            if task is None:
                task = self._start_load(name, self._versions.get(name, 0) + 1)
            self._awaiting[name] = self._awaiting.get(name, 0) + 1
            try:
                # shield: a cancelled borrower must not abort a load that others await.
                await asyncio.shield(task)
            finally:
                self._awaiting[name] -= 1
            # Loop: pins the new model, or notices it was removed meanwhile.

    def release(self, loaded: LoadedModel) -> None:
        """Unpin a borrowed model; a retired version is dropped with its last borrower."""
        key = id(loaded)
        count = self._pins.get(key, 0) - 1
        if count < 0:
            raise RuntimeError(f"release of model {loaded.spec.name} v{loaded.version} that is not borrowed")
        if count:
            self._pins[key] = count
        else:
            del self._pins[key]
            if self._retired.pop(key, None) is not None:
                self._free_device_memory()
        self._notify()

    def _notify(self) -> None:
        """Wake loads waiting for room: something was released or a load finished."""
        waiters, self._released = self._released, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _pin(self, loaded: LoadedModel) -> None:
        self._pins[id(loaded)] = self._pins.get(id(loaded), 0) + 1

    # ---- inspection ----------------------------------------------------------------

    def resident(self) -> list[str]:
        """Names of resident models, least recently used first; a variant follows its base."""
        out = []
        for name in self._resident:
            out.append(name)
            out += self.catalog.variants(name)
        return out

    def resident_model(self, name: str) -> LoadedModel | None:
        """``name``'s resident weights (a variant's are its base's), or None."""
        spec = self.catalog.specs.get(name)
        return self._resident.get(spec.base or name) if spec is not None else None

    def holds(self, loaded: LoadedModel) -> bool:
        """Whether ``loaded`` is still this pool's: resident, or retired and borrowed."""
        return self._resident.get(loaded.spec.name) is loaded or id(loaded) in self._retired

    @property
    def stats(self) -> PoolStats:
        return PoolStats(**dataclasses.asdict(self.counts), resident_bytes=self._used_bytes())

    def specs(self) -> list[ModelSpec]:
        return list(self.catalog.specs.values())

    def contexts(self) -> dict[str, int]:
        """Each model's context length in tokens, where known (Catalog.context_lengths)."""
        return self.catalog.context_lengths()

    # ---- management ----------------------------------------------------------------

    async def warm(self, names: list[str]) -> None:
        """Load ``names`` in order (the last one ends most recently used)."""
        for name in names:
            async with self.use(name):
                pass

    async def add(self, spec: ModelSpec) -> None:
        """Register a new model name (loaded lazily, on first use)."""
        self.catalog.register(spec)
        await asyncio.to_thread(self.catalog.read_context, spec)

    async def reload(self, name: str, spec: ModelSpec | None = None) -> LoadedModel:
        """Load a new version of ``name`` (optionally from a new spec) and swap it in.

        Borrowers of the old version keep it until they release it. Room is made for
        the new version next to the old one, which is then retired.
        """
        self.catalog.spec(name)
        if spec is not None:
            if spec.name != name:
                raise ValueError(f"reload of {name!r} got a spec named {spec.name!r}")
            self.catalog.specs[name] = spec
        await self._settle(name)
        new = await asyncio.shield(self._start_load(name, self._versions.get(name, 0) + 1))
        log.info("model %s swapped to v%d", name, new.version)
        return new

    async def remove(self, name: str) -> None:
        """Unregister ``name``; its model is dropped once no one borrows it."""
        self.catalog.spec(name)
        if variants := sorted(self.catalog.variants(name)):
            raise ValueError(
                f"model {name!r} is the base of {', '.join(variants)}, which would stop working: "
                f"remove {'them' if len(variants) > 1 else 'it'} first"
            )
        await self._settle(name)
        del self.catalog.specs[name]
        self.catalog.contexts.pop(name, None)
        old = self._resident.pop(name, None)
        if old is not None:
            self._retire(old)

    async def _settle(self, name: str) -> None:
        """Wait for an in-flight load of ``name`` to end, however it ends."""
        while (task := self._loading.get(name)) is not None:
            with suppress(Exception):
                await asyncio.shield(task)

    # ---- loading and eviction ------------------------------------------------------

    def _start_load(self, name: str, version: int) -> asyncio.Task[LoadedModel]:
        task = asyncio.get_running_loop().create_task(self._load(name, version), name=f"load-{name}")
        self._loading[name] = task
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception never retrieved"
        return task

    async def _load(self, name: str, version: int) -> LoadedModel:
        spec = self.catalog.specs[name]
        need = self._estimate_bytes(spec)
        try:
            await self._make_room(need, name)
            self._reserved += need
            t0 = time.perf_counter()
            try:
                loaded = await asyncio.to_thread(self._loader, spec, version)
            except torch.OutOfMemoryError as exc:
                raise PoolExhausted(f"out of device memory loading {name}: {exc}") from exc
            finally:
                self._reserved -= need
                self.counts.loads += 1
                self.counts.load_seconds += time.perf_counter() - t0
        finally:
            self._loading.pop(name, None)
            self._notify()
        if name not in self.catalog.specs:  # removed while loading
            return loaded
        self._versions[name] = max(version, self._versions.get(name, 0))
        self._sizes[name] = loaded.nbytes
        self.catalog.contexts[name] = loaded.context_len
        old = self._resident.pop(name, None)
        if old is not None:
            self._retire(old)
        self._resident[name] = loaded
        self._evict_over_budget(keep=name)
        return loaded

    def _estimate_bytes(self, spec: ModelSpec) -> int:
        """Last measured size, else the weights' size on disk (0 for a hub id)."""
        if spec.name in self._sizes:
            return self._sizes[spec.name]
        path = Path(spec.path)
        if not path.is_dir():
            return 0
        return sum(f.stat().st_size for pat in ("*.safetensors", "*.bin", "*.pt") for f in path.glob(pat))

    def _used_bytes(self) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated()
        return sum(m.nbytes for m in self._resident.values()) + sum(m.nbytes for m in self._retired.values())

    def _lru_unpinned(self, exclude: str | None = None) -> str | None:
        for name, loaded in self._resident.items():
            if name != exclude and id(loaded) not in self._pins and not self._awaiting.get(name):
                return name
        return None

    async def _make_room(self, need: int, name: str) -> None:
        """Evict LRU unpinned models until ``need`` more bytes fit, waiting for releases."""
        if need > self.budget_bytes and name in self._sizes:
            raise PermanentError(
                f"model {name} needs {need} bytes but the pool budget is {self.budget_bytes}; raise the budget"
            )
        deadline = time.monotonic() + self._wait_timeout
        while self._used_bytes() + self._reserved + need > self.budget_bytes:
            victim = self._lru_unpinned(exclude=name)
            if victim is not None:
                self._evict(victim)
                continue
            if not self._resident and not self._retired and not self._reserved:
                return  # nothing to make room from: an estimate above budget; try anyway
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolExhausted(
                    f"cannot load {name}: all resident models {list(self._resident)} are in use; "
                    "retry later or raise the pool budget"
                )
            fut = asyncio.get_running_loop().create_future()
            self._released.append(fut)
            with suppress(TimeoutError):
                await asyncio.wait_for(fut, remaining)

    def _evict_over_budget(self, keep: str) -> None:
        while self._used_bytes() > self.budget_bytes:
            victim = self._lru_unpinned(exclude=keep)
            if victim is None:
                log.warning(
                    "pool over budget (%d > %d) with every other model in use", self._used_bytes(), self.budget_bytes
                )
                return
            self._evict(victim)

    def _evict(self, name: str) -> None:
        loaded = self._resident.pop(name)
        self.counts.evictions += 1
        log.info("evicted model %s v%d (%d bytes)", name, loaded.version, loaded.nbytes)
        del loaded
        self._free_device_memory()

    def _retire(self, loaded: LoadedModel) -> None:
        if id(loaded) in self._pins:
            self._retired[id(loaded)] = loaded
        else:
            self._free_device_memory()

    def _free_device_memory(self) -> None:
        heap.release()  # the model's reference cycles, frozen with it at startup
        if self._cuda:
            torch.cuda.empty_cache()
