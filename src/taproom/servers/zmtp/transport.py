"""taproom's own ZeroMQ sockets for what it binds: ZMTP 3.x over asyncio (issue 26).

A :class:`ZmtpSocket` is one bound port of one ZeroMQ socket type (ROUTER, PULL, SUB so far).
Each accepted connection is a :class:`~.connection.Connection`, an ``asyncio.BufferedProtocol``: the kernel
copies bytes straight into the connection's buffer, and the frame scanner
(``protocols.zmtp.scan``, or ``zt_scan`` in C) walks their headers in place. Whole messages
stay where they landed until the service takes a burst of them (``reader(...).recv``), which
copies them out in :mod:`taproom.zmqburst`'s ``Burst`` shape (one buffer plus frame offsets in
C, frame lists in Python), so the compiled kernels (``lj_build``) read them as they read
libzmq's.

What a peer can make the hub hold is bounded three ways:

* a message is at most ``max_message_bytes`` on the wire: the scanner checks every frame
  header against it *before* the body arrives, and the peer is disconnected and counted
  (``message_too_large``, its address in a rate-limited log);
* every byte of a connection's buffer is reserved from the process budget (its
  ``connection_buffers`` holder): a connection whose bytes do not fit stops being read (TCP
  pushes back on that peer alone) until the holder has room; idle connections give their
  buffer back;
* a connection stops being read while its whole messages wait for the service (the hub is
  full, ``wait_capacity``), so nothing piles up behind a full journal either.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ... import zmqburst
from ...access import ListenerAccess, access_for
from ...hub import Hub
from ...protocols import zmtp as zp
from .. import ACCEPT_BATCH, deepen_accept_queue
from .config import ZmtpConfig
from .connection import Connection
from .holder import Holder, buffer_holder
from .listener import RateLimitedLog, listening, zmtp_config
from .readers import ExtReader, PyReader

__all__ = ["ZmtpSocket", "zmtp_config"]

log = logging.getLogger("taproom.zmtp")

_SWEEP_S = 1.0  # timeouts and idle buffers are looked at this often
_KINDS = (b"ROUTER", b"PULL", b"SUB")


class ZmtpSocket:
    """One bound ZeroMQ socket of type ``kind`` served by taproom's transport.

    ``protocol``/``name``: the metric labels and the listener's name. ``max_message_bytes``:
    the most a message may take on the wire. ``subscribe``: topics a SUB sends every peer.
    """

    def __init__(
        self,
        kind: str,
        *,
        hub: Hub,
        protocol: str,
        name: str,
        max_message_bytes: int,
        subscribe: tuple[bytes, ...] = (),
        config: ZmtpConfig | None = None,
        holder: Holder | None = None,
        access: ListenerAccess | None = None,
    ) -> None:
        if kind.encode() not in _KINDS:
            raise ValueError(f"taproom's transport has no {kind} socket")
        self.kind = kind.encode()
        self.hub = hub
        self.protocol = protocol
        self.name = name
        self.max_message_bytes = max_message_bytes
        self.subscriptions = subscribe
        self.config = config or zmtp_config(hub)
        self.holder = holder or buffer_holder(hub)
        # who may connect (taproom.access): the allowlist is checked at accept
        self.access = access or access_for(hub.config, name, hub.metrics)
        self.buffered = 0  # bytes reserved by this socket's connections
        self.address = ""
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._connections: set[Connection] = set()
        self._ready: deque[Connection] = deque()
        self._readable = asyncio.Event()
        # wait_readable's ``direct``: set while the service is parked in it (see there)
        self._direct: Callable[[], bool] | None = None
        self._reading = False  # inside a connection's buffer_updated
        self._deferred = False  # a connection became ready there: served at its end
        self._direct_failure: Exception | None = None  # what direct() raised, for the task
        self._routes: dict[bytes, Connection] = {}
        self._next_id = itertools.count(random.getrandbits(31))
        self._rlog = RateLimitedLog()
        self._guard = hub.supervisor.guard(f"zmtp.{name}", protocol=protocol, logger=log)
        self._ext = zmqburst.active() == "ext"
        ffi, lib = zmqburst.ffi_lib()
        self._ffi, self._lib = ffi, lib
        self._scanned: Any = ffi.new("zt_scanned *") if self._ext else None
        metrics = hub.metrics
        self._m_connections = metrics.connections(protocol, name)
        metrics.gauge(
            "zmtp",
            "buffered",
            "bytes",
            "Connection buffer bytes reserved by a ZeroMQ listener's peers (budget: connections)",
            ("listener",),
        ).labels(listener=name).set_function(lambda: self.buffered)
        self._m_dropped = metrics.counter(
            "zmtp",
            "replies_dropped",
            "messages",
            "Replies dropped because the peer had max_reply_bytes queued or had gone",
            ("listener",),
        ).labels(listener=name)

    # --- binding -------------------------------------------------------------------------------

    async def bind(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (0: any free port); returns ``host:port`` as bound."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: Connection(self), host or None, port, backlog=ACCEPT_BATCH
        )
        deepen_accept_queue(server.sockets, 4096)
        self._server = server
        bound = server.sockets[0].getsockname()[1]
        self.address, self._sweeper = listening(self.hub, self.name, host, bound, self._sweep, loop)
        return self.address

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._connections):
            conn.close()
        while self._ready:  # nobody takes them now: their room goes back
            conn = self._ready.popleft()
            conn.ready = False
            conn._free()

    # --- the service's side --------------------------------------------------------------------

    @property
    def readable(self) -> bool:
        return bool(self._ready)

    async def wait_readable(
        self, timeout: float | None = None, *, direct: Callable[[], bool] | None = None
    ) -> bool:
        """Until a whole message is ready (True), or ``timeout`` seconds passed (False). No
        ``asyncio.wait_for``: on Python 3.11 it can swallow a cancellation that races its
        timeout, and a loop that ignores its cancel hangs the service's stop.

        ``direct`` (no timeout): while the caller is parked here, a message that becomes
        ready in a connection's read callback is served by ``direct()`` at the end of that
        callback, in that turn of the loop, instead of waking the caller's task in the next
        one (issue 32: one request in flight paid that hop, a future and a task step before
        any work). ``direct()`` returns True when it took everything ready and needs the
        task for nothing (then :meth:`Hub.commit_now`: what it submitted is committed in
        this callback when it is a lone request and nothing else is ready); otherwise (no
        room in the hub, more to read) the caller wakes as without it. What ``direct()``
        raises is raised here, in the caller's task, as if the task had run it (a supervised
        loop dies and is restarted as before). ``direct`` runs on the loop, outside any
        connection's own bookkeeping, and only while the caller is parked, so the caller's
        state is its own."""
        if timeout is None:
            while not self._ready:
                self._readable.clear()
                self._direct = direct
                try:
                    await self._readable.wait()
                finally:
                    self._direct = None
                failure = self._direct_failure
                if failure is not None:
                    self._direct_failure = None
                    raise failure
            return True
        if not self._ready:
            self._readable.clear()
            wake = asyncio.get_running_loop().call_later(timeout, self._readable.set)
            try:
                await self._readable.wait()
            finally:
                wake.cancel()
        return bool(self._ready)

    def reader(self, max_frames: int) -> zmqburst.Reader:
        """A burst reader (compiled or pure Python, as taproom.zmqburst selects): every whole
        message ready, up to a count and a byte budget, across peers in turn."""
        if self._ext:
            return ExtReader(self, max_frames)
        return PyReader(self, max_frames)

    def send(self, frames: list[bytes] | tuple[bytes, ...]) -> bool:
        """A ROUTER's message to the peer its first frame names; False when it is gone or
        has max_reply_bytes queued (dropped and counted, as libzmq's ROUTER drops)."""
        conn = self._routes.get(frames[0])
        if conn is None or not conn.write(zp.encode_message(frames[1:])):
            self._m_dropped.inc()
            return False
        return True

    def send_encoded(self, routing_id: bytes, data: bytes) -> bool:
        """Like :meth:`send` with the frames after the routing id already encoded."""
        conn = self._routes.get(routing_id)
        if conn is None or not conn.write(data):
            self._m_dropped.inc()
            return False
        return True

    def send_encoded_many(self, replies: list[tuple[bytes, bytes]]) -> None:
        """:meth:`send_encoded` for many replies: one write per peer (a write is a system call
        when nothing is queued), in order per peer."""
        if len(replies) == 1:
            self.send_encoded(*replies[0])
            return
        per_peer: dict[bytes, list[bytes]] = {}
        for routing_id, data in replies:
            chunks = per_peer.get(routing_id)
            if chunks is None:
                per_peer[routing_id] = [data]
            else:
                chunks.append(data)
        for routing_id, chunks in per_peer.items():
            conn = self._routes.get(routing_id)
            if conn is None or not conn.write(b"".join(chunks)):
                self._m_dropped.inc(len(chunks))

    def peers(self) -> int:
        return sum(1 for conn in self._connections if conn.peer is not None)

    # --- the connections' side -----------------------------------------------------------------

    def _adopt(self, conn: Connection, host: str | None) -> bool:
        assert conn.transport is not None
        if not self.access.allows(host):
            # counted now; the peer is told at the handshake (it is bounded like any other)
            self.access.refused(conn.address, "address_not_allowed", "not in allow")
            conn.denied = True
        if self._server is None or len(self._connections) >= self.config.max_connections:
            self._refused("too_many_connections", f"{conn.address}: over max_connections")
            conn.transport.abort()
            conn.closed = True
            return False
        self._connections.add(conn)
        self._m_connections.inc()
        return True

    def _peer_ready(self, conn: Connection) -> bool:
        peer = conn.peer
        assert peer is not None and conn.transport is not None
        if self.kind == b"ROUTER":
            identity = peer.identity
            if identity and identity[0] != 0:
                # as libzmq's ROUTER without ROUTER_HANDOVER: a taken identity is refused
                if identity in self._routes:
                    conn.refuse("identity_in_use", f"identity {identity!r} is connected")
                    return False
                routing_id = identity
            else:  # libzmq's generated ids: a zero byte, then a 32-bit counter
                routing_id = b"\x00" + (next(self._next_id) & 0xFFFFFFFF).to_bytes(4, "big")
            conn.prefix = routing_id
            self._routes[routing_id] = conn
        for topic in self.subscriptions:
            conn.write(zp.subscribe_message(topic, peer.minor))
        return True

    def _forget(self, conn: Connection) -> None:
        """A connection closed (its whole messages, if any, stay ready until taken)."""
        if conn in self._connections:
            self._connections.discard(conn)
            self._m_connections.dec()
        if conn.prefix is not None and self._routes.get(conn.prefix) is conn:
            del self._routes[conn.prefix]

    def _mark_ready(self, conn: Connection) -> None:
        conn.ready = True
        self._ready.append(conn)
        if self._reading and self._direct is not None:
            self._deferred = True  # served at the end of this read (_serve_deferred)
        else:
            self._readable.set()

    def _serve_deferred(self) -> None:
        """At the end of a connection's read callback that made messages ready while the
        service was parked in ``wait_readable(direct=...)``: serve them here when nothing else
        is ready to run in this turn of the loop, or wake it."""
        self._deferred = False
        direct = self._direct
        # Only as the turn's last callback: when other reads are ready in this turn (a busy
        # socket, many peers), the task takes them all in one burst next turn, as before,
        # rather than a batch per connection. asyncio's own ready queue (as Hub.commit_now);
        # on a loop without one the task is woken.
        pending = getattr(asyncio.get_running_loop(), "_ready", None)
        alone = isinstance(pending, deque) and not pending
        if direct is not None and alone and self._ready and not self._readable.is_set():
            try:
                if direct() and not self._ready:
                    # nothing more to read: a lone request's commit (the burst's, if it is
                    # one event) is made now, not in a turn of its own (Hub.commit_now)
                    self.hub.commit_now()
                    return
            except Exception as exc:
                # a bug in the service's own code: raised in its task, as if the task had
                # run it (the supervisor counts the loop's death and restarts it)
                self._direct_failure = exc
        self._readable.set()

    def _unmark_ready(self, conn: Connection) -> None:
        if conn.ready:
            conn.ready = False
            with contextlib.suppress(ValueError):
                self._ready.remove(conn)

    def _refused(self, reason: str, detail: str) -> None:
        self.hub.metrics.rejected(self.protocol, reason)
        self._rlog("zmtp: %s refused %s (%s)", self.name, detail, reason)

    def _failed(self, exc: Exception, conn: Connection) -> None:
        """A read the transport failed on unexpectedly (taproom.supervise): counted as an
        ``internal_error`` of the protocol and logged with its traceback; that connection
        closes (its buffer is in no known state; the whole messages before it are still
        delivered), the listener and every other connection go on."""
        self._guard.failed(exc, f"read from {conn.address}")
        conn.close()

    def _cbuf(self, buf: bytearray) -> Any:
        return self._ffi.from_buffer("unsigned char[]", buf) if self._ext else None

    def _scan(self, conn: Connection) -> tuple[int, int, int, int, int, int, int, int]:
        limit, commands = self.max_message_bytes, self.config.max_command_bytes
        if not self._ext:
            assert conn.buf is not None
            return zp.scan(
                conn.buf, conn.scan, conn.end, conn.complete, conn.partial, limit, commands
            )
        r = self._scanned
        self._lib.zt_scan(
            conn.cbuf, conn.scan, conn.end, conn.complete, conn.partial, limit, commands, r
        )
        return r.status, r.pos, r.complete, r.messages, r.partial, r.want, r.body, r.size

    async def _sweep(self) -> None:
        """Handshake and unfinished-message timeouts; buffers of idle peers given back."""
        cfg = self.config
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.monotonic()
            for conn in list(self._connections):
                if conn.peer is None:
                    if now - conn.connected_at > cfg.handshake_timeout_s:
                        conn.refuse("handshake_timeout", "no READY in time", tell=False)
                    continue
                stalled = conn.partial_since and now - conn.partial_since > cfg.partial_timeout_s
                # not read because the hub is full: not its fault; waiting for room it holds
                # part of the budget for a message that may never end: its fault
                if stalled and (not conn.paused or conn.waiting is not None):
                    conn.refuse("partial_timeout", "a message left unfinished")
                    continue
                if not conn.active and conn.buf is not None and conn.start == conn.end:
                    conn._free()
                conn.active = False
