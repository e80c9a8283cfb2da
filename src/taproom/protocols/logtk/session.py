"""LogTK connection state machines (sans-I/O).

:class:`ServerConnection` runs one connection's rules as the hub speaks them (auth, init, data,
ack, ping, close); :class:`ClientConnection` is what taproom's client speaks. Neither touches a
socket or a clock: bytes go in with ``now`` (seconds, any monotonic origin) and events plus
bytes to send come out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .frames import (
    _U32,
    _U32_MAX,
    DEFAULT_FORMAT,
    HIGH_BIT,
    INVALID_AUTH_REASON,
    MALFORMED_REASON,
    TOKEN_BYTES,
    Ack,
    Auth,
    Close,
    CloseCode,
    Data,
    Frame,
    FrameDecoder,
    Init,
    OversizeData,
    Ping,
    Pong,
    encode_frame,
)

__all__ = [
    "AckReceived",
    "AuthDenied",
    "AuthFailed",
    "Authenticated",
    "ClientConnection",
    "CloseReceived",
    "ConnectionDead",
    "Initialized",
    "PingTimeout",
    "PongPolicy",
    "Ready",
    "ServerConnection",
    "ServerSettings",
    "State",
    "Violation",
    "ping_interval_ms",
]


# --- connection events ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Authenticated:
    """TCP: the auth frame carried a known token (``app`` is the app it belongs to)."""

    app: str


@dataclass(frozen=True, slots=True)
class AuthFailed:
    """TCP: the auth frame's token was refused; the connection is closing with 0xff."""


@dataclass(frozen=True, slots=True)
class Initialized:
    """The init exchange is done. ``ping_interval_ms`` is 0 when no pings are sent."""

    format: str
    client_id: int
    ping_interval_ms: int


@dataclass(frozen=True, slots=True)
class CloseReceived:
    """The peer sent ``close`` (``code`` None: a close-ack). The connection is closed."""

    code: int | None
    reason: str | None


@dataclass(frozen=True, slots=True)
class Violation:
    """The peer broke the protocol or a limit; the close prescribed is already queued."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class PingTimeout:
    """Two pings went unanswered (server) or no ping came in twice the interval (client)."""


class State(enum.Enum):
    AUTH = "auth"  # TCP only: waiting for the auth frame
    INIT = "init"  # waiting for init
    OPEN = "open"  # data flows
    CLOSING = "closing"  # we sent a close that wants a close-ack
    CLOSED = "closed"  # nothing more may be sent; the transport should close


class PongPolicy(enum.Enum):
    """When two missed pongs close a connection (``logtk.pong_policy``)."""

    ALWAYS = "always"  # the seed's rule for everyone
    AFTER_FIRST_PONG = "after_first_pong"  # for clients that have shown they answer pings
    NEVER = "never"  # rely on the idle timeout and TCP alone


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The knobs of one server connection (taken from the ``[logtk]`` section)."""

    formats: tuple[str, ...] = ("protobuf", "bson", "json")
    max_frame_bytes: int = 1 << 20
    max_data_bytes: int = 1 << 20
    # The auth frame is 67 bytes (69 with a status op); before it, nothing else may come.
    max_auth_frame_bytes: int = 256
    ping_recv: bool = True
    ping_min_delta_ms: int = 1000
    pong_policy: PongPolicy = PongPolicy.AFTER_FIRST_PONG
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0


def ping_interval_ms(client: Init, server_delta_ms: int, server_recv: bool) -> int:
    """``pingDelta = max(clientDelta, serverDelta)/2``, or 0 when either side declines."""
    if not (client.ping_recv and server_recv):
        return 0
    return max(client.ping_min_delta or 0, server_delta_ms) // 2


