"""Logjam ingest: the ROUTER (DEALER agents) and PULL (PUSH agents) read loops.

Both sockets are taproom's own ZeroMQ transport (:mod:`taproom.servers.zmtp`: what an agent
can make the hub hold is bounded and reserved from the budget). Each loop takes a burst,
validates it with :class:`~taproom.protocols.logjam.IngestParser`, builds one batch and hands
it to the hub. An empty frame after the ROUTER's routing id asks for a reply: ``202
Accepted`` only after the commit, ``400 Bad Request`` at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ... import zmqburst
from ...errors import HubStopped, ProtocolError
from ...eventtime import TIME_OUT_OF_RANGE
from ...hub import Commit, Hub
from ...metrics import Metrics
from ...protocols import logjam as lj
from ...protocols.zmtp import encode_message
from ..zmtp import ZmtpSocket
from .config import LogjamConfig
from .zmqio import MAX_FRAMES

__all__ = ["Ingest", "RejectLog"]

log = logging.getLogger("taproom.logjam")

_LOG_PER_SECOND = 20

Pusher = Callable[[bytes, bytes, bytes, bytes], lj.Pushed]


class RejectLog:
    """Counts every rejected logjam message by reason and logs at most ``_LOG_PER_SECOND``
    of them a second, so a broken agent sending thousands of bad messages cannot flood it."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._log_window = 0.0
        self._log_count = self._log_suppressed = 0

    def __call__(self, reason: str, detail: str) -> None:
        self.metrics.rejected("logjam", reason)
        now = time.monotonic()
        if now - self._log_window >= 1.0:
            if self._log_suppressed:
                log.info("logjam: %d more rejected messages not logged", self._log_suppressed)
            self._log_window, self._log_count, self._log_suppressed = now, 0, 0
        if self._log_count < _LOG_PER_SECOND:
            self._log_count += 1
            log.info("logjam: rejected message (%s): %s", reason, detail)
        else:
            self._log_suppressed += 1


