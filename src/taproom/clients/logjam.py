"""Logjam clients: an agent (DEALER or PUSH) and a consumer (SUB with gap detection and replay).

The agent speaks to taproom (or any logjam-device) the way logjam agents do: four frames
``app-env topic body meta``, sequence numbers from 1, optional compression, and in DEALER mode
an empty frame first when it wants the ``202 Accepted`` reply. The consumer subscribes to a PUB
output with prefix filters, decodes the meta frame, decompresses, tracks each device's sequence
numbers (gaps, duplicates, restarts) and, given taproom's replay endpoint, fills gaps from the
journal. Both are synchronous pyzmq objects: they serve scripts, tests and the CLI
(``taproom send logjam``, ``taproom tail --logjam``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import zmq

from ..protocols import logjam as lj
from ..protocols.logjam import Compression, Meta
from ..zmqaccess import Curve, add_curve_arguments, curve_client, curve_from_args

__all__ = [
    "ConsumedMessage",
    "LogjamAgent",
    "LogjamConsumer",
    "ReplyError",
    "register_send",
    "register_tail",
]


class ReplyError(Exception):
    """The device did not answer, or answered with something other than success."""


def _json_bytes(payload: Any) -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, str):
        return payload.encode()
    return orjson.dumps(payload)


class LogjamAgent:
    """Send logjam messages: ``mode="dealer"`` (to the ROUTER port) or ``"push"`` (PULL port).

    In DEALER mode ``reply=True`` asks for ``202 Accepted`` on each message (sync); with
    ``reply=False`` messages go without the empty frame and nothing comes back (async).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        mode: str = "dealer",
        reply: bool = True,
        app_env: str = "taproom-agent",
        topic: str = "logs.taproom.agent",
        compression: Compression | str = Compression.NONE,
        device: int = 0,
        meta_size: int = 24,
        timeout: float = 5.0,
        sndhwm: int = 100_000,
        context: zmq.Context | None = None,
        curve: Curve | None = None,
    ) -> None:
        if mode not in ("dealer", "push"):
            raise ValueError("mode is 'dealer' or 'push'")
        self.mode = mode
        self.reply = reply and mode == "dealer"
        self.app_env = app_env.encode()
        self.topic = topic.encode()
        self.compression = (
            lj.compression_by_name(compression) if isinstance(compression, str) else compression
        )
        self.device = device
        self.meta_size = meta_size
        self.timeout = timeout
        self.sequence = 0
        self._ctx = context or zmq.Context.instance()
        self.socket = self._ctx.socket(zmq.DEALER if mode == "dealer" else zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.setsockopt(zmq.SNDHWM, sndhwm)
        if curve is not None:
            curve_client(self.socket, *curve)
        self.socket.connect(endpoint)

    def frames(
        self,
        payload: Any,
        *,
        app_env: str | None = None,
        topic: str | None = None,
        created_ms: int | None = None,
    ) -> list[bytes]:
        """The four frames of the next message (consumes a sequence number)."""
        self.sequence += 1
        return lj.encode_message(
            app_env.encode() if app_env is not None else self.app_env,
            topic.encode() if topic is not None else self.topic,
            _json_bytes(payload),
            compression=self.compression,
            device=self.device,
            created_ms=int(time.time() * 1000) if created_ms is None else created_ms,
            sequence=self.sequence,
            meta_size=self.meta_size,
        )

    def send_frames(self, frames: Sequence[bytes], *, wait: bool = True) -> bytes | None:
        """Send prepared frames; in sync DEALER mode return the status (when ``wait``)."""
        sock = self.socket
        if self.reply:
            sock.send(b"", zmq.SNDMORE)
        for frame in frames[:-1]:
            sock.send(frame, zmq.SNDMORE)
        sock.send(frames[-1])
        if self.reply and wait:
            return self.recv_reply()[-1]
        return None

    def send(self, payload: Any, **kwargs: Any) -> bytes | None:
        """Send one message. Sync DEALER mode returns the status, e.g. ``b"202 Accepted"``."""
        return self.send_frames(self.frames(payload, **kwargs))

    def recv_reply(self, timeout: float | None = None) -> list[bytes]:
        """The next reply's frames (without an empty first frame, which earlier devices sent);
        raises :class:`ReplyError`."""
        wait = self.timeout if timeout is None else timeout
        if not self.socket.poll(int(wait * 1000), zmq.POLLIN):
            raise ReplyError(f"no reply within {wait}s")
        frames = self.socket.recv_multipart()
        # logjam-device (and taproom) reply app-env status; earlier devices replied "" status.
        return frames[1:] if frames and frames[0] == b"" else frames

    def ping(self) -> list[bytes]:
        """``ping`` -> ``[b"ping", b"200 OK", hostname]`` from taproom."""
        if self.mode != "dealer":
            raise ValueError("ping needs DEALER mode")
        meta = lj.encode_meta(Compression.NONE, self.device, int(time.time() * 1000), 0)
        self.socket.send_multipart([b"", lj.PING, self.app_env, b"{}", meta])
        return self.recv_reply()

    def close(self) -> None:
        self.socket.close()

    def __enter__(self) -> LogjamAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class ConsumedMessage:
    """One message from a PUB output (or a replay reply), decoded."""

    app_env: str
    topic: str
    body: bytes  # decompressed JSON
    meta: Meta
    replayed: bool = False
    offset: int | None = None  # known for replayed messages

    def json(self) -> Any:
        return orjson.loads(self.body)

    def to_json_dict(self) -> dict[str, Any]:
        try:
            body: Any = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            body = self.body.decode("utf-8", "replace")
        out: dict[str, Any] = {
            "app_env": self.app_env,
            "topic": self.topic,
            "device": self.meta.device,
            "sequence": self.meta.sequence,
            "created_ms": self.meta.created_ms,
            "compression": self.meta.compression.name.lower(),
            "body": body,
        }
        if self.replayed:
            out["replayed"] = True
            out["offset"] = self.offset
        return out


@dataclass
class DeviceState:
    """What a consumer knows about one producer's numbering."""

    last_sequence: int
    gaps: int = 0  # sequence numbers skipped (for a prefix subscriber: includes others' traffic)
    duplicates: int = 0
    restarts: int = 0
    missing: list[tuple[int, int]] = field(default_factory=list)  # ranges not yet filled


class LogjamConsumer:
    """A SUB socket on a logjam PUB output, with per-device gap and duplicate detection.

    ``prefixes`` are ZeroMQ subscriptions on app-env (``""`` is everything). Heartbeats are
    subscribed too (they carry sequence numbers, so without them every heartbeat looks like a
    gap) and are not returned unless ``return_heartbeats``. With ``replay_endpoint`` a gap is
    filled from taproom's journal: the missed messages that match ``prefixes`` come back
    (``replayed=True``) before the message that revealed the gap.
    """

    def __init__(
        self,
        endpoint: str,
        prefixes: Iterable[str] = ("",),
        *,
        replay_endpoint: str | None = None,
        return_heartbeats: bool = False,
        max_decompressed: int = 16 * 1024 * 1024,
        rcvhwm: int = 100_000,
        rcvbuf: int = 0,
        timeout: float = 5.0,
        context: zmq.Context | None = None,
        curve: Curve | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self.curve = curve
        self.prefixes = tuple(p.encode() for p in prefixes)
        self.return_heartbeats = return_heartbeats
        self.max_decompressed = max_decompressed
        self.timeout = timeout
        self.socket = self._ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf:  # kernel receive buffer; 0 leaves the OS default (autotuned)
            self.socket.setsockopt(zmq.RCVBUF, rcvbuf)
        for prefix in self.prefixes:
            self.socket.setsockopt(zmq.SUBSCRIBE, prefix)
        if b"" not in self.prefixes:
            self.socket.setsockopt(zmq.SUBSCRIBE, lj.HEARTBEAT_APP_ENV)
        if curve is not None:
            curve_client(self.socket, *curve)
        self.socket.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self._replay: zmq.Socket | None = None
        self.devices: dict[int, DeviceState] = {}
        self.heartbeats = 0
        self.filled = 0
        self.unfilled = 0  # sequence numbers in gaps the replay channel could not answer
        self.bad = 0
        self._ready: deque[ConsumedMessage] = deque()

    # --- live stream ----------------------------------------------------------------------

    @property
    def gaps(self) -> int:
        return sum(d.gaps for d in self.devices.values())

    @property
    def duplicates(self) -> int:
        return sum(d.duplicates for d in self.devices.values())

    def _decode(self, frames: Sequence[bytes], *, replayed: bool = False) -> ConsumedMessage:
        if len(frames) != 4:
            raise lj.LogjamError(f"{len(frames)} frames", reason="bad_frame_count")
        meta = lj.parse_meta(frames[3])
        body = lj.decompress(meta.compression, frames[2], self.max_decompressed)
        return ConsumedMessage(
            frames[0].decode("utf-8", "replace"),
            frames[1].decode("utf-8", "replace"),
            body,
            meta,
            replayed,
        )

    def _track(self, msg: ConsumedMessage) -> bool:
        """Update the device's numbering; False for a duplicate that must not be returned."""
        seq = msg.meta.sequence
        state = self.devices.get(msg.meta.device)
        if state is None:
            self.devices[msg.meta.device] = DeviceState(seq)
            return True
        last = state.last_sequence
        if seq == last + 1:
            state.last_sequence = seq
            return True
        if seq > last + 1:
            state.gaps += seq - last - 1
            if self.replay_endpoint:  # remembered only when they can be filled
                state.missing.append((last + 1, seq - 1))
            state.last_sequence = seq
            return True
        if seq == 1:  # the producer restarted or wrapped its numbering
            state.restarts += 1
            state.last_sequence = seq
            return True
        state.duplicates += 1
        return False

    def recv(self, timeout: float | None = None) -> ConsumedMessage | None:
        """The next message, or None after ``timeout`` seconds (default: the consumer's)."""
        if self._ready:
            return self._ready.popleft()
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return None
            frames = self.socket.recv_multipart()
            try:
                msg = self._decode(frames)
            except lj.LogjamError:
                self.bad += 1
                continue
            if not self._track(msg):
                continue
            state = self.devices[msg.meta.device]
            if self.replay_endpoint and state.missing:
                self._fill(state)
            if msg.app_env == "heartbeat":
                self.heartbeats += 1
                if not self.return_heartbeats:
                    if self._ready:
                        return self._ready.popleft()
                    continue
            if self._ready:
                self._ready.append(msg)
                return self._ready.popleft()
            return msg

    def _fill(self, state: DeviceState) -> None:
        ranges, state.missing = state.missing, []
        for first, last in ranges:
            try:
                msgs = self.replay_seq(first, last)
            except (ReplyError, lj.LogjamError):
                # The live stream goes on; what could not be fetched is counted, not retried
                # (a retry per message would stall the consumer on a dead replay endpoint).
                self.unfilled += last - first + 1
                continue
            for msg in msgs:
                self.filled += 1
                self._ready.append(msg)

    def messages(self, timeout: float | None = None) -> Iterable[ConsumedMessage]:
        """Messages until none arrives within ``timeout``."""
        while (msg := self.recv(timeout)) is not None:
            yield msg

    # --- replay ---------------------------------------------------------------------------

    def _replay_socket(self) -> zmq.Socket:
        if self._replay is None:
            if not self.replay_endpoint:
                raise ValueError("no replay endpoint")
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                curve_client(self._replay, *self.curve)
            self._replay.connect(self.replay_endpoint)
        return self._replay

    def _request(self, frames: list[bytes]) -> tuple[int, list[ConsumedMessage]]:
        sock = self._replay_socket()
        sock.send_multipart([b"", *frames])
        if not sock.poll(int(self.timeout * 1000), zmq.POLLIN):
            # A lost reply would pair the next request with this one: start afresh.
            sock.close()
            self._replay = None
            raise ReplyError("no replay reply")
        reply = sock.recv_multipart()
        if reply and reply[0] == b"":
            reply = reply[1:]
        if not reply or reply[0] != b"200 OK":
            raise ReplyError(b" ".join(reply).decode("utf-8", "replace"))
        try:
            nxt, count = int(reply[1]), int(reply[2])
        except (IndexError, ValueError):
            raise ReplyError("malformed replay reply") from None
        body = reply[3:]
        if len(body) != 5 * count:
            raise ReplyError("replay reply frame count does not match")
        out = []
        for i in range(count):
            part = body[5 * i : 5 * i + 5]
            decoded = self._decode(part[1:], replayed=True)
            out.append(
                ConsumedMessage(
                    decoded.app_env, decoded.topic, decoded.body, decoded.meta, True, int(part[0])
                )
            )
        return nxt, out

    def _prefix_frames(self, prefixes: Sequence[str] | None) -> list[bytes]:
        if prefixes is not None:
            return [p.encode() for p in prefixes]
        return [] if b"" in self.prefixes else list(self.prefixes)

    def replay_offsets(
        self, from_offset: int, max_count: int, prefixes: Sequence[str] | None = None
    ) -> tuple[int, list[ConsumedMessage]]:
        """Committed events from journal offset ``from_offset`` (at most ``max_count`` examined);
        returns ``(next offset to ask for, messages)``."""
        frames = [b"offset", str(from_offset).encode(), str(max_count).encode()]
        return self._request(frames + self._prefix_frames(prefixes))

    def replay_seq(
        self, first: int, last: int, prefixes: Sequence[str] | None = None
    ) -> list[ConsumedMessage]:
        """The data messages the PUB output numbered ``first..last`` that match the prefixes."""
        out: list[ConsumedMessage] = []
        start = first
        while start <= last:
            frames = [b"seq", str(start).encode(), str(last).encode()]
            nxt, msgs = self._request(frames + self._prefix_frames(prefixes))
            out += msgs
            if nxt <= start:
                break
            start = nxt
        return out

    def close(self) -> None:
        self.socket.close()
        if self._replay is not None:
            self._replay.close()

    def __enter__(self) -> LogjamConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- CLI plug-in ------------------------------------------------------------------------------


def _cmd_send(args: argparse.Namespace) -> int:
    endpoint = args.endpoint or (
        "tcp://127.0.0.1:9604" if args.mode == "dealer" else "tcp://127.0.0.1:9605"
    )
    with LogjamAgent(
        endpoint,
        mode=args.mode,
        reply=not args.no_reply,
        app_env=args.app_env,
        topic=args.topic,
        compression=args.compression,
        device=args.device,
        timeout=args.timeout,
        curve=curve_from_args(args),
    ) as agent:
        if args.ping:
            print(" ".join(f.decode("utf-8", "replace") for f in agent.ping()))
            return 0
        bodies = args.json or [line.rstrip("\n") for line in sys.stdin if line.strip()]
        failures = 0
        for text in bodies:
            try:
                orjson.loads(text)
            except orjson.JSONDecodeError:
                print(f"not JSON: {text[:80]!r}", file=sys.stderr)
                return 2
            for _ in range(args.count):
                try:
                    status = agent.send(text.encode())
                except ReplyError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 1
                if status is not None and not status.startswith(b"202"):
                    failures += 1
                    print(status.decode("utf-8", "replace"), file=sys.stderr)
        sent = len(bodies) * args.count
        print(f"sent {sent} message(s), {failures} refused", file=sys.stderr)
        return 1 if failures else 0


def register_send(subparsers: Any) -> None:
    p = subparsers.add_parser("logjam", help="send logjam messages (DEALER or PUSH)")
    p.add_argument("json", nargs="*", help="JSON bodies (default: one per line on stdin)")
    p.add_argument("--endpoint", help="default tcp://127.0.0.1:9604 (dealer) or :9605 (push)")
    p.add_argument("--mode", choices=("dealer", "push"), default="dealer")
    p.add_argument("--no-reply", action="store_true", help="DEALER without waiting for 202")
    p.add_argument("--app-env", default="taproom-cli")
    p.add_argument("--topic", default="logs.taproom.cli")
    p.add_argument("--compression", choices=("none", "zlib", "snappy", "lz4"), default="none")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--count", type=int, default=1, help="send each body N times")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")
    p.add_argument("--ping", action="store_true", help="ping the device and print the reply")
    add_curve_arguments(p)
    p.set_defaults(func=_cmd_send)


def register_tail(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int | None]:
    group = parser.add_argument_group("logjam")
    group.add_argument("--logjam", metavar="URL", help="follow a logjam PUB output instead")
    group.add_argument(
        "--logjam-prefix", action="append", metavar="APP_ENV", help="subscribe prefix (repeat)"
    )
    group.add_argument("--logjam-replay", metavar="URL", help="taproom replay endpoint: fill gaps")
    group.add_argument(
        "--logjam-idle", type=float, metavar="S", help="exit after S seconds without a message"
    )
    group.add_argument("--logjam-heartbeats", action="store_true", help="print heartbeats too")
    add_curve_arguments(parser)

    def handler(args: argparse.Namespace) -> int | None:
        if not args.logjam:
            return None
        consumer = LogjamConsumer(
            args.logjam,
            args.logjam_prefix or ("",),
            replay_endpoint=args.logjam_replay,
            return_heartbeats=args.logjam_heartbeats,
            curve=curve_from_args(args),
        )
        out = sys.stdout.buffer
        count = 0
        idle = args.logjam_idle
        try:
            while args.limit is None or count < args.limit:
                msg = consumer.recv(idle if idle is not None else 3600.0)
                if msg is None:
                    if idle is not None:
                        break
                    continue
                out.write(orjson.dumps(msg.to_json_dict(), option=orjson.OPT_APPEND_NEWLINE))
                out.flush()
                count += 1
        except KeyboardInterrupt:
            pass
        finally:  # a closed stdout (BrokenPipeError) goes on to cli.main's one handler
            consumer.close()
        if consumer.gaps or consumer.duplicates:
            print(
                f"gaps {consumer.gaps}, duplicates {consumer.duplicates}, filled {consumer.filled}",
                file=sys.stderr,
            )
        return 0

    return handler
