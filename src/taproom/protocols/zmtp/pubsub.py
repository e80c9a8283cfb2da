"""The publishing side of ZMTP: what a SUB or XSUB peer sends (subscriptions), each peer's
prefix filter, and bursts of messages encoded once for every subscriber that takes them.

Subscriptions arrive in two forms (23/ZMTP and 37/ZMTP "3.1"): a ZMTP 3.0 peer sends a
one-frame *message* whose first octet is 1 (subscribe) or 0 (cancel) followed by the prefix;
a 3.1 peer sends SUBSCRIBE / CANCEL *commands* whose data is the prefix. libzmq 4.3 sends the
command form to a peer that greets as 3.1, as taproom does; raw 3.0 peers and old libzmq send
messages. Both are taken.

A peer's filter is a *set* of prefixes, as libzmq's XPUB keeps one per pipe (its SUB side
counts repeats itself and sends a prefix once): subscribing twice and cancelling once leaves
the prefix cancelled. A message goes to a peer when its first frame starts with one of the
peer's prefixes (the empty prefix takes everything).

A :class:`Burst` is the wire bytes of whole messages, built once, with each message's end:
the transport writes the same bytes object to every subscriber whose filter takes every
message (the common case: importers and mugs subscribe to everything), and :meth:`Burst.select`
builds one smaller burst per distinct filter otherwise. No I/O and no clock here.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from .wire import Flag, ZmtpError, parse_command

__all__ = [
    "Burst",
    "Filter",
    "SealFrame",
    "Subscription",
    "command_subscription",
    "message_subscription",
    "seal_messages",
]

_LONG = struct.Struct(">Q")
Buffer = bytes | bytearray | memoryview
_F_MORE, _F_LONG = int(Flag.MORE), int(Flag.LONG)
# the short headers of frames of 0..255 bytes, with MORE and without: looked up, not built
_HEAD_MORE = [bytes((_F_MORE, n)) for n in range(256)]
_HEAD_LAST = [bytes((0, n)) for n in range(256)]


class SealFrame(Protocol):
    """Seals one frame for a CURVE peer (``CurveServer.seal``): ZMTP flags and body in, the
    MESSAGE command's wire bytes out."""

    def __call__(self, flags: int, body: bytes, /) -> bytes: ...


class Subscription(NamedTuple):
    """One subscribe (``subscribe`` True) or cancel of ``prefix``."""

    prefix: bytes
    subscribe: bool


def message_subscription(body: bytes) -> Subscription | None:
    """A ZMTP 3.0 subscription message's one frame: 1 + prefix subscribes, 0 + prefix cancels.
    Anything else is not a subscription (libzmq's XPUB passes such messages up to the
    application only when asked to; taproom's publishers have no use for them): None."""
    if not body or body[0] > 1:
        return None
    return Subscription(bytes(body[1:]), body[0] == 1)


def command_subscription(body: bytes | memoryview) -> Subscription | None:
    """A ZMTP 3.1 SUBSCRIBE or CANCEL command's body; None for any other command."""
    name, data = parse_command(body)
    if name == b"SUBSCRIBE":
        return Subscription(data, True)
    if name == b"CANCEL":
        return Subscription(data, False)
    return None


class Filter:
    """One subscriber's prefixes, at most ``max_prefixes`` of them (a peer that sends more is
    refused: ``too_many_subscriptions``; each subscription costs the hub memory and every
    burst a comparison)."""

    __slots__ = ("_key", "max_prefixes", "prefixes")

    def __init__(self, max_prefixes: int) -> None:
        self.max_prefixes = max_prefixes
        self.prefixes: dict[bytes, None] = {}  # in the order they came: a stable key
        self._key: tuple[bytes, ...] | None = ()

    def apply(self, sub: Subscription) -> bool:
        """Subscribe or cancel; True when the filter changed. Raises ZmtpError past the bound."""
        prefixes = self.prefixes
        if sub.subscribe:
            if sub.prefix in prefixes:
                return False
            if len(prefixes) >= self.max_prefixes:
                raise ZmtpError(
                    f"more than {self.max_prefixes} subscriptions", reason="too_many_subscriptions"
                )
            prefixes[sub.prefix] = None
        else:
            if sub.prefix not in prefixes:
                return False
            del prefixes[sub.prefix]
        self._key = None
        return True

    @property
    def key(self) -> tuple[bytes, ...]:
        """The prefixes as a sorted tuple: subscribers with equal keys take the same messages
        (an empty prefix among them: every message, so the key is just ``(b"",)``)."""
        if self._key is None:
            prefixes = self.prefixes
            self._key = (b"",) if b"" in prefixes else tuple(sorted(prefixes))
        return self._key

    def takes(self, topic: bytes) -> bool:
        return topic.startswith(self.key) if self.prefixes else False


def _frame_at(wire: Buffer, pos: int) -> tuple[int, int, int]:
    """(flags, body start, body size) of the frame at ``pos``."""
    flags = wire[pos]
    if flags & _F_LONG:
        return flags, pos + 9, _LONG.unpack_from(wire, pos + 1)[0]
    return flags, pos + 2, wire[pos + 1]