class Ingest:
    """The two ingest loops and the 202s they owe; ``unacked`` counts uncommitted bursts.

    A burst ends when the socket has nothing queued, after ``burst_messages`` messages, or once
    its records reach ``burst_bytes`` (bodies are counted decompressed, so a burst of small
    compressed bodies cannot inflate without bound). Before each burst the loop waits for hub
    capacity: while the hub is full nothing is taken, the agents' connections fill their
    buffers and stop being read, and TCP pushes back on the agents.
    """

    def __init__(self, hub: Hub, config: LogjamConfig, hostname: bytes, reject: RejectLog) -> None:
        self.hub = hub
        self.config = config
        self.hostname = hostname
        self._reject = reject
        # Bursts handed to the hub and not yet committed (or refused); ``settled`` is set
        # whenever there are none: stop() waits on it so the last 202s go out.
        self.unacked = 0
        self.settled = asyncio.Event()
        self.settled.set()
        # "app-env" "202 Accepted", encoded once per app-env (agents keep to one or a few)
        self._accepted: dict[bytes, bytes] = {}
        m = hub.metrics
        self._m_pings = m.counter(
            "logjam", "pings", "messages", "Pings received (answered when the agent asked)"
        )
        self._m_not_json = m.counter(
            "ingest",
            "odd",
            "events",
            "Events accepted and stored with a caveat, by reason",
            ("protocol", "reason"),
        ).labels(protocol="logjam", reason="not_json")
        # One message's unexpected error refuses it alone (taproom.supervise).
        self._router_guard = hub.supervisor.guard("logjam.router", protocol="logjam", logger=log)
        self._pull_guard = hub.supervisor.guard("logjam.pull", protocol="logjam", logger=log)

    def _parser(self) -> lj.IngestParser:
        cfg = self.config
        return lj.IngestParser(
            max_body=cfg.max_message_bytes,
            max_decompressed=cfg.max_decompressed_bytes,
            grammar=cfg.grammar,
        )

    def _submit(
        self, parser: lj.IngestParser, not_json_before: int, sock: ZmtpSocket, acks: Acks
    ) -> bool:
        """One burst's records to the hub as one batch, its 202s (``acks``) sent straight from
        the commit's delivery (no future, no scheduled callback: issue 32); False if the hub
        is stopping."""
        batch = parser.take_batch()
        try:
            self.hub.submit_callback(batch, functools.partial(self._committed, sock, acks))
        except HubStopped:
            return False
        self.unacked += 1
        self.settled.clear()
        self.hub.metrics.accepted("logjam", batch.count, len(batch.body))
        if parser.not_json != not_json_before:
            self._m_not_json.inc(parser.not_json - not_json_before)
        out_of_range = parser.times.take()
        if out_of_range:
            self.hub.metrics.odd("logjam", TIME_OUT_OF_RANGE, out_of_range)
        return True

    async def pull_loop(self, sock: ZmtpSocket) -> None:
        """PUSH agents: no replies. Four frames make a message; three frames are an old
        agent's message without meta, stored as logjam-device stores it; any other shape is
        read whole and refused."""
        await self._loop(sock, router=False)

    async def router_loop(self, sock: ZmtpSocket) -> None:
        """DEALER agents: an empty frame after the routing id asks for a reply, ``202
        Accepted`` once the burst is durable (``400 Bad Request`` at once)."""
        await self._loop(sock, router=True)

    async def _loop(self, sock: ZmtpSocket, *, router: bool) -> None:
        """Read a burst (taproom.zmqburst: compiled or pure Python), make its records, hand
        them to the hub as one batch. A burst whose bodies reach ``burst_bytes`` before its
        end is finished in the next batch, after the hub has room again.

        While this task waits for the socket, a burst that becomes ready in a connection's
        read callback is served there (:meth:`_Reading.direct`, ``wait_readable(direct=)``):
        no task wake-up before the work, and a lone request's commit and 202 in that same
        callback (issue 32)."""
        hub = self.hub
        reading = _Reading(self, sock, router)
        direct = reading.direct
        while True:
            await hub.wait_capacity()
            if reading.needs_burst():
                await sock.wait_readable(direct=direct)
                if reading.stopped:
                    return
                if not reading.needs_burst() or not sock.readable:
                    continue  # served in the read callback meanwhile
                reading.recv()
            await reading.inflate.reserve(reading.inflate_need)
            if not reading.step():
                return
            # 202s go out only once the batch is durable; reading the next burst overlaps with
            # this commit's fsync (hub.wait_capacity bounds what is in flight).
            if not reading.needs_burst() or sock.readable:
                # The next wait above will not suspend (agents keep the socket full, or this
                # burst has more): yield once so commits resolve, 202s and the PUB output go
                # out, /metrics answers. Otherwise waiting for the socket yields anyway, and
                # an extra turn of the loop per request is what one request in flight pays.
                await asyncio.sleep(0)
            else:
                # Nothing more to read: this batch's commit needs no turn of its own when
                # nothing else is ready to run (Hub.commit_now; issue 32).
                hub.commit_now()

    def _pull_message(
        self, sock: ZmtpSocket, push: Pusher, count: int, frames: list[bytes], _acks: Acks
    ) -> bool:
        """One PULL message (``count`` frames, at most MAX_FRAMES of them kept). True: the
        burst has reached its byte budget."""
        if count == 4 or count == 3:
            # logjam-device's read_zmq_message_and_forward takes 3 or 4 frames: three are an
            # old agent's message without meta
            meta = frames[3] if count == 4 else lj.EMPTY_META
            try:
                pushed = push(frames[0], frames[1], frames[2], meta)
            except ProtocolError as exc:
                self._refuse(sock, exc.reason, str(exc), None, ())
                return False
            except Exception as exc:  # a bug must not stop ingest (taproom.supervise)
                self._pull_guard.failed(exc, "PULL message")
                return False
            if pushed is None:
                return False
            if pushed is lj.BURST_FULL:
                return True
            self._m_pings.inc()
            return False
        self._refuse(sock, "bad_frame_count", f"{count} frames, expected 4", None, ())
        return False

    def _router_message(
        self, sock: ZmtpSocket, push: Pusher, count: int, frames: list[bytes], acks: Acks
    ) -> bool:
        """One ROUTER message: the routing id, then ``[""] app-env topic body meta``: store it
        and queue its 202, answer a ping, or refuse it (a 400 at once when it asked for a
        reply). True: the burst has reached its byte budget."""
        routing_id = frames[0]
        content = frames[1:]
        # logjam-device replies when the frame after the routing id is empty
        wants_reply = bool(content) and content[0] == b""
        if wants_reply:
            del content[0]
        reply_to = routing_id if wants_reply else None
        try:
            if count > MAX_FRAMES:  # frames past the bound were read and dropped
                raise lj.LogjamError("too many frames", reason="bad_frame_count")
            if len(content) != 4:
                raise lj.LogjamError(f"{len(content)} frames, expected 4", reason="bad_frame_count")
            pushed = push(content[0], content[1], content[2], content[3])
        except ProtocolError as exc:
            self._refuse(sock, exc.reason, str(exc), reply_to, content)
            return False
        except Exception as exc:  # a bug must not stop ingest; nothing of this one is stored
            self._router_guard.failed(exc, "ROUTER message")  # counted and logged there
            self._refuse(sock, "", "", reply_to, content)  # 400, as for any refusal
            return False
        if isinstance(pushed, lj.PingMessage):
            self._answer_ping(sock, reply_to)
            return False
        if wants_reply:
            acks.append((routing_id, content[0]))
        return pushed is lj.BURST_FULL

    def _answer_ping(self, sock: ZmtpSocket, reply_to: bytes | None) -> None:
        """``ping`` ``200 OK`` host, as logjam-device answers a ping whose meta decodes."""
        self._m_pings.inc()
        if reply_to is not None:
            sock.send(lj.reply_frames(reply_to, (lj.PING,), lj.PING_OK, self.hostname))

    def _refuse(
        self,
        sock: ZmtpSocket,
        reason: str,
        detail: str,
        reply_to: bytes | None,
        content: Sequence[bytes],
    ) -> None:
        """Count and log a bad message (``reason`` "": already counted); DEALERs that asked
        get ``400 Bad Request``."""
        if reason:
            self._reject(reason, detail)
        if reply_to is not None:
            sock.send(lj.reply_frames(reply_to, content, lj.BAD_REQUEST))

    def _committed(
        self, sock: ZmtpSocket, acks: Acks, commit: Commit | None, _error: BaseException | None
    ) -> None:
        self.unacked -= 1
        if not self.unacked:
            self.settled.set()
        if commit is None or not acks:
            return  # not durable: no 202; the agent times out and may resend
        # as logjam-device: routing id, the agent's app-env, the status; a reply to an agent
        # that went away is dropped (and counted), as a ROUTER drops it
        replies: list[tuple[bytes, bytes]] = []
        accepted = self._accepted_reply
        for ack in acks:
            if isinstance(ack, _AckRun):
                ack.add_to(replies, accepted)  # a run of 202s the compiled path prepared
            else:
                replies.append((ack[0], accepted(ack[1])))
        sock.send_encoded_many(replies)

    def _accepted_reply(self, app_env: bytes) -> bytes:
        """``app-env`` ``202 Accepted`` as ZMTP frames, made once per app-env."""
        reply = self._accepted.get(app_env)
        if reply is None:
            if len(self._accepted) >= 4096:  # many app-envs: stay bounded
                self._accepted.clear()
            reply = self._accepted[app_env] = encode_message((app_env, lj.ACCEPTED))
        return reply