class ServerConnection:
    """One LogTK connection as the hub sees it.

    ``app`` is given for WebSocket connections (authenticated by the HTTP upgrade); TCP
    connections start in :attr:`State.AUTH` and call ``authenticate(token) -> app | None``
    on the auth frame. Feed bytes with :meth:`receive_data`; the events are
    :class:`Data` frames (to commit, then :meth:`ack`), :class:`OversizeData` for an entry over
    ``max_data_bytes`` (cut to its first ``max_data_bytes``; commit and ack it the same way, so
    one bad entry never blocks a client that resends until acked) and the event classes above. Send
    :meth:`data_to_send` after every call; close the transport once :attr:`closed`.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        now: float,
        app: str | None = None,
        authenticate: Callable[[bytes], str | None] | None = None,
    ) -> None:
        if app is None and authenticate is None:
            raise ValueError("a connection needs an app (WebSocket) or authenticate (TCP)")
        self.settings = settings
        self.app = app
        self._authenticate = authenticate
        self.state = State.INIT if app is not None else State.AUTH
        # An authenticated peer's entry over max_data_bytes is cut, not fatal (docs/compat.md).
        self._decoder = FrameDecoder(
            settings.max_frame_bytes, settings.max_data_bytes, truncate_data=app is not None
        )
        if self.state is State.AUTH:
            self._decoder.set_limits(settings.max_auth_frame_bytes, settings.max_auth_frame_bytes)
        self._out: list[bytes] = []
        self.opened_at = now
        self.last_received = now
        self.format = ""
        self.client_id = 0
        self.ping_interval_s = 0.0
        self._next_ping = 0.0
        self._ping_seq = 0
        self._outstanding: list[int] = []  # ackids of unanswered pings, oldest first
        self.ever_ponged = False
        self.unacked = 0

    # --- outgoing -------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    @property
    def has_output(self) -> bool:
        """Whether :meth:`data_to_send` has anything (the glue wakes its writer only then)."""
        return bool(self._out)

    @property
    def buffered_bytes(self) -> int:
        """Received bytes held for an unfinished frame (what the glue reserves)."""
        return self._decoder.buffered

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    def close(self, code: int = CloseCode.NORMAL, reason: str | None = None) -> None:
        """Start closing: with the high bit set the connection is done at once."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        self._out.append(encode_frame(Close(code, reason)))
        self.state = State.CLOSED if code & HIGH_BIT else State.CLOSING

    def ack(self, idems: Iterable[int]) -> None:
        """Acknowledge committed data frames; nothing goes out once the connection is closing
        ("FORBIDDEN from sending ... anything other than a close-ack frame")."""
        if self.state is State.OPEN:
            pack = _U32.pack
            self._out.extend(b"\x04\x01" + pack(idem) + b"\x00" for idem in idems)

    def alive(self, now: float) -> None:
        """The transport proved the peer alive (it answered a WebSocket ping): as good as
        data for the idle timeout, which so ends only connections that are really dead."""
        self.last_received = max(self.last_received, now)

    def settled(self, count: int) -> None:
        """``count`` data frames are done with (acked or abandoned): frees the window."""
        self.unacked = max(0, self.unacked - count)

    # --- incoming -------------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> list[object]:
        """Decode ``data`` and apply it; returns :class:`Data` frames and events."""
        if self.state is State.CLOSED:
            return []
        self.last_received = now
        events: list[object] = []
        if self.state is State.AUTH:
            data = self._receive_auth(data, events)
            if self.state is not State.INIT:
                return events
        received = 0
        for frame in self._decoder.feed(data):
            if type(frame) is Data and self.state is State.OPEN:  # the hot path
                events.append(frame)
                received += 1
                continue
            if type(frame) is OversizeData and self.state is State.OPEN:
                events.append(frame)
                received += 1
                continue
            if self.state is State.CLOSED:
                break  # nothing is taken after a close
            self._apply(frame, events)
        self.unacked += received
        self._decoder_failed(events)
        return events

    def _receive_auth(self, data: bytes, events: list[object]) -> bytes:
        """TCP before auth: decode the first frame alone, from at most ``max_auth_frame_bytes``
        (plus one, to tell an over-long frame) so an unauthenticated peer costs next to nothing;
        returns the bytes left for the bounds of an authenticated connection."""
        bound = self.settings.max_auth_frame_bytes
        room = max(0, bound + 1 - self._decoder.buffered)
        for frame in self._decoder.feed(data[:room], max_frames=1):
            self._apply(frame, events)
        if self.state is State.INIT:
            s = self.settings
            self._decoder.set_limits(s.max_frame_bytes, s.max_data_bytes)
            self._decoder.truncate_data = True
            return data[room:]
        error = self._decoder.error
        if error is not None and error.reason == "frame_too_large":
            self._violation(
                events,
                "auth_frame_too_large",
                f"no auth frame in the first {bound} bytes",
                CloseCode.INVALID_AUTH,
                INVALID_AUTH_REASON,
            )
        self._decoder_failed(events)
        return b""

    def _decoder_failed(self, events: list[object]) -> None:
        """Close as the decoder's error prescribes (once; nothing when there is none)."""
        error = self._decoder.error
        if error is not None and self.state not in (State.CLOSED, State.CLOSING):
            events.append(Violation(error.reason, str(error)))
            reply = error.reply
            assert isinstance(reply, Close) and reply.code is not None
            self.close(reply.code, reply.reason)

    def _violation(
        self, events: list[object], reason: str, message: str, code: int, text: str
    ) -> None:
        events.append(Violation(reason, message))
        self.close(code, text)

    def _apply(self, frame: Frame, events: list[object]) -> None:
        state = self.state
        if isinstance(frame, Close):
            if state is State.CLOSING:
                if frame.is_ack or not frame.wants_ack:
                    self.state = State.CLOSED
                    events.append(CloseReceived(frame.code, frame.reason))
                return
            # "Once the receiving end sees this, it is FORBIDDEN from sending or receiving
            # anything other than a close-ack frame."
            if frame.wants_ack:
                self._out.append(b"\x00\x00")
            self.state = State.CLOSED
            events.append(CloseReceived(frame.code, frame.reason))
            return
        if state is State.CLOSING:
            return
        if state is State.AUTH:
            if not isinstance(frame, Auth):
                self._violation(
                    events,
                    "not_authenticated",
                    f"{frame.type.name.lower()} before auth",
                    CloseCode.INVALID_AUTH,
                    INVALID_AUTH_REASON,
                )
                return
            app = None
            if self._authenticate is not None:
                # A missing token is checked as an empty one so the glue counts it too.
                app = self._authenticate(frame.token or b"")
            if app is None:
                self._out.append(encode_frame(Auth(status=False)))
                events.append(AuthFailed())
                self.close(CloseCode.INVALID_AUTH, INVALID_AUTH_REASON)
                return
            self.app = app
            self._out.append(encode_frame(Auth(status=True)))
            self.state = State.INIT
            events.append(Authenticated(app))
            return
        if isinstance(frame, Auth):
            return  # "Once authenticated, the server MUST ignore all auth frames it receives."
        if state is State.INIT:
            if isinstance(frame, Init):
                self._init(frame, events)
            elif isinstance(frame, Data | OversizeData):
                self._violation(
                    events,
                    "data_before_init",
                    "data before init",
                    CloseCode.MALFORMED,
                    "data before init",
                )
            return  # pings, pongs and acks before init carry nothing to act on
        # OPEN
        # (data on an open connection never gets here: receive_data takes it directly)
        if isinstance(frame, Pong) and frame.ackid in self._outstanding:
            self._outstanding.clear()
            self.ever_ponged = True
        # A second init "SHOULD be ignored"; ack and ping are server frames: ignored.

    def _init(self, frame: Init, events: list[object]) -> None:
        s = self.settings
        if frame.id is None:
            self._violation(
                events, "init_without_id", "init without id", CloseCode.MALFORMED, MALFORMED_REASON
            )
            return
        if frame.ping_recv and frame.ping_min_delta is None:
            # The seed's "No ping_min_delta" example: closed as a malformed frame.
            self._violation(
                events,
                "init_without_ping_delta",
                "ping_recv without ping_min_delta",
                CloseCode.MALFORMED,
                MALFORMED_REASON,
            )
            return
        fmt = frame.format if frame.format is not None else DEFAULT_FORMAT
        if fmt not in s.formats:
            self._violation(
                events,
                "unsupported_format",
                "unsupported format",
                CloseCode.UNSUPPORTED_FORMAT,
                "unsupported format",
            )
            return
        self.format = fmt
        self.client_id = frame.id
        interval = ping_interval_ms(frame, s.ping_min_delta_ms, s.ping_recv)
        answer = Init(
            format=fmt,
            ping_min_delta=s.ping_min_delta_ms if s.ping_recv else None,
            ping_recv=s.ping_recv,
        )
        self._out.append(encode_frame(answer))
        self.state = State.OPEN
        self.ping_interval_s = interval / 1000
        self._next_ping = self.last_received + self.ping_interval_s
        events.append(Initialized(fmt, frame.id, interval))

    # --- timers ---------------------------------------------------------------------------

    def _pongs_enforced(self) -> bool:
        policy = self.settings.pong_policy
        if policy is PongPolicy.ALWAYS:
            return True
        return policy is PongPolicy.AFTER_FIRST_PONG and self.ever_ponged

    def tick(self, now: float) -> list[object]:
        """Run the timers: handshake and idle timeouts, pings, missed pongs."""
        events: list[object] = []
        s = self.settings
        if self.state in (State.AUTH, State.INIT):
            if now - self.opened_at >= s.handshake_timeout_s:
                self._violation(
                    events,
                    "handshake_timeout",
                    "handshake timeout",
                    CloseCode.TIMEOUT,
                    "handshake timeout",
                )
            return events
        if self.state is not State.OPEN:
            return events
        if now - self.last_received >= s.idle_timeout_s:
            self._violation(
                events, "idle_timeout", "idle timeout", CloseCode.TIMEOUT, "idle timeout"
            )
            return events
        if self.ping_interval_s and now >= self._next_ping:
            if len(self._outstanding) >= 2 and self._pongs_enforced():
                events.append(PingTimeout())
                self._violation(
                    events,
                    "ping_timeout",
                    "two pings unanswered",
                    CloseCode.PING_TIMEOUT,
                    "ping timeout",
                )
                return events
            self._ping_seq = (self._ping_seq + 1) & _U32_MAX
            self._outstanding = [*self._outstanding[-3:], self._ping_seq]
            self._out.append(encode_frame(Ping(self._ping_seq)))
            self._next_ping = now + self.ping_interval_s
        return events


