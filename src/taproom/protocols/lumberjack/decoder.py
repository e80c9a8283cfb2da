"""The receiving side of one Lumberjack connection: bytes in, journal batches and acks out.

``ServerConnection.receive_data(data, now_ns)`` parses every complete frame, maps data frames
straight into the journal's record encoding (no per-event objects) and returns a
:class:`Window` for each window that is complete; the glue submits ``window.batch`` to the hub
and, once it is durable, sends ``encode_ack(window.version, window.ack_seq)``. ``flush()``
closes a partial window when the connection goes idle (streaming v1 clients never finish a
window). Decisions on the seed's ambiguities are in ``docs/protocols/lumberjack.md``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from ...eventtime import EventTimes
from ...records import RECORD_HEAD, RECORD_HEAD_AFTER_LEN, EncodedBatch
from .frames import (
    _HALF,
    _U32,
    _U32X2,
    SEQ_MASK,
    FrameType,
    LumberjackError,
    LumberjackLimit,
    Version,
)

__all__ = ["Limits", "ServerConnection", "Window"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds checked before anything read from the wire is allocated (see the server config)."""

    max_window: int = 10_000
    max_frame_bytes: int = 16 * 1024 * 1024
    max_decompressed_bytes: int = 64 * 1024 * 1024
    max_pairs: int = 1024
    max_nesting: int = 3
    max_batch_bytes: int = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Window:
    """Events ready for the journal.

    ``ack_seq`` is the sequence number to acknowledge once ``batch`` is durable (the highest
    received, never a count); ``None`` for the first parts of a window split because it grew
    past ``max_batch_bytes`` (the ack waits for the last part). ``batch.count`` may be 0
    (``W 0``, or an idle flush with nothing new): then the ack is owed at once, in order.
    """

    batch: EncodedBatch
    ack_seq: int | None
    version: int


# Journal record head (records.py layout): u32 rest, i64 received_ns, i64 ts_ns, u64 seq,
# u8 lp, u8 lc, u16 ls, lt, lr, le, u32 la, lp. Encoded here directly: records.BatchBuilder.add
# costs ~2.5 us per event, more than the whole rest of the v2 path; the format is checked
# against records.iter_batch by the tests.
_REC_HEAD = RECORD_HEAD
_REC_AFTER_LEN = RECORD_HEAD_AFTER_LEN
_MAX_NAME_CHARS = 255  # a stream/topic value longer than this is not a name: ignored

_CT_KV = b"kv"
_CT_JSON = b"json"
_ATTRS = {0x31: b'{"v":"1"}', 0x32: b'{"v":"2"}'}
# Plain ints for the hot loop: comparing with IntEnum members is several times slower.
_VER1 = int(Version.V1)
_VER2 = int(Version.V2)
_T_W = int(FrameType.WINDOW)
_T_D = int(FrameType.DATA)
_T_J = int(FrameType.JSON)
_T_C = int(FrameType.COMPRESSED)
_T_A = int(FrameType.ACK)
_JSONDecodeError = orjson.JSONDecodeError