class _Reading:
    """One ingest loop's state between bursts: the parser, the burst being taken and where,
    shared by the loop's task and the read callback that serves a burst directly."""

    def __init__(self, ingest: Ingest, sock: ZmtpSocket, router: bool) -> None:
        self.ingest = ingest
        self.hub = ingest.hub
        self.sock = sock
        cfg = ingest.config
        self.parser = parser = ingest._parser()
        one = functools.partial(
            ingest._router_message if router else ingest._pull_message, sock, parser.pusher()
        )
        self.take = _compiled_take(parser, sock, router, one) or _python_take(one)
        self.reader = sock.reader(MAX_FRAMES)
        self.burst_messages, self.burst_bytes = cfg.burst_messages, cfg.burst_bytes
        # What one burst may inflate (its records, and the body being inflated) comes from
        # the process budget's inflate holder, shared with Lumberjack: reserved before the
        # burst is decoded, given back once its batch is handed to the hub.
        self.inflate = self.hub.budget.holder("inflate")
        self.inflate_need = min(self.burst_bytes + cfg.max_decompressed_bytes, self.inflate.bound)
        self.burst: zmqburst.Burst | None = None
        self.start = 0
        self.stopped = False  # the hub refused a batch: it is stopping

    def needs_burst(self) -> bool:
        return self.burst is None or self.start >= self.burst.n

    def recv(self) -> None:
        self.burst, self.start = self.reader.recv(self.burst_messages, self.burst_bytes), 0

    def step(self) -> bool:
        """Take what the burst's byte budget allows into one batch and submit it, with the
        inflate room already reserved (given back here); False if the hub is stopping."""
        parser, burst = self.parser, self.burst
        assert burst is not None
        try:
            parser.start_batch(time.time_ns(), self.burst_bytes)
            not_json = parser.not_json
            acks: Acks = []
            self.start = self.take(burst, self.start, acks)
        finally:
            self.inflate.release(self.inflate_need)
        if parser.pending() and not self.ingest._submit(parser, not_json, self.sock, acks):
            self.stopped = True
            return False
        return True

    def direct(self) -> bool:
        """Served in the read callback (the task parked on the socket): a whole burst taken and
        submitted. False leaves the rest to the task: no room in the hub or the inflate
        budget, a burst past its byte budget, more ready to read, or the hub stopping."""
        hub = self.hub
        if not hub.has_capacity or not self.needs_burst():
            return False
        if not self.inflate.try_reserve(self.inflate_need):
            return False
        try:
            self.recv()
        except BaseException:
            self.inflate.release(self.inflate_need)
            raise
        # True: the socket commits what was submitted now (Hub.commit_now)
        return self.step() and self.needs_burst() and not self.sock.readable


