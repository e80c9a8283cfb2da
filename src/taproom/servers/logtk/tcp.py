"""LogTK over TCP as an :class:`asyncio.Protocol`: a read is handled where it arrives.

The transport's ``data_received`` feeds the connection's state machine and submits the
entries (``Session.handle`` -> ``Hub.submit_callback``) in the same turn of the loop that read
them; the commit's callback writes the ack (``Session.ack``). Over asyncio streams every read
woke a reader task first (the StreamReader's future, one more turn of the loop and ~40 Python
calls per request: issue 32, one request in flight).

The limits are the stream loop's: reading pauses (``transport.pause_reading``) while the hub
has no capacity, the connection's unacked window is full or its unfinished frame waits for
room in the process budget's connection buffers; a small waiter task resumes it. The sender
task stays for what the commit's callback does not write (a transport with unsent bytes, the
state machine's own frames, the close), and the ticker for pings and timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from ...access import ConnectionGate
from ...budget import CONNECTION_BUFFERS
from ...protocols.logtk import CloseCode, ServerConnection
from .session import Session

if TYPE_CHECKING:
    from .service import LogTKService

__all__ = ["TcpConnection"]

# An unfinished frame up to this size is held without a reservation (less than one read).
UNRESERVED_BYTES = 64 * 1024


class TcpConnection(asyncio.Protocol):
    """One LogTK TCP connection. The connection gate is applied at accept: a refused
    connection is aborted before any state machine, task or read is spent on it."""

    def __init__(self, service: LogTKService, gate: ConnectionGate) -> None:
        self._service = service
        self._gate = gate
        self._refused = False
        self._ended = False
        self._host = ""
        self._held = 0  # bytes of the connection buffers this connection's frame holds
        self._waiter: asyncio.Task[None] | None = None  # resumes reading once there is room
        self._writable = asyncio.Event()  # the transport takes writes (flow control)
        self._writable.set()
        self._lost = asyncio.Event()

    # --- the transport's calls ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        host = peername[0] if peername else ""
        if self._gate.admit(host, peername[1] if peername else None):
            self._refused = True
            transport.abort()  # type: ignore[attr-defined]
            return
        assert isinstance(transport, asyncio.Transport)
        self._host = host
        self._transport = transport
        svc = self._service
        peer_host, peer_port = peername or ("?", 0)
        self._peer = f"{peer_host}:{peer_port}"
        self._loop = asyncio.get_running_loop()
        svc._enter("logtk_tcp")
        self._conn = ServerConnection(
            svc.settings,
            now=self._loop.time(),
            authenticate=lambda token: svc.authenticate(token, peer_host),
        )
        self._session = Session(svc, self._conn, self._send, "tcp", self._peer, transport)
        svc.sessions.add(self._session)
        self._sender = svc._spawn(self._session.sender(self._close))
        self._ticker = svc._spawn(self._session.ticker())
        self._buffers = svc.hub.budget.holder(CONNECTION_BUFFERS)
        self._guard = svc.guards["tcp"]
        self._hub = svc.hub

    def data_received(self, data: bytes) -> None:
        if self._refused or self._ended:
            return
        conn = self._conn
        need = 0
        try:
            self._session.handle(conn.receive_data(data, self._loop.time()))
            # An unfinished frame past a small allowance is held with room from the process
            # budget's connection_buffers (shared with every listener); without room, this
            # connection is not read until there is (taproom.budget).
            buffered = conn.buffered_bytes
            target = buffered if buffered > UNRESERVED_BYTES else 0
            held = self._held
            if target > held:
                if self._buffers.try_reserve(target - held):
                    self._held = target
                else:
                    need = target
            elif target < held:
                self._buffers.release(held - target)
                self._held = target
        except Exception as exc:  # this connection closes (0xf8); no other is touched
            self._guard.failed(exc, f"read from {self._peer}")
            conn.close(CloseCode.INTERNAL_ERROR, "internal error")
        if conn.closed:
            self._end()
        elif need or not (self._hub.has_capacity and self._session.room.is_set()):
            self._transport.pause_reading()
            self._waiter = self._loop.create_task(self._resume_when_room(need))
        # This read's entries need no turn of the loop of their own to be committed (and
        # acked, by the commit's callback) when nothing else is ready to run (issue 32).
        self._hub.commit_now()

    def eof_received(self) -> bool:
        if self._refused:
            return False
        # Half-closed: the sender may still close the connection with its frames queued.
        self._end()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._writable.set()
        self._lost.set()
        self._end()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # --- backpressure, the sender's writes, the end ---------------------------------------

    async def _resume_when_room(self, need: int) -> None:
        """Reading paused: resumes once the frame's reservation (``need`` bytes held in
        all), the hub's capacity and the unacked window allow."""
        try:
            if need > self._held:
                await self._buffers.reserve(need - self._held, holding=self._held)
                self._held = need
            await self._session.wait_room()
        except asyncio.CancelledError:
            return  # the connection ended meanwhile
        except Exception as exc:  # a bug: this connection closes (0xf8), others go on
            self._guard.failed(exc, f"wait for room, {self._peer}")
            self._conn.close(CloseCode.INTERNAL_ERROR, "internal error")
        finally:
            self._waiter = None
        if self._conn.closed:
            self._end()
        elif not self._ended:
            self._transport.resume_reading()

    async def _send(self, data: bytes) -> None:
        if self._lost.is_set():
            raise ConnectionResetError("connection lost")
        self._transport.write(data)
        if not self._writable.is_set():
            await self._writable.wait()
            if self._lost.is_set():
                raise ConnectionResetError("connection lost")

    async def _close(self) -> None:
        self._transport.close()
        await self._lost.wait()

    def _end(self) -> None:
        """No more reads: the stream loop's end. Whatever is not acked is not (the client
        resends it); the sender writes what the state machine queued and closes."""
        if self._ended:
            return
        self._ended = True
        if self._waiter is not None:
            self._waiter.cancel()
        self._buffers.release(self._held)
        self._held = 0
        session, conn = self._session, self._conn
        if not conn.closed:
            conn.close(CloseCode.NO_ACK, None)  # the peer is gone: stop the sender
            conn.data_to_send()
        session.wake.set()
        self._ticker.cancel()
        with contextlib.suppress(Exception):
            if not self._transport.is_closing():
                self._transport.pause_reading()
        finishing = self._loop.create_task(self._finish())
        self._service._finishing.add(finishing)
        finishing.add_done_callback(self._service._finishing.discard)

    async def _finish(self) -> None:
        try:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._sender), timeout=5)
        finally:
            self._service.sessions.discard(self._session)
            self._session.finish()
            self._service._leave("logtk_tcp")
            self._gate.leave(self._host)


def tcp_connections(service: LogTKService, gate: ConnectionGate) -> Any:
    """The listener's protocol factory."""
    return lambda: TcpConnection(service, gate)
