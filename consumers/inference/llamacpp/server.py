"""One `llama-server` child of the inference worker: started on a free loopback port, its
output kept (the last lines, for the error that says why it stopped), killed with the
worker (PDEATHSIG: a worker killed with -9 leaves no server behind)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from runtime import children
from runtime.children import end
from runtime.net import free_port

log = logging.getLogger(__name__)

#: The last lines of a server's output kept for the error that says why it stopped.
TAIL_LINES = 40


def command(binary: Path, gguf: Path, alias: str, port: int, parallel: int, context: int, threads: int) -> list[str]:
    """llama-server on loopback: one slot per request decoded together, continuous batching,
    ``context`` tokens per slot; no web UI, no prompt cache beyond the slots' own. No weight
    repacking: on this VM's AMX CPU the pinned build's AMX matmul (an extra buffer type that
    repacking enables) segfaults in the warm-up on SmolLM2's Q4_1 (ggml_backend_amx_mul_mat)."""
    return [
        str(binary),
        *("--model", str(gguf), "--alias", alias, "--host", "127.0.0.1", "--port", str(port)),
        *("--threads", str(threads), "--threads-batch", str(threads)),
        *("--parallel", str(parallel), "--cont-batching", "--ctx-size", str(parallel * context)),
        *("--no-webui", "--cache-ram", "0", "--no-repack"),
    ]


#: How many times an OpenMP thread of the server spins at a step's barrier before it
#: sleeps (libgomp's GOMP_SPINCOUNT; its default with no wait policy is 300,000). A step
#: crosses a barrier after each node of its graph; spinning long, the two threads of a
#: 2-core machine collapse beside any other runnable process (docs/inference.md, the
#: llama.cpp backend's threads, has the figures). A GOMP_SPINCOUNT of the user's own
#: environment wins.
SPIN_COUNT = 1000


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment for its server: without the stack's ``OMP_WAIT_POLICY``
    (`arena up` gives torch's threads PASSIVE: each barrier would put the server's
    threads to sleep and wake them again), with a short bounded spin (SPIN_COUNT) unless
    the user's environment sets ``GOMP_SPINCOUNT``."""
    env = {k: v for k, v in environ.items() if k != "OMP_WAIT_POLICY"}
    env.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    return env


class LlamaServer:
    """A `llama-server` process; ``start`` again after it died starts a new one (a new port)."""

    def __init__(self, argv: list[str], name: str):
        self.argv = argv  # every flag but --port (appended per start)
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start it (call from the worker's loop thread: PDEATHSIG follows the starting thread)."""
        self.port = free_port()
        self.tail.clear()
        self.proc = subprocess.Popen(
            [*self.argv, "--port", str(self.port)],
            stdin=subprocess.DEVNULL,
            env=server_env(os.environ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            preexec_fn=children.die_with_parent,  # noqa: PLW1509 - only sets PDEATHSIG (SIGKILL when the worker's loop thread that started it ends)
        )
        threading.Thread(target=self._read, args=(self.proc,), name=f"llama-server-{self.name}", daemon=True).start()
        log.info("llama-server of %s started (pid %d, port %d)", self.name, self.proc.pid, self.port)

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.tail.append(line.rstrip())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def said(self) -> str:
        """Its last lines of output, for an error message."""
        return "\n".join(self.tail)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """Until /health answers 200 (the model loaded); RuntimeError with its output if it
        exits or does not answer in ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not self.alive():
                raise RuntimeError(f"llama-server of {self.name} exited ({self.returncode()}):\n{self.said()}")
            try:
                async with session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"llama-server of {self.name} not ready in {timeout_s:.0f} s:\n{self.said()}")

    async def wait_exit(self) -> int | None:
        """Until it exits (polled: a thread blocked in wait() would outlive a stopped worker)."""
        while self.alive():
            await asyncio.sleep(0.1)
        return self.returncode()

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not ended in ``timeout_s``."""
        if self.proc is not None:
            end(self.proc, timeout_s)