# One message, handled in Python: (count, kept frames, acks) -> the burst is full.
OneMessage = Callable[[int, list[bytes], "Acks"], bool]
# Take messages start.. of a burst into the parser's batch; returns the first one not taken.
Take = Callable[[zmqburst.Burst, int, "Acks"], int]


class _AckRun:
    """202s the compiled path wrote for a run of messages (routing id, app-env, status each):
    sent after the commit."""

    __slots__ = ("_at", "_buffers", "_ffi", "_n")

    def __init__(self, ffi: Any, buffers: Any, at: tuple[int, int, int], n: int):
        self._ffi, self._buffers, self._at, self._n = ffi, buffers, at, n

    def add_to(
        self, replies: list[tuple[bytes, bytes]], accepted: Callable[[bytes], bytes]
    ) -> None:
        """(routing id, encoded reply) of each 202 of the run, appended to ``replies``."""
        data, ends, _counts = self._buffers
        at_bytes, at_frames, _ = self._at
        # the frame ends lj_build wrote count from the start of this run's bytes
        edges = [0, *self._ffi.unpack(ends + at_frames, 3 * self._n)]
        raw = self._ffi.buffer(data + at_bytes, edges[-1])[:]
        replies += [
            (raw[edges[i] : edges[i + 1]], accepted(raw[edges[i + 1] : edges[i + 2]]))
            for i in range(0, len(edges) - 1, 3)
        ]


Acks = list[tuple[bytes, bytes] | _AckRun]


def _python_take(one: OneMessage) -> Take:
    def take(burst: zmqburst.Burst, start: int, acks: Acks) -> int:
        counts = burst.counts()
        frames = burst.frames
        for i in range(start, burst.n):
            if one(counts[i], frames(i), acks):
                return i + 1
        return burst.n

    return take


