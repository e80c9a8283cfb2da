"""One LogTK connection: the state machine, its acks, its window, its sender."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from websockets.exceptions import ConnectionClosed

from ...errors import HubStopped
from ...eventtime import TIME_OUT_OF_RANGE, EventTimes
from ...hub.core import Commit, OnCommit
from ...protocols.logtk import (
    Authenticated,
    AuthFailed,
    CloseCode,
    CloseReceived,
    Data,
    Initialized,
    OversizeData,
    ServerConnection,
    Violation,
    time_reader,
)
from ...records import BatchBuilder

if TYPE_CHECKING:
    from .service import LogTKService

__all__ = ["InFlight", "Session"]

log = logging.getLogger("taproom.logtk")


class InFlight:
    """One LogTK batch handed to the hub, until it is committed: what to call then, in order
    (the connection that stored it, then those whose repeats of its entries wait for it). It
    is the batch's ``Hub.submit_callback`` callback: the acks are written in the turn of the
    loop that made the commit, not one (a future's callback) or two (a coroutine awaiting it)
    later (issue 32)."""

    __slots__ = ("_result", "_then")

    def __init__(self) -> None:
        self._then: list[OnCommit] = []
        self._result: tuple[Commit | None, BaseException | None] | None = None

    def then(self, fn: OnCommit) -> None:
        if self._result is not None:  # already resolved: at once
            fn(*self._result)
        else:
            self._then.append(fn)

    def __call__(self, commit: Commit | None, error: BaseException | None) -> None:
        self._result = (commit, error)
        then, self._then = self._then, []
        for fn in then:
            try:
                fn(commit, error)
            except Exception:  # one connection's bug must not cost the others their acks
                log.exception("LogTK: an ack after a commit failed")


class Session:
    """One connection: the state machine, its acks, its window, its sender."""

    def __init__(
        self,
        service: LogTKService,
        conn: ServerConnection,
        send: Callable[[bytes], Awaitable[None]],
        transport: str,
        peer: str,
        direct: asyncio.WriteTransport | None = None,
    ) -> None:
        self.service = service
        self.conn = conn
        self._send = send
        # TCP: acks are written straight to the transport from the commit's callback while
        # the sender is parked and the transport holds nothing unsent (issue 32: waking the
        # sender task cost a turn of the loop per ack). WebSocket frames go through the sender.
        self._direct = direct
        self._parked = False  # the sender waits for its wake, holding nothing
        self.transport = transport
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.inflight: set[InFlight] = set()
        self._settled = asyncio.Event()  # set while nothing is in flight (shutdown waits)
        self._settled.set()
        self._held_slots: list[int] = []
        self._finished = False
        self.done = asyncio.Event()
        self.stream = conn.app or ""
        self._slot = 0
        self._producer = ""
        self._id_prefix = ""
        self._time_of = time_reader("")
        self._times = EventTimes()  # the entries' times by the one rule (taproom.eventtime)
        self._attrs = orjson.dumps({"peer": peer, "transport": transport})

    def handle(self, events: list[Any]) -> None:
        datas: list[Data | OversizeData] = []
        for event in events:
            if type(event) is Data or type(event) is OversizeData:
                datas.append(event)
            elif isinstance(event, Initialized):
                app = self.conn.app or ""
                self._slot = self.service.dedup.acquire(app, event.client_id)
                self._held_slots.append(self._slot)
                self._producer = f"{event.client_id:08x}"
                self._id_prefix = f"{app}:{event.client_id:08x}:"
                self._time_of = time_reader(event.format)
            elif isinstance(event, Violation):
                self.service.hub.metrics.rejected("logtk", event.reason)
                log.info("%s %s: closing: %s", self.transport, self.peer, event.message)
            elif isinstance(event, AuthFailed):
                log.info("%s %s: authentication failed", self.transport, self.peer)
            elif isinstance(event, Authenticated):
                self.stream = event.app
            elif isinstance(event, CloseReceived):
                log.debug("%s %s: peer closed (%s)", self.transport, self.peer, event.code)
        if datas:
            self._ingest(datas)
        if self.conn.unacked >= self.service.config.max_unacked:
            self.room.clear()
        if self.conn.has_output or self.conn.closed:  # data alone answers nothing until acked
            self.wake.set()

    def _ingest(self, datas: list[Data | OversizeData]) -> None:
        svc = self.service
        slot = self._slot
        # One search of the checkpointed keys for the whole read (the live ones are a set).
        dedup = svc.dedup.known([slot | f.idem for f in datas]) if svc.dedup.frozen else svc.dedup
        pending = svc.pending
        builder = BatchBuilder()
        stored: list[int] = []  # keys to store
        batch_idems: list[int] = []  # idems acked with this batch (new ones and in-batch repeats)
        seen_here: set[int] = set()
        at_once: list[int] = []
        waits: dict[InFlight, list[int]] = {}
        prefix = self._id_prefix
        fmt = self.conn.format
        time_of = self._time_of
        times = self._times
        guard = svc.guards[self.transport]
        duplicates = refused = 0
        for frame in datas:
            idem = frame.idem
            key = slot | idem
            if key in seen_here:
                batch_idems.append(idem)
                duplicates += 1
                continue
            first = pending.get(key)
            if first is not None:
                waits.setdefault(first, []).append(idem)
                duplicates += 1
                continue
            if key in dedup:
                at_once.append(idem)
                duplicates += 1
                continue
            try:
                builder.add(
                    "logtk",
                    frame.data,
                    stream=self.stream,
                    producer=self._producer,
                    seq=idem,
                    event_id=f"{prefix}{idem:08x}",
                    ts_ns=time_of(frame.data, times),
                    content_type=fmt,
                    attrs=self._attrs if isinstance(frame, Data) else self._cut(frame),
                )
            except Exception as exc:
                # One entry's unexpected error refuses it alone (taproom.supervise): LogTK has
                # no refusal for one entry, so it is neither stored nor acked; the client keeps
                # it and resends it. The connection and the entries around it go on.
                guard.failed(exc, "data entry")
                refused += 1
                continue
            seen_here.add(key)
            stored.append(key)
            batch_idems.append(idem)
        if duplicates:
            svc.m_duplicates.inc(duplicates)
        if refused:
            self.settle(refused)  # out of the unacked window: the client owns them again
        odd = times.take()
        if odd:
            svc.hub.metrics.odd("logtk", TIME_OUT_OF_RANGE, odd)
        if at_once:
            self.ack(at_once)
        for waited, idems in waits.items():
            self._after(waited, idems, ())
        if stored:
            inflight = InFlight()
            try:
                batch = builder.build()
                svc.hub.submit_callback(batch, inflight)
            except HubStopped:
                self.settle(len(batch_idems))
                self.conn.close(CloseCode.SHUTTING_DOWN, "server shutting down")
                return
            svc.hub.metrics.accepted("logtk", len(stored), len(batch.body))
            for key in stored:
                pending[key] = inflight
            self._after(inflight, batch_idems, stored)

    def _cut(self, frame: OversizeData) -> bytes:
        """An entry over max_data_bytes is stored cut to its first max_data_bytes and acked
        like any other (docs/compat.md): counted, logged with the client id, and marked in the
        record's attrs with its whole size."""
        svc = self.service
        svc.hub.metrics.rejected("logtk", "data_truncated")
        svc.m_truncated_bytes.inc(frame.size - len(frame.data))
        log.warning(
            "%s %s: entry %s%08x (app:client:idem) of %d bytes is over max_data_bytes; "
            "stored its first %d bytes and acked it",
            self.transport,
            self.peer,
            self._id_prefix,
            frame.idem,
            frame.size,
            len(frame.data),
        )
        return orjson.dumps(
            {"peer": self.peer, "transport": self.transport, "truncated_from": str(frame.size)}
        )

    def _after(self, inflight: InFlight, idems: list[int], keys: Any) -> None:
        self.inflight.add(inflight)
        self._settled.clear()

        def done(commit: Commit | None, _error: BaseException | None) -> None:
            self.inflight.discard(inflight)
            if not self.inflight:
                self._settled.set()
            ok = commit is not None
            svc = self.service
            if keys:
                pop = svc.pending.pop
                for key in keys:
                    pop(key, None)
                if commit is not None:
                    svc.dedup.add_many(keys, time.time())
                    # Commits resolve in offset order: everything below is indexed now.
                    svc.dedup.covered_offset = max(svc.dedup.covered_offset, commit.end_offset)
            if ok:
                self.ack(idems)
            else:
                # Not acked: the client resends with the same idem and the hub stores it then.
                self.settle(len(idems))
                if not self.conn.closed:
                    log.warning("%s %s: commit failed; closing", self.transport, self.peer)
                    self.conn.close(CloseCode.INTERNAL_ERROR, "internal error")
                    self.wake.set()
            if self._finished and not self.inflight:
                self._release_slots()  # after add_many: its keys now carry the slot

        inflight.then(done)

    def finish(self) -> None:
        """The connection is over: its slots go back once its last commit has resolved (a
        slot number must not be reused while keys may still be added under it)."""
        self._finished = True
        if not self.inflight:
            self._release_slots()

    def _release_slots(self) -> None:
        while self._held_slots:
            self.service.dedup.release(self._held_slots.pop())

    def ack(self, idems: list[int]) -> None:
        self.conn.ack(idems)
        self.settle(len(idems))
        transport = self._direct
        if (
            transport is not None
            and self._parked
            and not transport.is_closing()
            and not transport.get_write_buffer_size()
        ):
            # the sender holds nothing and waits: what it would write next, in order, now
            # (the write buffer is empty, so there is no backpressure to wait for)
            out = self.conn.data_to_send()
            if out:
                transport.write(out)
            return
        self.wake.set()

    def settle(self, count: int) -> None:
        self.conn.settled(count)
        if self.conn.unacked < self.service.config.max_unacked:
            self.room.set()

    async def sender(self, close_transport: Callable[[], Awaitable[None]]) -> None:
        """Writes what the state machine queued; closes the transport once it is closed."""
        try:
            while True:
                self._parked = True
                try:
                    await self.wake.wait()
                finally:
                    self._parked = False
                self.wake.clear()
                out = self.conn.data_to_send()
                if out:
                    await self._send(out)
                if self.conn.closed:
                    break
        except Exception as exc:  # the peer went away mid-write
            log.debug("%s %s: send failed: %r", self.transport, self.peer, exc)
        finally:
            self.done.set()
            self.room.set()
            with contextlib.suppress(Exception):
                await close_transport()

    async def ticker(self) -> None:
        while not self.conn.closed:
            interval = self.conn.ping_interval_s
            await asyncio.sleep(min(0.5, interval / 2) if interval else 0.5)
            try:
                events = self.conn.tick(self.loop.time())
                if events:
                    self.handle(events)
            except Exception as exc:  # a bug: this connection closes (0xf8), others go on
                self.service.guards[self.transport].failed(exc, "timer tick")
                self.conn.close(CloseCode.INTERNAL_ERROR, "internal error")
            self.wake.set()

    async def ws_keepalive(self, ws: Any, interval: float, timeout: float) -> None:
        """WebSocket pings: an answered one keeps an idle connection open (logtkjs owes no
        LogTK pongs over WebSocket), one unanswered within ``timeout`` closes it."""
        while not self.conn.closed:
            await asyncio.sleep(interval)
            try:
                pong = await ws.ping()
                await asyncio.wait_for(pong, timeout)
            except ConnectionClosed:
                return
            except TimeoutError:
                if not self.conn.closed:
                    self.service.hub.metrics.rejected("logtk", "ws_ping_timeout")
                    log.info("ws %s: no pong in %.1f s; closing", self.peer, timeout)
                    self.conn.close(CloseCode.PING_TIMEOUT, "ping timeout")
                    self.wake.set()
                return
            self.conn.alive(self.loop.time())

    async def wait_room(self) -> None:
        """Backpressure: the hub's capacity and this connection's unacked window."""
        await self.service.hub.wait_capacity()
        while not self.room.is_set():
            await self.room.wait()

    async def shutdown(self, grace: float) -> None:
        if self.inflight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), timeout=grace)
        self.conn.close(CloseCode.SHUTTING_DOWN, "server shutting down")
        self.wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), timeout=grace)
