"""`runtime.process.Process`: the order every consumer starts and stops in, a start that
fails half way, and SIGTERM (during a slow start too). The parts are recorders here;
tests/integration/test_connections.py and the stack tests run the real ones."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import asynccontextmanager

import pytest

from runtime.process import Process

pytestmark = pytest.mark.timeout(20)


class Runtime:
    """What `Process` uses of a `ProcessRuntime`."""

    role = "toy"

    def __init__(self, said: list[str]):
        self.said, self.ready, self.js = said, False, object()

    async def start(self) -> None:
        self.said.append("connect")

    async def stop(self) -> None:
        self.said.append(f"disconnect (ready={self.ready})")


class Consumer:
    def __init__(self, said: list[str]):
        self.said = said

    async def start(self, js) -> None:
        self.said.append("pull")

    async def stop(self) -> None:
        self.said.append("stop pulling")


def lifespan(said: list[str], fail: bool = False, slow: float = 0.0):
    @asynccontextmanager
    async def span(runtime):
        said.append("warm")
        await asyncio.sleep(slow)
        if fail:
            raise RuntimeError("no model")
        yield
        said.append("drain")

    return span


async def test_starts_in_order_and_stops_in_the_reverse():
    said: list[str] = []
    runtime = Runtime(said)
    process = Process(runtime, Consumer(said), lifespan(said))  # type: ignore[arg-type]
    await process.start()
    assert runtime.ready and said == ["connect", "warm", "pull"]
    await process.stop()
    assert said[3:] == ["stop pulling", "drain", "disconnect (ready=False)"]


async def test_a_start_that_fails_stops_what_had_started():
    said: list[str] = []
    process = Process(Runtime(said), Consumer(said), lifespan(said, fail=True))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no model"):
        await process.run()
    assert said == ["connect", "warm", "disconnect (ready=False)"]  # never pulled, never drained


async def test_sigterm_stops_a_running_process():
    said: list[str] = []
    process = Process(Runtime(said), Consumer(said), lifespan(said))  # type: ignore[arg-type]
    running = asyncio.create_task(process.run())
    while "pull" not in said:
        await asyncio.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(running, 5)
    assert said == ["connect", "warm", "pull", "stop pulling", "drain", "disconnect (ready=False)"]


async def test_sigterm_during_a_slow_start_cuts_it_short():
    said: list[str] = []
    process = Process(Runtime(said), Consumer(said), lifespan(said, slow=30))  # type: ignore[arg-type]
    running = asyncio.create_task(process.run())
    while "warm" not in said:
        await asyncio.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(running, 5)  # not after the 30 s warm-up
    assert said == ["connect", "warm", "disconnect (ready=False)"]