def _compiled_take(
    parser: lj.IngestParser, sock: ZmtpSocket, router: bool, one: OneMessage
) -> Take | None:
    """The compiled path's take: runs of messages in the usual shape become records (and
    202s) in C (``lj_build`` in zmqburst/burst.c, byte-identical to ``IngestParser.push``);
    every other message goes to ``one``, the pure-Python path's own code."""
    ffi, lib = zmqburst.ffi_lib()
    if lib is None:
        return None
    state = ffi.gc(
        lib.lj_ingest_new(
            int(router),
            int(parser.grammar == "device"),
            parser.max_body,
            parser.max_decompressed,
            lj.IngestParser._CACHE,
            lj.META_TAG,
            lj.META_VERSION,
            lj.MAX_CREATED_MS,
        ),
        lib.lj_ingest_free,
    )
    learn = lib.lj_ingest_learn
    learns = parser.grammar != "device"  # "device" is checked in C itself (lj_build)
    build = lib.lj_build
    built = ffi.new("lj_built *")
    budget = ffi.new("int64_t *")
    unpack = ffi.buffer
    out: Any = None
    out_cap = 0
    known = [0, 0]  # app-envs, topics the C side has learned from the parser
    resume: tuple[Any, int] = (None, 0)  # (burst, its next message's first frame)

    def take(burst: Any, start: int, acks: Acks) -> int:
        nonlocal out, out_cap, resume
        n = burst.n
        # a record is its message's bytes plus at most 66: the head, "logjamjson", producer
        need = burst.size + 66 * n
        if need > out_cap:
            out, out_cap = zmqburst.buffer("char[]", need), need
        if router:
            ack_cap = burst.size + 12 * n
            ack_buffers = (
                zmqburst.buffer("char[]", ack_cap),
                zmqburst.buffer("size_t[]", 3 * n),
                zmqburst.buffer("int[]", n),
            )
            ack_at = [0, 0, 0]
        else:
            ack_cap, ack_buffers, ack_at = 0, (ffi.NULL, ffi.NULL, ffi.NULL), [0, 0, 0]
        frame = resume[1] if start and resume[0] is burst else 0
        counts: list[int] | None = None
        # records of this take, one run per call: the batch reads them (uncopied) at its end
        used = 0
        while start < n:
            budget[0] = parser.budget
            build(
                state,
                burst.buf,
                burst.frame_end,
                burst.counts_c,
                MAX_FRAMES,
                start,
                frame,
                n,
                parser.received_ns,
                budget,
                out + used,
                out_cap - used,
                ack_buffers[0] + ack_at[0],
                ack_cap - ack_at[0],
                ack_buffers[1] + ack_at[1],
                3 * n - ack_at[1],
                ack_buffers[2] + ack_at[2],
                built,
            )
            parser.budget = budget[0]
            parser.times.out_of_range += built.time_out_of_range
            if built.records:
                # uncopied: take_batch joins it into the batch before the next take
                parser.add_records(memoryview(unpack(out + used, built.out_bytes)), built.records)
                used += built.out_bytes
            if built.acks:
                acks.append(
                    _AckRun(ffi, ack_buffers, (ack_at[0], ack_at[1], ack_at[2]), built.acks)
                )
                ack_at[0] += built.ack_bytes
                ack_at[1] += built.ack_frames
                ack_at[2] += built.acks
            start, frame = built.next, built.next_frame
            if built.budget_full:
                break
            if not built.slow:
                continue
            if counts is None:
                counts = burst.counts()
            count = counts[start]
            full = one(count, burst.frames(start), acks)
            if learns:  # grammar "seed": C takes only what Python has accepted
                app_envs, topics = parser.validated(known[0], known[1])
                for app_env in app_envs:
                    learn(state, 0, app_env, len(app_env))
                for topic in topics:
                    learn(state, 1, topic, len(topic))
                known[0] += len(app_envs)
                known[1] += len(topics)
            start += 1
            frame += min(count, MAX_FRAMES)
            if full:
                break
        resume = (burst, frame)
        return start

    return take
