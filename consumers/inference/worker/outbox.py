"""The worker's outbox: chunks sent as the engine makes them (live on core NATS, and to
the stream without waiting for each acknowledgement), and each job's end settled beside
the others: its chunk acks collected (a chunk the stream did not confirm is published
again), its terminal event stored, then its message acked; or, its engine lost, the
message given back once its chunks are stored.

Every publish carries a dedupe key, so publishing a chunk or a terminal event again (a
lost ack, a worker that regenerates a request after another crashed) cannot duplicate it
in the stream.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress

from consumers.inference.metrics import METRICS
from consumers.inference.worker.jobs import Chunk, Ended, GiveBack, Job, OutboxItem
from events import encode, subjects
from events.models import Terminal, TokensGenerated
from runtime import tracing
from runtime.jetstream import NATS_DOWN, PUBLISH_TIMEOUT_S, ReplyLost

log = logging.getLogger(__name__)

Publish = Callable[..., Awaitable[None]]


class Outbox:
    """``publish``: async (event, raw=None) -> None once stored, with dedupe keys.
    ``publish_nowait``: the same, returning the acknowledgement to await later (default:
    ``publish`` in a task). ``live``: async (subject, raw) -> None on core NATS for the
    request's live subject (None: output reaches gateways through delivery only).
    ``release(job)``: called once a job is settled, whichever way."""

    def __init__(
        self,
        publish: Publish,
        release: Callable[[Job], Awaitable[None]],
        publish_nowait: Callable[..., Awaitable[Awaitable]] | None = None,
        live: Callable[[str, bytes], Awaitable[None]] | None = None,
    ) -> None:
        self.publish = publish
        self.publish_nowait = publish_nowait or self._publish_in_task
        self.live = live
        self.release = release
        self.queue: asyncio.Queue[OutboxItem] = asyncio.Queue()
        self._endings: set[asyncio.Task] = set()  # jobs being settled (`_ending`)

    def put(self, item: OutboxItem) -> None:
        self.queue.put_nowait(item)

    async def join(self) -> None:
        """Until everything queued is sent and every job queued to end is settled."""
        await self.queue.join()

    async def stop(self) -> None:
        for task in list(self._endings):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        """Send chunks as they come (live, and to the stream without waiting for acks), in
        the order the engine made them; settle each job beside the others (`_ending`).

        Settling waits for the job's chunk acks. It ran in this loop once: after a NATS
        restart every job waited out its lost acks (PUBLISH_TIMEOUT_S) in turn, and the
        chunks of every other job waited behind it (one answer every 1.5 s)."""
        while True:
            item = await self.queue.get()
            if not isinstance(item, Chunk):  # the job's chunks are all sent: nothing of it follows
                self._endings.add(task := asyncio.create_task(self._ending(item)))
                task.add_done_callback(self._endings.discard)
                continue
            try:
                with tracing.within(item.job.span):  # the events carry the request's trace
                    await self._send_chunk(item.job, item.event)
            except Exception:
                log.exception("publish failed", extra={"request_id": item.job.event.request_id})
            finally:
                self.queue.task_done()

    async def _ending(self, item: Ended | GiveBack) -> None:
        """A job's end: its message given back, or its terminal event stored and the
        message acked (or termed, reaped). Done for `join()` once settled."""
        job = item.job
        try:
            with tracing.within(job.span):
                match item:
                    case GiveBack():
                        await self._give_back(job)
                    case Ended(terminal=terminal, reaped=reaped):
                        await self._settle(job, terminal, term=reaped)
        except Exception:
            log.exception("publish failed", extra={"request_id": job.event.request_id})
        finally:
            self.queue.task_done()

    async def _send_chunk(self, job: Job, event: TokensGenerated) -> None:
        raw = encode(event)
        if self.live is not None:
            with suppress(Exception):  # the stream has it; a gateway that missed it reads it there
                await self.live(subjects.live_subject(event.request_id), raw)
        try:
            ack = asyncio.ensure_future(await self.publish_nowait(event, raw))
        except NATS_DOWN:
            log.warning("chunk not sent; retried before the terminal event", extra={"request_id": event.request_id})
            job.unconfirmed[event.seq] = (event, None)
            return
        job.unconfirmed[event.seq] = (event, ack)
        ack.add_done_callback(functools.partial(self._chunk_acked, job, event))

    def _chunk_acked(self, job: Job, event: TokensGenerated, ack: asyncio.Future) -> None:
        """A chunk whose ack was lost with the connection (NATS restarted under it) is sent
        again at once, live and to the stream (buffered until the connection is back): it
        may never have reached either, and a gateway holds every later chunk behind it.
        Once the job's end is queued, `_confirm_chunks` publishes it instead."""
        if ack.cancelled() or not isinstance(ack.exception(), ReplyLost) or job.closed:
            return
        METRICS.chunks_resent.inc()
        self.put(Chunk(job, event))

    async def _confirm_chunks(self, job: Job) -> None:
        """Every chunk of the job stored in the stream: collect the acks, publish again
        (dedupe keys make that safe) whatever the stream did not confirm."""
        pending = list(job.unconfirmed.values())
        job.unconfirmed = {}
        acks = [ack for _, ack in pending if ack is not None]
        if acks:  # all at once: a stream leader lost mid-answer costs one timeout, not one per chunk
            await asyncio.wait(acks, timeout=PUBLISH_TIMEOUT_S)
        for event, ack in pending:
            if ack is not None:
                if ack.done() and not ack.cancelled() and ack.exception() is None:
                    continue
                ack.cancel()
            await self.publish_retrying(event)

    async def _publish_in_task(self, event, raw: bytes | None = None) -> Awaitable:
        return asyncio.ensure_future(self.publish(event))

    async def _settle(self, job: Job, terminal: Terminal, term: bool) -> None:
        """Publish the terminal event, ack (or term) the message and release the job.

        If the job's events cannot be published the message is given back instead, so
        the request is computed again (the dedupe keys make that safe); it is never acked
        without its chunks and terminal event in the stream.
        """
        try:
            await self._confirm_chunks(job)
            raw = encode(terminal)
            await self.publish_retrying(terminal, raw=raw)
            if self.live is not None:
                with suppress(Exception):  # delivery fans the stored terminal out as well
                    await self.live(subjects.live_subject(terminal.request_id), raw)
        except Exception:
            log.exception("terminal event not published; message given back", extra={"request_id": terminal.request_id})
            with suppress(Exception):
                await job.msg.nak(delay=1.0)
        else:
            await (job.msg.term() if term else job.msg.ack())
        finally:
            await self.release(job)

    async def _give_back(self, job: Job) -> None:
        """Its engine died under it: its chunks stored, the message is given back (nak),
        so a worker (this one's next engine process, or another) continues it from them,
        as it continues a dead worker's. Tokens past the last chunk are made again."""
        try:
            await self._confirm_chunks(job)
            await job.msg.nak()
            log.warning("engine lost; given back after %d chunks", job.seq, extra=job.ids)
        except Exception:  # its AckWait gives it back all the same
            log.exception("could not give the request back", extra=job.ids)
        finally:
            await self.release(job)

    async def publish_retrying(self, event, attempts: int = 6, raw: bytes | None = None) -> None:
        for i in range(attempts):
            try:
                await self.publish(event, raw) if raw is not None else await self.publish(event)
                return
            except Exception:
                if i == attempts - 1:
                    raise
                await asyncio.sleep(0.2 * (i + 1))
