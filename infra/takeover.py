"""Handing a dead worker's messages on at once, instead of after their AckWait.

JetStream gives a message held by a worker to another one only when its AckWait passes
without an ack or an in-progress signal (4 s by default, kept alive while the worker
lives). `arena up` knows the moment a child dies: each inference heartbeat lists the ack
subjects of the messages the process holds (`acks`, with its `pid`), and when the
supervisor sees that process exit it naks them, so a live worker pulls them now.

A nak of a message that was acked in the meantime is ignored by the server; one the dead
process pulled after its last heartbeat still waits out its AckWait.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future

import nats

from events import subjects, topology
from events.fleet import InferenceBeat, decode_beat
from runtime import jetstream

log = logging.getLogger(__name__)

NAK = b"-NAK"


class Takeover:
    """Follows the inference heartbeats on a thread of its own; `release(pid)` naks what
    that process held."""

    def __init__(self, url: str, **options):
        self.url, self.options = url, options
        self.held: dict[int, list[str]] = {}
        self._loop = asyncio.new_event_loop()
        self._nc: nats.NATS | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="takeover", daemon=True)
        self._thread.start()
        self._call(self._start()).result(timeout=15)

    def _call(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> None:
        self._nc = await jetstream.connect(self.url, "arena-supervisor", **self.options)
        subject = subjects.heartbeat_subject(topology.INFERENCE.name, "*")
        await self._nc.subscribe(subject, cb=self._on_beat)

    async def _on_beat(self, msg) -> None:
        try:
            beat = decode_beat(msg.data)
        except ValueError:
            log.warning("unreadable heartbeat on %s", msg.subject)
            return
        if isinstance(beat, InferenceBeat):
            self.held[beat.pid] = list(beat.acks)

    async def _nak(self, acks: list[str]) -> None:
        assert self._nc is not None
        for subject in acks:
            await self._nc.publish(subject, NAK)
        await self._nc.flush(timeout=2)

    def release(self, pid: int) -> int:
        """Nak every message the (dead) process `pid` held at its last heartbeat; how many."""
        acks = self.held.pop(pid, [])
        if acks:
            try:
                self._call(self._nak(acks)).result(timeout=5)
            except Exception:  # NATS away: the messages still move on after their AckWait
                log.exception("could not hand on %d messages of process %d", len(acks), pid)
                return 0
        return len(acks)

    def close(self) -> None:
        if self._nc is not None:
            self._call(self._nc.close()).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
