"""The batch engine in a process of its own, as vLLM's engine core runs beside its API server.

A served engine thread shares its process's GIL with the consumer's event loop: torch
lets go of the GIL around every op, the loop thread takes it, and the engine waits for
it back (served at 32 users, stories260K's engine thread was on the CPU 62 % of the
time, 28 % waiting to run and 10 % for the GIL; raising its priority only moved the wait
to the GIL). In its own process it has a GIL of its own.

The child steps an :class:`EngineRunner` (the same stepping, static hold and step-time
measurement as the in-process runner) over the pool's own copy of the weights: they are
moved to shared memory, one flat buffer per dtype, and handed over (a file descriptor per
buffer, torch's multiprocessing), so a model is in memory once, whichever process steps it
(and where the child packs its linear layers, prepack.py, on a thread while it serves,
the pool's row-major copy of them is given back once the packed ones are in place, and
written back before another child starts:
:func:`release_packed`). The child is
forked from a fork server that has torch imported already (``forks.py``): it is ready in
a fraction of a second, not the seconds a fresh interpreter takes to import torch.
Requests go down a pipe; each step's outputs come back with the engine's state (budgets
and step times, for admission) and are handed to the loop as the thread runner hands them.
:class:`ProcessRunner` has the runner's interface (``add``, ``cancel``, ``finish_at``,
``load``, ``stop``), so the service cannot tell them apart.

The child ends with its consumer: it reads the pipe between steps and exits when the
consumer's end closes (a ``kill -9`` of the consumer closes it), and it asks the kernel
for SIGKILL when its parent, the fork server, dies (as it does with the consumer). When
a child dies, what it held is given back to the stream ("lost" outputs: the service naks
those messages, and they are continued from their stored chunks, as a dead worker's
are) and a new one is started at once.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import mmap
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

import psutil
import torch

from consumers.inference.config import EngineConfig
from consumers.inference.engine import prepack
from consumers.inference.engine.batch import BatchEngine, check_prompt
from consumers.inference.engine_io import (
    AddRequest,
    CancelRequest,
    EngineCommand,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    EngineStats,
    GenRequest,
    SchedulerStats,
    StepOutput,
    StepRecord,
    StopEngine,
)
from consumers.inference.errors import PermanentError, RetryableError
from consumers.inference.metrics import PrefixCounts
from consumers.inference.model_loading import LoadedModel
from consumers.inference.runners import cores, forks
from consumers.inference.runners.thread import EngineRunner, estimate_finish, record_step
from events.fleet import EngineLoad
from runtime import children, heap, logs

log = logging.getLogger(__name__)

#: How long a child may take to start and answer, at most (the fork server's own start,
#: importing torch and transformers, included).
START_TIMEOUT_S = 120.0
#: A child that died before it was ready is started again by the first request this
#: long after, at the soonest (one that cannot load must not be restarted in a loop).
RESTART_AFTER_S = 10.0
#: The engine process's nice value relative to the consumer's, where the OS allows it
#: (lowering it needs CAP_SYS_NICE; without, it stays as it is).
ENGINE_NICE = -5


class _Immediate:
    """The child's stand-in for an event loop: the runner's hand-off runs at once, on the
    engine thread, which sends the outputs up the pipe."""

    @staticmethod
    def call_soon_threadsafe(callback: Callable[[], None]) -> None:
        callback()


#: The engine process's name in ps, top and /proc (``comm``, 15 bytes at most).
PROCESS_NAME = "arena-engine"


@dataclass(frozen=True, slots=True)
class ChildArgs:
    """What an engine process is started with (pickled to it by the fork server)."""

    loaded: LoadedModel
    config: EngineConfig
    figures: str | None  # its runner's kept step figures (EngineRunner)
    consumer: int  # the worker's pid: gone already, the child ends at once
    log_level: str  # the worker's
    log_file: str | None  # where its logs go (None: where the fork server's go, the worker's)


def _child(args: ChildArgs, conn: Any) -> None:
    """The engine process: step whatever comes down the pipe until it closes. A step takes
    the config's ``torch_threads``, or ``torch_threads_alone`` while no other engine of the
    machine steps (noted in its ``cores_dir``: cores.py)."""
    loaded, config = args.loaded, args.config
    threads, alone_threads, cores_dir = config.torch_threads, config.torch_threads_alone, config.cores_dir
    log_file = args.log_file
    children.die_with_parent(signal.SIGKILL, PROCESS_NAME)
    if log_file:
        with suppress(OSError):
            logs.output_to(log_file)
    if not psutil.pid_exists(args.consumer):  # it died while this process was starting
        os._exit(0)
    if threads:
        torch.set_num_threads(threads)
    heap.mmap_threshold()  # forked from the fork server, which did not set it
    logs.setup(args.log_level, process=f"engine:{loaded.spec.name}")  # the worker's level, its JSON lines
    end = _EngineEnd(conn)
    # Packed on a thread while it serves (a replacement for a dead engine answers at once);
    # the worker gives its row-major copy back once they are in place (release_packed).
    engine = BatchEngine.configured(loaded, config, pack_in_background=True, on_packed=end.packed)
    share = None
    if cores_dir and cores.sizing(threads, alone_threads):  # every engine notes (a small one for the others)
        alone = cores.alone_threads(threads, alone_threads, prepack.parameter_count(loaded.model), prepack.MIN_PARAMS)
        share = cores.share_or_none(cores_dir, threads, alone, set_threads=torch.set_num_threads if threads else None)
    end.runner = EngineRunner(
        engine,
        _Immediate(),  # type: ignore[arg-type]
        end.send,
        config.max_wait_s,
        on_step=end.on_step,
        profile=config.step_profile,
        figures=args.figures,
        **(share.hooks() if share is not None else {}),
    )
    try:
        end.serve()
    except (EOFError, OSError):  # the parent is gone
        pass
    finally:
        end.runner.stop()
        if share is not None:
            share.close()
        os._exit(0)


class _EngineEnd:
    """The child's end of the pipe: commands in, each step's outputs and state out."""

    runner: EngineRunner

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()  # the engine thread sends, and so does the main thread (a refused add)
        self.steps: list[StepRecord] = []  # since the last message: for the worker's metrics
        self.unjoined: dict[str, GenRequest] = {}  # added, and not yet reported as joined to a batch
        self.ready_sent = False

    def send(self, outputs: list[StepOutput]) -> None:
        stats = self.runner.stats()
        with self.lock:
            done, self.steps = self.steps, []
            joined = {o.request_id: self.unjoined.pop(o.request_id) for o in outputs if o.request_id in self.unjoined}
            at = {rid: req.admitted_at for rid, req in joined.items() if req.admitted_at is not None}
            self._send(EngineOutputs(outputs, stats, done, at))

    def _send(self, message: EngineMessage) -> None:
        """Up the pipe; a worker killed mid-step closed it: this process ends quietly (the
        engine thread would print a BrokenPipeError in the worker's log otherwise)."""
        try:
            self.conn.send(message)
        except OSError:
            os._exit(0)

    def packed(self) -> None:
        """The engine's packed layers are in place (its packing thread): say so, with its
        state, if the ready message went without it."""
        with self.lock:
            if self.ready_sent:
                self._send(EngineReady(self.runner.stats()))

    def on_step(self, step: StepRecord, _stats: EngineStats) -> None:
        with self.lock:
            self.steps.append(step)

    def serve(self) -> None:
        """Say ready once the runner's profile has ended (its figures in the message), then
        apply each command until the parent says stop (or goes away: EOFError)."""
        self.runner.profiled.wait()
        heap.enable()  # what the fork, the model and the profile left alive: out of the collector's walks
        heap.freeze()
        with self.lock:
            self._send(EngineReady(self.runner.stats()))
            self.ready_sent = True
        while True:
            command: EngineCommand = self.conn.recv()
            match command:
                case AddRequest(req):
                    self.add(req)
                case CancelRequest(request_id):
                    self.runner.cancel(request_id)
                case StopEngine():
                    return

    def add(self, req: GenRequest) -> None:
        try:
            with self.lock:
                self.unjoined[req.request_id] = req
            self.runner.add(req)
        except Exception as exc:  # noqa: BLE001 - the parent checked; report, never die
            self.send([StepOutput.ended(req, "error")])
            log.warning("engine refused a request: %r", exc, extra={"request_id": req.request_id})


@dataclass
class EngineChild:
    """A started engine process and the consumer's end of its pipe."""

    proc: Any
    conn: Any


def shm_room(nbytes: int) -> bool:
    """Whether /dev/shm has room for ``nbytes`` of weights (a container's is 64 MB unless
    given more: ``docker run --shm-size``, or a memory-backed emptyDir in Kubernetes)."""
    try:
        return shutil.disk_usage("/dev/shm").free > nbytes * 1.1
    except OSError:
        return False


#: Where each tensor starts in its flat buffer, in bytes (a cache line: what torch's own
#: allocator gives a tensor, so the kernels' vector loads stay aligned).
ALIGN_BYTES = 64


def share(loaded: LoadedModel) -> None:
    """Move ``loaded``'s CPU weights to shared memory (in place, once; the pool's copy
    becomes the one both processes read). CUDA tensors go to a child by CUDA IPC as they are.

    Into one flat buffer per dtype, every parameter and buffer a view of it: a child gets
    a file descriptor per storage, and multiprocessing passes at most ~250 at a time
    (``ValueError: too many fds``), fewer than a 30-layer Llama's tensors (SmolLM2-135M:
    272). Tied weights are one tensor, and stay one view."""
    tensors = [t for t in _tensors(loaded.model) if t.device.type == "cpu"]
    if not tensors or (all(t.is_shared() for t in tensors) and len(storages(loaded.model)) <= len(_by_dtype(tensors))):
        return
    for dtype, group in _by_dtype(tensors).items():
        slots = list(_slots(group).values())
        step = max(1, ALIGN_BYTES // dtype.itemsize)
        starts, end = [], 0
        for first, *_ in slots:
            starts.append(end)
            end += -(-first.numel() // step) * step
        flat = torch.empty(end, dtype=dtype).share_memory_()
        for slot, start in zip(slots, starts, strict=True):
            view = flat[start : start + slot[0].numel()].view(slot[0].shape)
            view.copy_(slot[0])
            for t in slot:
                t.data = view  # the same Parameter (or buffer) object: its modules keep it


#: madvise(2)'s advice that frees a shared (tmpfs) mapping's pages, as a hole punched in its file.
_MADV_REMOVE = 9


def _punch(tensor: torch.Tensor) -> int:
    """Free the whole pages of shared memory under ``tensor`` (for every process that maps
    them; one that reads them after reads zeros); the bytes freed."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_REMOVE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_REMOVE): {os.strerror(err)}")
    return hi - lo


def release_packed(loaded: LoadedModel) -> list[str]:
    """Give back the shared row-major weights that ``loaded``'s engine process packed a copy
    of and no longer reads (prepack.py: every linear layer's but a tied lm_head's, which the
    embedding keeps); call it once that process's packed layers are in place (its stats'
    ``packing_done``). Neither process reads them after:
    the worker does not step its model, and a new engine process needs them written back (:func:`refill`)
    first. The names of the weights given back (none where nothing is packed)."""
    model = loaded.model
    if prepack.wanted(loaded.spec, model) is None:
        return []
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    released = []
    for _, _, linear, tied in prepack.packed_linears(model):
        if not tied and linear.weight.is_shared() and _punch(linear.weight):
            released.append(names[id(linear.weight)])
    return released


def refill(loaded: LoadedModel, fresh: LoadedModel, names: list[str]) -> None:
    """Write the weights named back into ``loaded``'s shared memory from ``fresh``, the same
    model loaded again (the same function, the same weights)."""
    weights = dict(fresh.model.named_parameters(remove_duplicate=False))
    mine = dict(loaded.model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in names:
            mine[name].copy_(weights[name])


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter and buffer once (a tied weight is one Parameter in two modules)."""
    return list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def _slots(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """The tensors that are one piece of memory (tied as two objects over one storage)."""
    slots: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        slots.setdefault((t.data_ptr(), t.dtype, t.shape, t.stride()), []).append(t)
    return slots


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def storages(model: torch.nn.Module) -> set[int]:
    """The distinct storages ``model``'s weights live in (by address): after :func:`share`,
    one per dtype, each a file descriptor when the model goes to a child."""
    return {t.untyped_storage().data_ptr() for t in _tensors(model)}


def spawn(loaded: LoadedModel, config: EngineConfig, figures: str | None = None) -> EngineChild:
    """Start an engine process for ``loaded`` (whose weights it shares, see :func:`share`),
    configured by ``config``; ``figures``: its runner's kept step figures (:class:`EngineRunner`)."""
    forks.start()
    share(loaded)
    ctx = forks.context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(  # type: ignore[attr-defined]  # a multiprocessing context has Process
        target=_child,
        args=(
            ChildArgs(
                loaded,
                config,
                figures,
                os.getpid(),
                logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                forks.log_file,
            ),
            child,
        ),
        name=f"engine-{loaded.spec.name}",
        daemon=True,
    )
    proc.start()
    child.close()
    with suppress(OSError):  # lowering a nice value needs CAP_SYS_NICE
        os.setpriority(os.PRIO_PROCESS, proc.pid or 0, os.getpriority(os.PRIO_PROCESS, 0) + ENGINE_NICE)
    return EngineChild(proc, parent)


def sent_since(stats: SchedulerStats, active: list[GenRequest]) -> SchedulerStats:
    """The engine process's state after its last step with the requests sent to it since
    (the newest of `active`, in the order they were added, beyond those its step held) as
    waiting: the worker's too-late check of a burst pulled within one step otherwise
    judged each of them against the same queue, none counting the others; at 9 requests/s
    19 turns admitted at a level's start were held until their deadline without a token."""
    known = len(stats.engine.running) + len(stats.engine.waiting)
    if len(active) <= known:
        return stats
    unseen = tuple(req.params.max_tokens - len(req.resume_ids) for req in active[known:])
    return replace(stats, engine=replace(stats.engine, waiting=stats.engine.waiting + unseen))


class ProcessRunner:
    """An :class:`EngineRunner` whose engine steps in a child process."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], None],
        figures: str | None = None,
        reload: Callable[[], LoadedModel] | None = None,
    ):
        """``figures``: the engine process's kept step figures (EngineRunner). ``reload``:
        loads the same model again; given, the pool's row-major copy of what the engine
        process packs is given back once it is ready, and written back from a reload before
        a new engine process starts (:func:`release_packed`)."""
        self.loaded = loaded
        self.config = config
        self._reload = reload
        self._released: list[str] = []  # the weights given back, until refilled
        self.figures = figures
        self.name = loaded.spec.name
        self.max_batch_size = config.max_batch_size
        self.prefix_counts = PrefixCounts(loaded.spec.name)
        self.loop = loop
        self.on_outputs = on_outputs
        self._active: dict[str, GenRequest] = {}
        self._stats: SchedulerStats | None = None  # the engine process's, after its last step
        self._lock = threading.Lock()
        self._stopping = False
        #: Set once the engine process has loaded its model and answered.
        self.ready = threading.Event()
        self._dead_since: float | None = None  # when a child died before it was ready
        # While a new child starts (on a thread, see _restart), what would go down its pipe
        # waits here, in order. Both are only touched on the loop.
        self._starting = False
        self._queued: list[EngineCommand] = []
        self._start()

    # ---- the child -----------------------------------------------------------------

    def _start(self) -> None:
        child = spawn(self.loaded, self.config, self.figures)
        self._conn, self._proc = child.conn, child.proc
        self._reader = threading.Thread(target=self._read, name=f"engine-{self.name}-out", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """On a thread: every message from the child, handed to the loop."""
        conn = self._conn
        while True:
            try:
                message: EngineMessage = conn.recv()
            except (EOFError, OSError):
                break
            match message:
                case EngineOutputs(outputs) if outputs:
                    # Its stats on the loop with the requests it ended taken off (`_deliver`):
                    # `finish_at` counts those not in them yet (`sent_since`).
                    self.loop.call_soon_threadsafe(self._deliver, message)
                case EngineReady(stats):
                    self._stats = stats
                    if stats.engine.packing_done:  # its packed layers in place: the row-major ones unread
                        self._release()
                    self.ready.set()
                case _:
                    self._stats = message.stats
        if not self._stopping:
            self.loop.call_soon_threadsafe(self._lost)

    def _release(self) -> None:
        if self._reload is None or self._released:
            return
        try:
            self._released = release_packed(self.loaded)
        except OSError as exc:  # kept, then: memory, not correctness
            log.warning("%s: cannot give back the packed layers' row-major weights: %s", self.name, exc)
            return
        if self._released:
            log.info("%s: gave back the row-major weights of %d packed layers", self.name, len(self._released))

    def _refill(self) -> None:
        """Before a new engine process starts: write back what :meth:`_release` gave."""
        if self._released and self._reload is not None:
            t0 = time.perf_counter()
            refill(self.loaded, self._reload(), self._released)
            log.info(
                "%s: row-major weights written back for a new engine process in %.2fs",
                self.name,
                time.perf_counter() - t0,
            )
            self._released = []

    def _deliver(self, message: EngineOutputs) -> None:
        with self._lock:
            for rid, at in message.joined.items():
                if (req := self._active.get(rid)) is not None:
                    req.admitted_at = at
            for out in message.outputs:
                if out.finished:
                    self._active.pop(out.request_id, None)
            self._stats = message.stats
        for step in message.steps:
            record_step(self.name, step)
        self.prefix_counts.update(message.stats.engine.prefix)
        self.on_outputs(message.outputs)

    def _lost(self) -> None:
        """The child died: what it held is given back ("lost": the service naks it, to
        be continued from its stored chunks). One that had served is started again at
        once; one that died starting is left for a request to restart later."""
        self._proc.join(timeout=1)
        code, served = self._proc.exitcode, self.ready.is_set()
        log.error(
            "engine process of %s ended (exit code %s); %d requests given back, to go on from their stored chunks",
            self.name,
            code,
            len(self._active),
        )
        self._stats = None
        self.ready.clear()
        if served:
            self._restart()
        else:
            self._dead_since = time.monotonic()
        self._give_back()

    def _give_back(self) -> None:
        with self._lock:
            held, self._active = list(self._active.values()), {}
        self.on_outputs([StepOutput.ended(r, "lost") for r in held])

    def _restart(self) -> None:
        """Start a new child on a thread: forking one takes milliseconds, but if the fork
        server died too (it takes its engine with it), a new one imports torch first,
        seconds the loop must not wait. What comes meanwhile is queued for the new pipe."""
        self._starting = True

        def start() -> None:
            try:
                self._refill()
                self._start()
            except Exception as exc:  # noqa: BLE001 - what waited is given back; a request restarts it later
                log.error("cannot start the engine process of %s: %r", self.name, exc)
                self.loop.call_soon_threadsafe(self._start_failed)
                return
            if self._stopping:  # stopped meanwhile: this one is not wanted
                self._proc.kill()
                return
            self.loop.call_soon_threadsafe(self._started)

        threading.Thread(target=start, name=f"engine-{self.name}-start", daemon=True).start()

    def _started(self) -> None:
        """On the loop: the new child is there; what waited goes down its pipe, in order."""
        queued, self._queued, self._starting = self._queued, [], False
        for message in queued:
            with suppress(OSError):  # it died already: its _lost gives back what it held
                self._conn.send(message)

    def _start_failed(self) -> None:
        self._queued, self._starting = [], False
        self._dead_since = time.monotonic()
        self._give_back()

    def wait_ready(self, timeout: float) -> bool:
        """Ready once the engine process answered (its profile ended)."""
        return self.ready.wait(timeout)

    def available(self) -> bool:
        return True

    @property
    def pid(self) -> int | None:
        """The engine process's pid (a new one after a restart)."""
        return self._proc.pid

    # ---- the runner's interface ----------------------------------------------------

    def add(self, req: GenRequest) -> None:
        """Checked here, as the engine checks it, so a refusal reaches the caller at once."""
        check_prompt(req, self.loaded.context_len)
        if self._dead_since is not None:
            if time.monotonic() - self._dead_since < RESTART_AFTER_S:
                raise RetryableError(f"the engine process of {self.name} failed to start; retrying shortly")
            self._dead_since = None
            self._restart()
        with self._lock:
            if req.request_id in self._active:
                raise PermanentError(f"request {req.request_id} is already in the engine")
            self._active[req.request_id] = req
        if self._starting:
            self._queued.append(AddRequest(req))
            return
        try:
            self._conn.send(AddRequest(req))
        except OSError as exc:  # it died a moment ago, and _lost is on its way: not this request's fault
            with self._lock:
                self._active.pop(req.request_id, None)
            raise RetryableError(f"the engine process of {self.name} ended; retrying shortly") from exc

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._active:
                return
        if self._starting:
            self._queued.append(CancelRequest(request_id))
            return
        with suppress(OSError):  # a dead engine process fails what it held anyway
            self._conn.send(CancelRequest(request_id))

    def finish_at(self, tokens: int) -> float | None:
        """As :meth:`EngineRunner.finish_at`, from the engine's state after its last step
        and the requests sent to it since (`sent_since`)."""
        if (stats := self._stats) is None:
            return None
        with self._lock:
            active = list(self._active.values())
        return estimate_finish(sent_since(stats, active), self.max_batch_size, tokens)

    def load(self) -> EngineLoad:
        """As :meth:`EngineRunner.load`: the engine process's, as of its last step."""
        stats = self._stats
        return EngineLoad(max_batch=self.max_batch_size) if stats is None else stats.load

    def stop(self) -> None:
        self._stopping = True
        with suppress(OSError, ValueError):
            self._conn.send(StopEngine())
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()