class Burst:
    """Whole messages' wire bytes (``wire``) and where each ends (``ends``, ascending; the
    first starts at 0). Built by :meth:`encode`, by a compiled kernel (logjam's PUB: a
    bytearray nobody changes once built), or by :meth:`select` from another burst.

    ``runs``, when the builder knows them (the Lager forwarder's kernel), are the messages'
    topics as (topic, how many consecutive messages have it): a filter is then matched once a
    run, not once a message."""

    __slots__ = ("_topics", "ends", "runs", "wire")

    def __init__(
        self,
        wire: bytes | bytearray,
        ends: Sequence[int],
        runs: list[tuple[bytes, int]] | None = None,
    ) -> None:
        self.wire = wire
        self.ends = ends
        self._topics: list[bytes | bytearray] | None = None
        self.runs = runs

    @classmethod
    def encode(cls, messages: Iterable[Sequence[bytes]]) -> Burst:
        """Encode whole messages (lists of frames, MORE on all but the last) once. (The
        compiled twin is ``taproom.zmqburst.zmtp_wire``.)"""
        parts: list[bytes] = []
        add = parts.append
        ends: list[int] = []
        size = 0
        more, last_ = _HEAD_MORE, _HEAD_LAST
        for frames in messages:
            *head, last = frames
            for frame in head:
                n = len(frame)
                if n < 256:
                    add(more[n])
                    size += 2 + n
                else:
                    add(b"\x03" + _LONG.pack(n))
                    size += 9 + n
                add(frame)
            n = len(last)
            if n < 256:
                add(last_[n])
                size += 2 + n
            else:
                add(b"\x02" + _LONG.pack(n))
                size += 9 + n
            add(last)
            ends.append(size)
        return cls(b"".join(parts), ends)

    def __len__(self) -> int:
        return len(self.ends)

    @property
    def nbytes(self) -> int:
        return len(self.wire)

    def start(self, index: int) -> int:
        return self.ends[index - 1] if index else 0

    def count_before(self, pos: int) -> int:
        """How many messages end at or before byte ``pos``."""
        return bisect_right(self.ends, pos)

    @property
    def topics(self) -> list[bytes | bytearray]:
        """Each message's first frame (what subscriptions are matched against)."""
        if self._topics is None and self.runs is not None:
            self._topics = [topic for topic, count in self.runs for _ in range(count)]
        if self._topics is None:
            wire = self.wire
            topics: list[bytes | bytearray] = []
            pos = 0
            for end in self.ends:
                _flags, body, size = _frame_at(wire, pos)
                topics.append(wire[body : body + size])
                pos = end
            self._topics = topics
        return self._topics

    def select(self, key: tuple[bytes, ...]) -> Burst | None:
        """The messages a filter with ``key`` takes: this burst itself when it takes all, None
        when it takes none, else a new burst of just those (runs copied, in order)."""
        if not self.ends:
            return None
        if key == (b"",):
            return self
        if not key:
            return None
        if self.runs is not None:
            hits = [topic.startswith(key) for topic, _count in self.runs]
            if all(hits):
                return self
            if not any(hits):
                return None
        taken = [i for i, topic in enumerate(self.topics) if topic.startswith(key)]
        if len(taken) == len(self.ends):
            return self
        if not taken:
            return None
        wire, ends = self.wire, self.ends
        parts: list[Buffer] = []
        new_ends: list[int] = []
        size = 0
        run_start = run_end = -1
        for i in taken:
            start, end = (ends[i - 1] if i else 0), ends[i]
            if start != run_end:  # a new run of consecutive messages
                if run_end >= 0:
                    parts.append(wire[run_start:run_end])
                run_start = start
            run_end = end
            size += end - start
            new_ends.append(size)
        parts.append(wire[run_start:run_end])
        return Burst(b"".join(parts), new_ends)

    def frames(self, index: int) -> list[bytes]:
        """The frames of message ``index`` (tests, and sealing for CURVE)."""
        wire = self.wire
        pos, end = self.start(index), self.ends[index]
        frames = []
        while pos < end:
            _flags, body, size = _frame_at(wire, pos)
            frames.append(bytes(wire[body : body + size]))
            pos = body + size
        return frames


def seal_messages(
    wire: Buffer,
    start: int,
    ends: Sequence[int],
    seal_frame: SealFrame,
) -> tuple[bytes, list[int]]:
    """Messages of ``wire`` from byte ``start`` up to each of ``ends`` (whole messages), each
    frame sealed by ``seal_frame(flags, body)`` (CURVE's MESSAGE commands): the sealed bytes
    and where each sealed message ends."""
    out: list[bytes] = []
    new_ends: list[int] = []
    size = 0
    pos = start
    for end in ends:
        while pos < end:
            flags, body, n = _frame_at(wire, pos)
            box = seal_frame(flags & 0x05, bytes(wire[body : body + n]))
            out.append(box)
            size += len(box)
            pos = body + n
        new_ends.append(size)
    return b"".join(out), new_ends
