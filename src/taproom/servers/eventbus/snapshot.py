"""The SNAPSHOT ports: SYNCSTART (the seed) and ICANHAZ? (CHP) answered with the hashmap's
entries and SYNCEND / KTHXBAI; COPY (from the passive peer) with the whole state."""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import AsyncIterator, Sequence
from operator import itemgetter
from typing import NamedTuple

import zmq
import zmq.asyncio

from ... import zmqburst
from ...protocols.eventbus import (
    BStarState,
    Command,
    Event,
    EventBusError,
    kvmsg,
    parse_syncstart,
    parse_timestamp,
    replicate_frames,
    syncend_frames,
)
from ...zmqframes import recv_frames
from .chp import ChpDialect
from .state import FRAMES, KV, PROTOCOL, SEQ
from .wire import MAX_FRAMES, MORE, NOBLOCK, base_send, rearm, send_last

log = logging.getLogger("taproom.eventbus")

SYNC = Command.SYNC.value
# Entry's fields read in C over a whole hashmap (a 100,000-key comprehension on the loop was
# ~15 ms of a CHP snapshot's 66: A/B in the commit)
_SEQ, _FRAMES, _KV = itemgetter(SEQ), itemgetter(FRAMES), itemgetter(KV)  # kv: five, or None
COPY = Command.COPY.value
# Events per REPLICATE message of a COPY (each message also stays under the peer's
# MAXMSGSIZE: see _copy_messages).
COPY_CHUNK = 1000
# Keys a compiled snapshot sends per C call (from the entries' own bytes, read with the GIL
# held: ~2 ms a run): the hub's other tasks and threads run between runs.
SNAPSHOT_RUN = 4096
# Frames of each message of a snapshot after the ROUTER's identity (and the seed's SYNC).
SYNC_FRAMES = 6
KV_FRAMES = 5


class Reply(NamedTuple):
    """One snapshot on its way to one client."""

    sock: zmq.asyncio.Socket  # the SNAPSHOT ROUTER (re-armed after sends)
    raw: zmq.Socket[bytes]  # its synchronous shadow, which sends
    identity: bytes  # the client's routing id
    messages: Sequence[Sequence[bytes]]  # after the identity and head, each
    head: bytes | None  # SYNC before each message (the seed's), or nothing
    end: list[bytes]  # SYNCEND / KTHXBAI, after them all
    per: int = 0  # frames of every message, or 0: they differ (a COPY's REPLICATE chunks)


