"""The open batch of a Lumberjack connection: ``D`` frames as journal records, the windows
handed over (parts, acks, fingerprints), and resend recognition.

A mixin of :class:`.decoder.ServerConnection`, which holds the state (its ``__slots__``) and
reads the bytes; the ``J`` path of its ``_parse`` writes records inline the same way.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import orjson

from ...eventtime import EventTimes
from ...records import EncodedBatch
from .frames import _HALF, _U32, _U32X2, SEQ_MASK, LumberjackError, LumberjackLimit
from .inflating import Level
from .window import (
    _ATTRS,
    _CT_KV,
    _KINDS,
    _MAX_NAME_CHARS,
    _REC_AFTER_LEN,
    _REC_HEAD,
    _T_D,
    _VER1,
    STALL_ROOM,
    Limits,
    ResendMemory,
    Window,
    _fingerprints,
    fingerprint,
)


class OpenBatch:
    """Records of the open batch and the windows they go out in (state: the subclass's)."""

    __slots__ = (
        "_count",
        "_events",
        "_high",
        "_in_c_window_done",
        "_in_window",
        "_json_cache",
        "_kv_cache",
        "_levels",
        "_limits",
        "_match",
        "_match_at",
        "_match_key",
        "_matching",
        "_more",
        "_nbytes",
        "_need",
        "_parts",
        "_producer",
        "_received_ns",
        "_records",
        "_skipped",
        "_stream_keys",
        "_topic_keys",
        "_version",
        "_window_size",
        "events_total",
        "resend",
        "room",
        "room_wanted",
        "stalled",
        "times",
    )

    _limits: Limits
    _producer: bytes
    _stream_keys: tuple[str, ...]
    _topic_keys: tuple[str, ...]
    _json_cache: dict[tuple[int, str, str], tuple[bytes, int, int, int]]
    _kv_cache: dict[tuple[int, str, str], tuple[bytes, int, int, int]]
    _parts: list[bytes | bytearray]
    _records: int
    _nbytes: int
    _received_ns: int
    _need: int
    _more: bool
    _levels: list[Level]
    _in_c_window_done: bool
    _window_size: int
    _version: int
    _count: int
    _in_window: int
    _high: int
    _events: list[Window]
    resend: ResendMemory | Mapping[int, Sequence[int]] | None
    _matching: bool
    _match: Sequence[int] | None
    _match_key: int
    _match_at: int
    _skipped: list[int]
    events_total: int
    times: EventTimes
    room: int
    room_wanted: int
    stalled: int

    def _stall_room(self, size: int) -> None:
        self.stalled = STALL_ROOM
        self.room_wanted = size
        self._more = True
        self._need = 0

    def _resent(self, seq: int, payload: bytes) -> bool:
        """Resend recognition, from a window's first event on: True when this event is the
        next of a remembered window (already stored), so it is skipped; the first mismatch
        ends it for this window."""
        fp = fingerprint(seq, payload)
        match = self._match
        if match is None:
            resend = self.resend
            match = resend.get(fp) if resend is not None else None
            if match is None:
                self._matching = False
                return False
            self._match = match
            self._match_key = fp
            self._match_at = 1
        elif self._match_at < len(match) and match[self._match_at] == fp:
            self._match_at += 1
        else:
            self._matching = False
            return False
        self._skipped.append(fp)
        return True

    def _counted(self, seq: int) -> None:
        """A skipped (already stored) event still counts in its window and its ack."""
        count = self._count
        if count:
            if 0 < ((seq - self._high) & SEQ_MASK) < _HALF:
                self._high = seq
        else:
            self._high = seq
        self._count = count + 1
        in_window = self._in_window + 1
        if in_window >= (self._window_size or self._limits.max_window):
            self._in_window = 0
            self._close_window("done")
            if self._levels:
                self._in_c_window_done = self._window_size > 0
        else:
            self._in_window = in_window

    def _data_frames(self, view: bytes, pos: int, end: int, version: int, depth: int) -> int:
        """A run of ``D`` frames of one version; returns where the run stops (the next other
        frame), or ``-(pos + 1)`` when the frame at ``pos`` is incomplete or has no room."""
        limits = self._limits
        max_pairs = limits.max_pairs
        max_event = limits.max_event_bytes
        max_window = limits.max_window
        max_batch = limits.max_batch_bytes
        unpack1 = _U32.unpack_from
        unpack2 = _U32X2.unpack_from
        dumps = orjson.dumps
        stream_keys = self._stream_keys
        topic_keys = self._topic_keys
        kv_cache = self._kv_cache
        parts = self._parts  # _close_window empties this list in place
        rec_pack = _REC_HEAD.pack
        rec_size, rec_after = _REC_HEAD.size, _REC_AFTER_LEN
        received_ns = self._received_ns
        producer_len = len(self._producer)
        iso = self.times.iso
        max_name, mask, half, t_data = _MAX_NAME_CHARS, SEQ_MASK, _HALF, _T_D
        while True:
            if end - pos < 10:
                self._need = 10
                return -pos - 1
            seq, npairs = unpack2(view, pos + 2)
            if npairs == 0:
                raise LumberjackError("D frame with zero pairs", reason="empty_data")
            if npairs > max_pairs:
                raise LumberjackLimit(
                    f"D frame with {npairs} pairs, at most {max_pairs}", reason="too_many_pairs"
                )
            q = kend = pos + 10
            obj: dict[str, str] = {}
            # Fast loop without per-pair bounds checks: a length running past the data makes
            # the next unpack raise (or leaves q > end); both mean "incomplete", decided below
            # with the event-size limit. Slices past the end only truncate and are dropped.
            try:
                for _ in range(npairs):
                    kend = q + 4 + unpack1(view, q)[0]
                    vend = kend + 4 + unpack1(view, kend)[0]
                    obj[view[q + 4 : kend].decode()] = view[kend + 4 : vend].decode()
                    q = vend
                extent = q
            except struct.error:
                extent = max(q, kend) + 4
            except UnicodeDecodeError:
                # Rare: invalid UTF-8 becomes U+FFFD (the payload must be JSON; documented).
                q = kend = pos + 10
                obj = {}
                try:
                    for _ in range(npairs):
                        kend = q + 4 + unpack1(view, q)[0]
                        vend = kend + 4 + unpack1(view, kend)[0]
                        key = view[q + 4 : kend].decode("utf-8", "replace")
                        obj[key] = view[kend + 4 : vend].decode("utf-8", "replace")
                        q = vend
                    extent = q
                except struct.error:
                    extent = max(q, kend) + 4
            if extent - pos > max_event:
                raise LumberjackLimit("D frame over max_event_bytes", reason="frame_too_large")
            if extent > end:
                self._need = extent - pos
                return -pos - 1
            if depth and self._in_c_window_done:
                raise LumberjackError(
                    f"more events in a C frame than its window of {self._window_size}",
                    reason="window_overrun",
                )
            payload = dumps(obj)
            self._version = version
            if self._matching and self._resent(seq, payload):
                self._counted(seq)
                pos = q
                if end - pos < 2 or view[pos] != version or view[pos + 1] != t_data:
                    return pos
                continue
            stream = ""
            for key in stream_keys:
                value = obj.get(key)
                if value and len(value) <= max_name:
                    stream = value
                    break
            topic = ""
            for key in topic_keys:
                value = obj.get(key)
                if value and len(value) <= max_name:
                    topic = value
                    break
            when = obj.get("@timestamp")
            ts_ns = (iso(when) or 0) if when else 0
            # The record encoding, inlined as in the J path of _parse.
            entry = kv_cache.get((version, stream, topic))
            if entry is None:
                entry = self._cache_entry((version, _CT_KV, stream, topic))
                kv_cache[(version, stream, topic)] = entry
            mid, mid_len, ls, lt = entry
            plen = len(payload)
            size = rec_size + mid_len + plen
            if size > self.room:
                self._stall_room(size)
                return -pos - 1
            self.room -= size
            parts += (
                rec_pack(
                    rec_after + mid_len + plen,
                    received_ns,
                    ts_ns,
                    seq,
                    10,
                    2,
                    ls,
                    lt,
                    producer_len,
                    0,
                    9,
                    plen,
                ),
                mid,
                payload,
            )
            self._records += 1
            self._nbytes += size
            count = self._count
            if count:
                if 0 < ((seq - self._high) & mask) < half:
                    self._high = seq
            else:
                self._high = seq
            self._count = count + 1
            in_window = self._in_window + 1
            if in_window >= (self._window_size or max_window):
                self._in_window = 0
                self._close_window("done")
                if depth:
                    self._in_c_window_done = self._window_size > 0
            else:
                self._in_window = in_window
                if self._nbytes >= max_batch:
                    self._close_window("part")
            pos = q
            # Stay in this loop while the next frame is another D of the same version.
            if end - pos < 2 or view[pos] != version or view[pos + 1] != t_data:
                return pos

    def _cache_entry(self, key: tuple[int, bytes, str, str]) -> tuple[bytes, int, int, int]:
        """The constant middle of a record and its lengths; the caller caches it."""
        version, content_type, stream, topic = key
        s = stream.encode("utf-8", "surrogateescape")
        t = topic.encode("utf-8", "surrogateescape")
        mid = b"".join((b"lumberjack", content_type, s, t, self._producer, _ATTRS[version]))
        if len(self._json_cache) + len(self._kv_cache) >= 256:
            # Bounded: streams/topics are few, but senders choose them.
            self._json_cache.clear()
            self._kv_cache.clear()
        return (mid, len(mid), len(s), len(t))

    def _close_window(self, kind: str) -> Window:
        """Hand over the open batch. ``kind``: ``done`` (the sender's window ended), ``part``
        (``max_batch_bytes``, or waiting for room, inside a window), ``flush`` (idle or end of
        input) or ``refused`` (the window is being refused after these events)."""
        parts = self._parts
        batch = EncodedBatch(self._records, b"".join(parts) if parts else b"", _KINDS)
        version = self._version
        done = kind == "done" or (kind == "flush" and not self._window_size)
        fingerprints: tuple[int, ...] = ()
        if not done:
            fingerprints = _fingerprints(batch.body)
        parts.clear()  # in place: _parse holds a reference to this list
        self._records = 0
        self._nbytes = 0
        self.events_total += batch.count
        skipped = tuple(self._skipped)
        self._skipped = []
        resent_of = self._match_key if skipped else 0
        ack: int | None = self._high
        if version == _VER1 and kind in ("part", "refused"):
            ack = None  # v1: one ack per window (logstash-forwarder reads exactly one)
        if ack is not None:
            self._count = 0
        # else: the window stays open and later parts still count towards its size.
        window = Window(batch, ack, version, done, fingerprints, skipped, resent_of)
        self._events.append(window)
        return window