# --- client ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The server answered init; data may flow. ``ping_interval_ms`` 0: no pings."""

    format: str
    ping_interval_ms: int


@dataclass(frozen=True, slots=True)
class AuthDenied:
    """TCP: the server refused the token."""


@dataclass(frozen=True, slots=True)
class AckReceived:
    """The server acknowledged these idempotency tokens."""

    idems: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ConnectionDead:
    """No ping arrived in twice the ping interval: reconnect."""


@dataclass
class ClientConnection:
    """taproom's client side of one connection (sans-I/O).

    ``transport`` is ``"tcp"`` (auth frame first) or ``"ws"`` (authenticated by the HTTP
    upgrade). Always answers pings. Events: :class:`Ready`, :class:`AckReceived`,
    :class:`AuthDenied`, :class:`CloseReceived`, :class:`ConnectionDead`, :class:`Violation`.
    """

    transport: str
    client_id: int
    now: float
    token: bytes | None = None
    format: str = DEFAULT_FORMAT
    ping_min_delta_ms: int = 1000
    ping_recv: bool = True
    max_frame_bytes: int = 1 << 20
    state: State = State.AUTH
    ping_interval_s: float = 0.0
    last_ping: float = 0.0
    _out: list[bytes] = field(default_factory=list)
    _decoder: FrameDecoder = field(init=False)

    def __post_init__(self) -> None:
        self._decoder = FrameDecoder(self.max_frame_bytes, self.max_frame_bytes)
        if self.transport == "tcp":
            if self.token is None or len(self.token) != TOKEN_BYTES:
                raise ValueError(f"a TCP client needs a {TOKEN_BYTES}-byte token")
            self._out.append(encode_frame(Auth(token=self.token)))
            self.state = State.AUTH
        else:
            self._send_init()

    def _send_init(self) -> None:
        self._out.append(
            encode_frame(
                Init(
                    format=self.format,
                    id=self.client_id,
                    ping_min_delta=self.ping_min_delta_ms,
                    ping_recv=self.ping_recv,
                )
            )
        )
        self.state = State.INIT

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    @property
    def has_output(self) -> bool:
        """Whether :meth:`data_to_send` has anything (the glue wakes its writer only then)."""
        return bool(self._out)

    @property
    def ready(self) -> bool:
        return self.state is State.OPEN

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    def send(self, idem: int, data: bytes) -> None:
        """Queue one data frame (only once :attr:`ready`)."""
        if self.state is not State.OPEN:
            raise RuntimeError("connection not ready")
        self._out.append(encode_frame(Data(data, idem)))

    def close(self, code: int = CloseCode.NO_ACK, reason: str | None = "client exiting") -> None:
        if self.state in (State.CLOSING, State.CLOSED):
            return
        self._out.append(encode_frame(Close(code, reason)))
        self.state = State.CLOSED if code & HIGH_BIT else State.CLOSING

    def receive_data(self, data: bytes, now: float) -> list[object]:
        if self.state is State.CLOSED:
            return []
        frames = self._decoder.feed(data)
        events: list[object] = []
        acks: list[int] = []
        for frame in frames:
            if self.state is State.CLOSED:
                break
            if type(frame) is Ack:
                if self.state is State.OPEN:
                    acks.append(frame.idem)
            elif isinstance(frame, Close):
                if frame.wants_ack and self.state is not State.CLOSING:
                    self._out.append(b"\x00\x00")
                self.state = State.CLOSED
                events.append(CloseReceived(frame.code, frame.reason))
            elif self.state is State.CLOSING:
                continue
            elif isinstance(frame, Auth) and self.state is State.AUTH:
                if frame.status:
                    self._send_init()
                else:
                    events.append(AuthDenied())
            elif isinstance(frame, Init) and self.state is State.INIT:
                if frame.format != self.format:
                    events.append(Violation("format_mismatch", f"server chose {frame.format!r}"))
                    self.close(CloseCode.UNSUPPORTED_FORMAT, "unsupported format")
                    continue
                server = Init(ping_min_delta=self.ping_min_delta_ms, ping_recv=self.ping_recv)
                interval = ping_interval_ms(
                    server, frame.ping_min_delta or 0, bool(frame.ping_recv)
                )
                self.ping_interval_s = interval / 1000
                self.last_ping = now
                self.state = State.OPEN
                events.append(Ready(frame.format, interval))
            elif isinstance(frame, Ping):
                self.last_ping = now
                self._out.append(encode_frame(Pong(frame.ackid)))
        if acks:
            events.append(AckReceived(tuple(acks)))
        error = self._decoder.error
        if error is not None and self.state is not State.CLOSED:
            events.append(Violation(error.reason, str(error)))
            self.close(CloseCode.MALFORMED, MALFORMED_REASON)
        return events

    def tick(self, now: float) -> list[object]:
        """``ConnectionDead`` once no ping came in ``2 * pingDelta``."""
        if (
            self.state is State.OPEN
            and self.ping_interval_s
            and now - self.last_ping > 2 * self.ping_interval_s
        ):
            self.state = State.CLOSED
            return [ConnectionDead()]
        return []