def _compile_paths(paths: Sequence[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``"fields.app"`` -> ``("fields", ("app",))``: first key, then the rest of the walk."""
    compiled = []
    for path in paths:
        if path:
            first, *rest = path.split(".")
            compiled.append((first, tuple(rest)))
    return tuple(compiled)


class ServerConnection:
    """The receiving side of one connection.

    ``producer`` goes into every record (peer ``ip:port`` or TLS subject CN). ``stream_fields``
    and ``topic_fields`` are dotted paths tried in order; the first non-empty string wins. In
    ``D`` frames, whose keys are flat, a path is looked up as one literal key.
    """

    __slots__ = (
        "_buf",
        "_count",
        "_events",
        "_high",
        "_in_window",
        "_inflate_budget",
        "_inflated",
        "_json_cache",
        "_kv_cache",
        "_limits",
        "_more",
        "_nbytes",
        "_need",
        "_parts",
        "_producer",
        "_received_ns",
        "_stream",
        "_stream_keys",
        "_stream_paths",
        "_topic_keys",
        "_topic_paths",
        "_version",
        "_window_size",
        "events_total",
        "times",
    )

    def __init__(
        self,
        producer: str = "",
        *,
        limits: Limits | None = None,
        stream_fields: Sequence[str] = ("fields.app", "beat.name", "agent.name"),
        topic_fields: Sequence[str] = ("type", "fields.type"),
    ) -> None:
        self._limits = limits or Limits()
        self._producer = producer.encode("utf-8", "replace")[:65535]
        self._stream_paths = _compile_paths(stream_fields)
        self._topic_paths = _compile_paths(topic_fields)
        self._stream_keys = tuple(p for p in stream_fields if p)
        self._topic_keys = tuple(p for p in topic_fields if p)
        self._buf = bytearray()
        self._need = 0
        self._more = False  # complete frames left in _buf for the next call
        self._inflated = False  # this call inflated a top-level C frame
        self._inflate_budget = 0  # bytes the current top-level C tree may still inflate to
        self._stream: _Inflating | None = None  # a top-level C frame being inflated
        self._window_size = 0  # 0: no W seen yet, windows close at max_window or idle
        self._version = _VER2
        self._count = 0  # data frames in the open batch (not yet returned in a Window)
        # Data frames since the sender's window began: windows close on the sender's
        # boundaries even after an idle flush acknowledged part of one.
        self._in_window = 0
        self._high = 0
        self._parts: list[bytes | bytearray] = []
        self._nbytes = 0
        self._received_ns = 0
        self._events: list[Window] = []
        self._json_cache: dict[tuple[int, str, str], tuple[bytes, int, int, int]] = {}
        self._kv_cache: dict[tuple[int, str, str], tuple[bytes, int, int, int]] = {}
        self.events_total = 0
        # Each event's ``@timestamp`` (ISO 8601 text, as Beats and Logstash write it) becomes
        # the record's ts_ns by the event-time rule; ``times.out_of_range`` counts the ones the
        # journal cannot hold (year 9999 or 0001), stored absent. The server reads and resets it.
        self.times = EventTimes()

    # -- public API ---------------------------------------------------------------------------

    @property
    def pending_events(self) -> int:
        """Data frames received in the open (not yet returned) window."""
        return self._count

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for a later call: an incomplete frame, frames ``more_buffered`` left, and
        of a C frame paused inside, its compressed rest and inflated, unparsed bytes."""
        stream = self._stream
        held = len(stream.pending) + len(stream.tail) if stream is not None else 0
        return len(self._buf) + held

    @property
    def incomplete_frame_bytes(self) -> int:
        """The whole size of the incomplete frame being buffered, as far as its header tells
        (a ``D`` frame's grows as its pairs arrive); 0 when none is."""
        if not self._buf or self._more:
            return 0
        return max(self._need, len(self._buf))

    @property
    def more_buffered(self) -> bool:
        """Complete frames are buffered: call ``receive_data(b"", now_ns)`` for them.

        One call inflates at most one top-level ``C`` frame (a window for real senders), and
        a call that completed a batch stops inside a ``C`` frame's content (the compressed rest
        and the inflated start of the next frame are kept): what one call produces is about one
        batch (``max_batch_bytes``, or one event larger than that), and the caller checks the
        hub's capacity before the next piece is inflated.
        """
        return self._more

    @property
    def version(self) -> int:
        """Version byte of the latest frame (acks and keepalives answer in it)."""
        return self._version

    def receive_data(self, data: bytes, now_ns: int) -> list[Window]:
        """Parse ``data``; return the windows it completed, in order (see ``more_buffered``)."""
        self._received_ns = now_ns
        events: list[Window] = []
        self._events = events
        self._more = self._inflated = False
        try:
            if self._stream is not None:  # inside a top-level C frame: go on inflating it
                self._buf += data
                self._inflated = True
                if not self._pump():
                    self._more = True
                    return events
                data = bytes(self._buf)
                self._buf = bytearray()
            elif self._buf:
                buf = self._buf
                buf += data
                if len(buf) < self._need:
                    return events
                # One copy per completed frame run; parsing bytes (not a memoryview) is
                # markedly faster for the many small slices of D and J frames.
                data = bytes(buf)
                self._buf = bytearray()
            pos = self._parse(data, 0, len(data), 0)
            if pos < len(data):
                self._buf = bytearray(data[pos:])
        except (LumberjackError, LumberjackLimit) as exc:
            exc.windows = events
            self._buf = bytearray()
            self._stream = None
            raise
        finally:
            self._events = []  # the caller owns the windows now: hold no batch past the call
        if not self._buf:
            self._need = 0
        return events

    def flush(self) -> Window | None:
        """Acknowledge the open window's frames so far (the connection went idle).

        The sender's window stays open: it still closes after ``W`` frames in total.
        Returns None when nothing is pending.
        """
        if not self._count:
            return None
        window = self._close_window(final=True)
        self._events = []
        return window

    # -- parsing ------------------------------------------------------------------------------

    def _parse(self, view: bytes | bytearray, pos: int, end: int, depth: int) -> int:
        """Handle complete frames in ``view[pos:end]``; return where an incomplete one starts."""
        unpack2 = _U32X2.unpack_from
        unpack1 = _U32.unpack_from
        limits = self._limits
        max_frame = limits.max_frame_bytes
        max_window = limits.max_window
        max_batch = limits.max_batch_bytes
        loads = orjson.loads
        stream_paths = self._stream_paths
        topic_paths = self._topic_paths
        json_cache = self._json_cache
        parts = self._parts  # _close_window empties this list in place
        rec_pack = _REC_HEAD.pack
        received_ns = self._received_ns
        iso = self.times.iso
        producer_len = len(self._producer)
        # Module constants as locals: global lookups are measurable at 300k events/s.
        ver1, ver2, t_json = _VER1, _VER2, _T_J
        max_name, rec_size, rec_after = _MAX_NAME_CHARS, _REC_HEAD.size, _REC_AFTER_LEN
        mask, half, json_error = SEQ_MASK, _HALF, _JSONDecodeError
        while end - pos >= 2:
            version = view[pos]
            ftype = view[pos + 1]
            if version != ver2 and version != ver1:
                raise LumberjackError(f"unknown version byte {version:#04x}", reason="bad_version")
            if ftype == t_json:
                if end - pos < 10:
                    self._need = 10
                    return pos
                seq, length = unpack2(view, pos + 2)
                if length > max_frame:
                    raise LumberjackLimit(
                        f"J payload of {length} bytes, at most {max_frame}",
                        reason="frame_too_large",
                    )
                if length == 0:
                    raise LumberjackError("J frame with an empty payload", reason="empty_json")
                fend = pos + 10 + length
                if fend > end:
                    self._need = fend - pos
                    return pos
                payload = view[pos + 10 : fend]
                try:
                    obj = loads(payload)
                except json_error:
                    raise LumberjackError(
                        "J payload is not valid JSON", reason="bad_json"
                    ) from None
                if type(obj) is not dict:
                    raise LumberjackError(
                        "J payload is not a JSON object", reason="json_not_object"
                    )
                stream = ""
                node: object
                for first, rest in stream_paths:
                    node = obj.get(first)
                    for key in rest:
                        node = node.get(key) if type(node) is dict else None
                    if type(node) is str and node and len(node) <= max_name:
                        stream = node
                        break
                topic = ""
                for first, rest in topic_paths:
                    node = obj.get(first)
                    for key in rest:
                        node = node.get(key) if type(node) is dict else None
                    if type(node) is str and node and len(node) <= max_name:
                        topic = node
                        break
                when = obj.get("@timestamp")
                ts_ns = (iso(when) or 0) if type(when) is str else 0
                self._version = version
                # The record encoding, inlined (the hottest path of the hub): head, then the
                # cached constant middle (protocol, content type, stream, topic, producer,
                # attrs), then the payload as received.
                entry = json_cache.get((version, stream, topic))
                if entry is None:
                    entry = self._cache_entry((version, _CT_JSON, stream, topic))
                    json_cache[(version, stream, topic)] = entry
                mid, mid_len, ls, lt = entry
                parts += (
                    rec_pack(
                        rec_after + mid_len + length,
                        received_ns,
                        ts_ns,
                        seq,
                        10,
                        4,
                        ls,
                        lt,
                        producer_len,
                        0,
                        9,
                        length,
                    ),
                    mid,
                    payload,
                )
                self._nbytes += rec_size + mid_len + length
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
                    self._close_window(final=True)
                else:
                    self._in_window = in_window
                    if self._nbytes >= max_batch:
                        self._close_window(final=False)
                pos = fend
            elif ftype == _T_D:
                pos = self._data_frames(view, pos, end, version)
                if pos < 0:
                    return -pos - 1
            elif ftype == _T_W:
                if end - pos < 6:
                    self._need = 6
                    return pos
                (size,) = unpack1(view, pos + 2)
                if size > limits.max_window:
                    raise LumberjackLimit(
                        f"window of {size}, at most {limits.max_window}", reason="window_too_large"
                    )
                if self._count:
                    # A new window while one is open: the sender gave up on the old one's
                    # size. Close it so its ack is owed in order.
                    self._close_window(final=True)
                self._version = version
                self._window_size = size
                self._in_window = 0
                if size == 0:
                    # Nothing will follow in this window; acknowledge it as such.
                    self._events.append(Window(EncodedBatch(0, b""), 0, version))
                pos += 6
            elif ftype == _T_C:
                if end - pos < 6:
                    self._need = 6
                    return pos
                (length,) = unpack1(view, pos + 2)
                if length > max_frame:
                    raise LumberjackLimit(
                        f"C payload of {length} bytes, at most {max_frame}",
                        reason="frame_too_large",
                    )
                fend = pos + 6 + length
                if fend > end:
                    self._need = fend - pos
                    return pos
                if depth >= limits.max_nesting:
                    raise LumberjackLimit(
                        f"C frames nested deeper than {limits.max_nesting}",
                        reason="nesting_too_deep",
                    )
                if depth == 0:
                    if self._inflated:
                        self._more = True
                        self._need = 0
                        return pos
                    self._inflated = True
                    # The C frames nested in this one share its bound: eight inner frames of
                    # 63 MiB each must not make 504 MiB out of one small outer frame.
                    self._inflate_budget = limits.max_decompressed_bytes
                    self._version = version
                    # Inflated a piece at a time, parsed as frames complete; paused (the rest
                    # of this read kept) once a batch is ready for the hub.
                    self._stream = _Inflating(bytes(view[pos + 6 : fend]))
                    pos = fend
                    if not self._pump():
                        self._more = True
                        self._need = 0
                        return pos
                    continue
                inner = _inflate(
                    memoryview(view)[pos + 6 : fend],
                    self._inflate_budget,
                    limits.max_decompressed_bytes,
                )
                self._inflate_budget -= len(inner)
                self._version = version
                stop = self._parse(inner, 0, len(inner), depth + 1)
                if stop != len(inner):
                    raise LumberjackError(
                        "C content ends inside a frame", reason="truncated_compressed"
                    )
                pos = fend
            elif ftype == _T_A:
                raise LumberjackError("A frames are sent by readers only", reason="unexpected_ack")
            else:
                raise LumberjackError(f"unknown frame type {ftype:#04x}", reason="bad_frame_type")
        self._need = 2
        return pos

    def _pump(self) -> bool:
        """Inflate and parse the top-level C frame in ``_stream`` until it ends (True) or a
        batch is ready (False: paused, the stream kept for the next call).

        A piece is ``_INFLATE_FIRST``, or what the frame being completed still needs (one large
        event is inflated in one call, not grown a step at a time). Only the start of an
        incomplete frame is kept between pieces. Windows inside a larger C frame are handed
        over before its end (and zlib's checksum) is read, as go-lumber's streaming reader
        does; the frame's refusal then closes the connection after them.
        """
        stream = self._stream
        assert stream is not None
        decomp = stream.decomp
        while True:
            tail = stream.tail
            want = max(_INFLATE_FIRST, self._need - len(tail)) if tail else _INFLATE_FIRST
            limit = min(want, self._inflate_budget + 1)
            try:
                piece = decomp.decompress(stream.pending, limit)
            except zlib.error as exc:
                raise LumberjackError(
                    f"C payload is not zlib: {exc}", reason="bad_compressed"
                ) from None
            stream.pending = decomp.unconsumed_tail
            produced = len(piece)
            self._inflate_budget -= produced
            if self._inflate_budget < 0:
                raise LumberjackLimit(
                    "C frame (with the C frames inside it) inflates past "
                    f"{self._limits.max_decompressed_bytes} bytes",
                    reason="decompressed_too_large",
                )
            # Checked before parsing: a C frame that fits in one piece (a real sender's
            # window) is refused whole, nothing in it parsed, as when it was inflated at once.
            if not decomp.eof and produced < limit and not stream.pending:
                raise LumberjackError(
                    "C payload is a truncated zlib stream", reason="bad_compressed"
                )
            if decomp.unused_data:
                raise LumberjackError(
                    "bytes after the zlib stream in a C frame", reason="bad_compressed"
                )
            content = tail + piece if tail else piece
            del tail, piece
            stop = self._parse(content, 0, len(content), 1)
            stream.tail = content[stop:] if stop < len(content) else b""
            del content
            if decomp.eof:
                if stream.tail:
                    raise LumberjackError(
                        "C content ends inside a frame", reason="truncated_compressed"
                    )
                self._stream = None
                return True
            if self._events:
                return False

    def _data_frames(self, view: bytes | bytearray, pos: int, end: int, version: int) -> int:
        """A run of ``D`` frames of one version; returns where the run stops (the next other
        frame), or ``-(pos + 1)`` when the frame at ``pos`` is incomplete."""
        limits = self._limits
        max_pairs = limits.max_pairs
        max_frame = limits.max_frame_bytes
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
        self._version = version
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
            # with the frame-size limit. Slices past the end only truncate and are dropped.
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
            if extent - pos > max_frame:
                raise LumberjackLimit("D frame over max_frame_bytes", reason="frame_too_large")
            if extent > end:
                self._need = extent - pos
                return -pos - 1
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
            payload = dumps(obj)
            # The record encoding, inlined as in the J path of _parse.
            entry = kv_cache.get((version, stream, topic))
            if entry is None:
                entry = self._cache_entry((version, _CT_KV, stream, topic))
                kv_cache[(version, stream, topic)] = entry
            mid, mid_len, ls, lt = entry
            plen = len(payload)
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
            self._nbytes += rec_size + mid_len + plen
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
                self._close_window(final=True)
            else:
                self._in_window = in_window
                if self._nbytes >= max_batch:
                    self._close_window(final=False)
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

    def _close_window(self, *, final: bool) -> Window:
        parts = self._parts
        batch = EncodedBatch(len(parts) // 3, b"".join(parts))
        parts.clear()  # in place: _parse holds a reference to this list
        self._nbytes = 0
        self.events_total += batch.count
        ack: int | None = None
        if final:
            ack = self._high
            self._count = 0
        # else: the window stays open and later parts still count towards its size.
        window = Window(batch, ack, self._version)
        self._events.append(window)
        return window


class _Inflating:
    """A top-level C frame being inflated: its zlib state, the compressed bytes not yet fed
    to it, and the inflated bytes not yet parsed (the start of an incomplete frame)."""

    __slots__ = ("decomp", "pending", "tail")

    def __init__(self, compressed: bytes) -> None:
        self.decomp = zlib.decompressobj()
        self.pending = compressed
        self.tail = b""


# A window of Filebeat's inflates to about 1 MiB: one zlib call returns it as bytes (the fast
# type to parse). A larger output goes on growing in one bytearray, STEP at a time: a single
# bounded call builds its result in blocks and then copies them into one bytes object, twice
# the bound at its peak (a 64 MiB bomb cost 128 MiB).
_INFLATE_FIRST = 4 * 1024 * 1024
_INFLATE_STEP = 1024 * 1024


def _inflate(data: memoryview, limit: int, bound: int) -> bytes | bytearray:
    """zlib-decode with an output bound: a bomb stops within one step past ``limit``.

    ``limit`` is what the enclosing top-level C frame has left of ``bound``.
    """
    decomp = zlib.decompressobj()
    try:
        first = decomp.decompress(data, min(limit + 1, _INFLATE_FIRST))
        out: bytes | bytearray = first
        if not decomp.eof and len(first) <= limit:
            grown = bytearray(first)
            del first, out
            pending = decomp.unconsumed_tail
            while True:
                piece = decomp.decompress(pending, _INFLATE_STEP)
                grown += piece
                if len(grown) > limit:
                    break
                pending = decomp.unconsumed_tail
                if decomp.eof or (not pending and len(piece) < _INFLATE_STEP):
                    break
            out = grown
    except zlib.error as exc:
        raise LumberjackError(f"C payload is not zlib: {exc}", reason="bad_compressed") from None
    if len(out) > limit:
        raise LumberjackLimit(
            f"C frame (with the C frames inside it) inflates past {bound} bytes",
            reason="decompressed_too_large",
        )
    if not decomp.eof:
        raise LumberjackError("C payload is a truncated zlib stream", reason="bad_compressed")
    if decomp.unused_data:
        raise LumberjackError("bytes after the zlib stream in a C frame", reason="bad_compressed")
    return out
