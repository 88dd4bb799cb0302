"""Tasks started and not awaited (bookkeeping after a response, watchers, peers' news).

The event loop keeps only weak references to tasks: one nobody holds can be collected
before it ends. `Background` holds each until it is done."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any


class Background:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self.tasks))