class SnapshotServer(ChpDialect):
    """Serves snapshots side by side, each to one client."""

    async def _requests(
        self, sock: zmq.asyncio.Socket, raw: zmq.Socket[bytes], where: str
    ) -> AsyncIterator[list[bytes]]:
        """Every request to a SNAPSHOT port (identity frame first), drained without a future
        per message; an over-long one is refused (``frame_count``) before it is kept."""
        while True:
            await sock.poll()
            while True:
                try:
                    msg = recv_frames(raw, MAX_FRAMES)
                except zmq.Again:
                    break
                if msg is None:
                    self._reject("frame_count", f"{where}: message over {MAX_FRAMES} frames")
                    continue
                yield msg

    async def _snapshot_loop(self) -> None:
        """Supervised as ``eventbus.snapshot``; one request's unexpected error refuses it
        (the client's request goes unanswered, as for any refused one) and the loop goes on."""
        raw = self._snapshot_raw
        guard = self.hub.supervisor.guard("eventbus.snapshot", protocol=PROTOCOL, logger=log)
        async for msg in self._requests(self._snapshot, raw, "SNAPSHOT"):
            try:
                await self._snapshot_request(raw, msg)
            except Exception as exc:
                guard.failed(exc, "SNAPSHOT request")

    async def _snapshot_request(self, raw: zmq.Socket[bytes], msg: list[bytes]) -> None:
        """One SYNCSTART (or a peer's COPY): answered by a snapshot task of its own."""
        if msg[1:] == [COPY]:
            if not self.fsm.active:
                self._reject("not_active", "COPY to a server that is not active")
                return
            end = syncend_frames((), self.last_seq)
            await self._start_snapshot(
                Reply(self._snapshot, raw, msg[0], self._copy_messages(), None, end)
            )
            return
        try:
            request = parse_syncstart(msg[1:], self.limits)
        except EventBusError as exc:
            self._reject(exc.reason, f"SNAPSHOT: {exc}")
            return
        if not self._may_serve():
            self._reject("not_active", "SYNCSTART to a server that is not active")
            return
        await self._settle_for_snapshot()
        floor = request.sequence
        prefixes = tuple(s.encode() for s in request.subtrees)
        values = self.hashmap.values()
        if prefixes:
            frames = [
                e[FRAMES] for e in values if e[SEQ] > floor and e[FRAMES][0].startswith(prefixes)
            ]
        elif values and min(map(_SEQ, values)) > floor:  # every key (a new client's sync)
            frames = list(map(_FRAMES, values))  # no Python per entry
        else:
            frames = [e[FRAMES] for e in values if e[SEQ] > floor]
        end = syncend_frames(request.subtrees, self.last_seq)
        await self._start_snapshot(
            Reply(self._snapshot, raw, msg[0], frames, SYNC, end, SYNC_FRAMES)
        )

    async def _chp_snapshot_loop(self) -> None:
        """Supervised as ``eventbus.chp_snapshot``, as :meth:`_snapshot_loop`."""
        raw = self._chp_snapshot_raw
        guard = self.hub.supervisor.guard("eventbus.chp_snapshot", protocol=PROTOCOL, logger=log)
        async for msg in self._requests(self._chp_snapshot, raw, "CHP SNAPSHOT"):
            try:
                await self._chp_snapshot_request(raw, msg)
            except Exception as exc:
                guard.failed(exc, "ICANHAZ? request")

    async def _chp_snapshot_request(self, raw: zmq.Socket[bytes], msg: list[bytes]) -> None:
        """One ``ICANHAZ?``: the kvmsg entries under its subtree, then ``KTHXBAI``."""
        try:
            subtree = kvmsg.parse_icanhaz(msg[1:], self.limits)
        except EventBusError as exc:
            self._reject(exc.reason, f"CHP SNAPSHOT: {exc}")
            return
        if not self._may_serve():
            self._reject("not_active", "ICANHAZ? to a server that is not active")
            return
        await self._settle_for_snapshot()
        values = self.hashmap.values()
        if subtree:
            entries = [e[KV] for e in values if e[KV] is not None and e[KV][0].startswith(subtree)]
        else:  # the whole map (the Guide's clients ask for it): no Python per entry
            entries = list(filter(None, map(_KV, values)))
        end = kvmsg.kthxbai_frames(self.last_seq, subtree)
        await self._start_snapshot(
            Reply(self._chp_snapshot, raw, msg[0], entries, None, end, KV_FRAMES)
        )

    def _copy_messages(self) -> list[list[bytes]]:
        """The whole state as REPLICATE messages, in sequence order, for the passive peer."""
        events = []
        for e in sorted(self.hashmap.values(), key=_SEQ):
            seq, frames, chp, expires_ms, _kv = e
            topic, _seq, producer, timestamp, uuid, data = frames
            try:
                ts_ns = parse_timestamp(timestamp.decode())
            except EventBusError:
                ts_ns = 0
            events.append(
                Event(
                    topic.decode(),
                    seq,
                    producer.decode(),
                    timestamp.decode(),
                    uuid.decode(),
                    data,
                    ts_ns,
                    chp,
                    expires_ms,
                )
            )
        budget = self._max_frame - 65536
        messages: list[list[bytes]] = []
        chunk: list[Event] = []
        size = 0
        for event in events:
            cost = 128 + len(event.data) + (len(event.chp[1]) if event.chp is not None else 0)
            if chunk and (size + cost > budget or len(chunk) == COPY_CHUNK):
                messages.append(replicate_frames(chunk))
                chunk, size = [], 0
            chunk.append(event)
            size += cost
        if chunk:
            messages.append(replicate_frames(chunk))
        return messages

    async def _start_snapshot(self, reply: Reply) -> None:
        """Send a snapshot in a task of its own. Snapshots run side by side so one slow client
        holds up only itself; each message is sent whole between awaits, so they never
        interleave on the socket. The list is taken in one step with the cut (``end``), so a
        snapshot is consistent with the broadcasts around it."""
        await self._snapshot_slots.acquire()
        task = asyncio.create_task(self._serve_snapshot(reply))
        self._snapshot_tasks.add(task)
        task.add_done_callback(self._snapshot_tasks.discard)

    async def _serve_snapshot(self, reply: Reply) -> None:
        try:
            await self._send_snapshot(reply)
        except zmq.ZMQError as exc:  # the client went away (EHOSTUNREACH) mid-snapshot
            log.info("eventbus: snapshot abandoned: %s", exc)
        finally:
            self._snapshot_slots.release()
            rearm(reply.sock)

    async def _settle_for_snapshot(self) -> None:
        """A snapshot holds every update accepted before its request, as the Guide's Clone
        server's does (its updates are in its hashmap at once; here once committed): the held
        updates a takeover has just applied, and a client's own last updates. Without this, a
        client whose SUB joins late missed them for good: the snapshot lacked them and their
        broadcast went out before its subscription arrived."""
        if not await self._settle(self.config.snapshot_settle_ms / 1000):
            log.warning("eventbus: snapshot served before the journal committed earlier updates")

    def _may_serve(self) -> bool:
        if self.fsm.state is BStarState.PASSIVE and not self.synced:
            return False  # never become active with state the peer had not confirmed
        if not self.fsm.active and self.config.role != "standalone":
            self._read_peer_hugz()  # is the peer really silent, or only unread?
        before = self.fsm.state
        allowed = self.fsm.on_client_request(time.monotonic())
        if self.fsm.state is not before:
            self._transition(before)
        return allowed

    async def _send_snapshot(self, reply: Reply) -> None:
        """Pre-built frames, no per-key encoding: messages of ``per`` frames each (a SYNC's
        event, a kvmsg) go out a run of keys per C call on the compiled path, any other (a
        COPY's REPLICATE chunks), and all on the pure-Python twin, a few ``send`` calls each.
        The ROUTER has ROUTER_MANDATORY and a high-water mark: a slow client makes this wait
        (up to ``snapshot_timeout_ms``), never silently cuts its snapshot."""
        deadline = time.monotonic() + self.config.snapshot_timeout_ms / 1000
        if reply.per and zmqburst.ffi_lib()[1] is not None:
            sent = await self._send_runs(reply, deadline)
        else:
            sent = await self._send_each(reply, deadline)
        if not sent:
            log.warning("eventbus: snapshot to a slow client abandoned")
            return
        while True:
            try:
                reply.raw.send_multipart([reply.identity, *reply.end], zmq.NOBLOCK)
                break
            except zmq.Again:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.001)
        self._m_snapshots.inc()

    async def _send_runs(self, reply: Reply, deadline: float) -> bool:
        """The compiled path: :data:`SNAPSHOT_RUN` keys sent in one C call from the entries'
        own tuples (``eb_snap_send``: ~8 libzmq sends a key with no Python between them). False
        when the client stayed full past ``deadline``; a ZMQError when it went away."""
        sock, raw, identity, messages, head, _end, per = reply
        for run in zmqburst.uniform_run(messages, per, SNAPSHOT_RUN):
            while True:
                error = zmqburst.send_routed(raw, identity, head, run)
                if not error:
                    break
                if error != errno.EAGAIN:
                    raise zmq.ZMQError(error)
                if time.monotonic() > deadline:
                    return False
                rearm(sock)
                await asyncio.sleep(0.001)
            rearm(sock)
            await asyncio.sleep(0)  # let the collector and broadcaster run
        return True

    async def _send_each(self, reply: Reply, deadline: float) -> bool:
        """The pure-Python twin of :meth:`_send_runs`, and a COPY's REPLICATE chunks."""
        sock, raw, identity, messages, head = reply[:5]
        more = MORE
        first = MORE | NOBLOCK
        send = base_send
        for sent, frames in enumerate(messages, 1):
            while True:
                try:
                    send(raw, identity, first)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        return False
                    rearm(sock)
                    await asyncio.sleep(0.001)
            if head is not None:  # SYNC: its six frames unrolled, the common snapshot
                send(raw, head, more)
                send(raw, frames[0], more)
                send(raw, frames[1], more)
                send(raw, frames[2], more)
                send(raw, frames[3], more)
                send(raw, frames[4], more)
                send_last(raw, frames[5])
            else:  # a kvmsg (CHP) or a REPLICATE chunk (COPY)
                for frame in frames[:-1]:
                    send(raw, frame, more)
                send_last(raw, frames[-1])
            if sent % SNAPSHOT_RUN == 0:
                rearm(sock)
                await asyncio.sleep(0)  # let the collector and broadcaster run
        return True
