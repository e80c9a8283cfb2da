"""The receiving side of one Lumberjack connection: bytes in, journal batches and acks out.

``ServerConnection.receive_data(data, now_ns)`` parses every complete frame, maps data frames
straight into the journal's record encoding (no per-event objects) and returns a
:class:`Window` for each batch that is ready; the glue submits ``window.batch`` to the hub and,
once it is durable, sends ``encode_ack(window.version, window.ack_seq)``. ``flush()`` closes
the open batch when the connection goes idle (streaming v1 clients never finish a window).

Memory is bounded by what is in flight, never by the size of a window or a frame (issue 24):

* a ``C`` frame is never whole in memory: its compressed bytes are fed to a zlib stream as
  they arrive, inflated a piece at a time and parsed as frames complete (nested ``C`` frames
  the same way, a stack of streams, :mod:`.inflating`); only one event must be whole
  (``max_event_bytes``, the one size bound), because the journal stores it whole;
* the glue grants the room first: ``room`` (journal record bytes it may add, reserved from
  the hub's pending bytes) and ``inflate_room`` (inflated bytes it may hold). When the next
  event does not fit, the decoder stops before it (``stalled``, ``room_wanted`` /
  ``inflate_wanted``) and waits for ``receive_data(b"")``; before the glue waits for room, it
  takes the open batch (``hand_over``) so what it holds can be committed;
* a large window is journaled in parts (``max_batch_bytes``); on v2 each part carries a
  partial ack, so the sender resends only what was not committed if the connection ends.

A window is refused as soon as something in it is wrong; the events before the bad one are
handed over (``exc.windows``) to be committed and, on v2, acknowledged before the close. Each
part of a window that is not complete carries the *fingerprints* of its events; the glue keeps
those of a window whose connection ended, and gives them back (``resend``) to the next
connections from the same sender: a resent window whose first events match them skips those
(already stored) and acknowledges them, so a refused or cut-off window is stored once across
resends even by a sender that never saw the partial ack. Decisions on the seed's ambiguities
are in ``docs/protocols/lumberjack.md``.

Given ``kernels`` (the compiled window kernel, ``taproom.servers.lumberjack.kernel``; None is
the pure-Python path), runs of ``J`` frames are recorded in C: the kernel takes only frames this
module's own path would store, writes the same records, and stops before any other, which this
module then handles as without it (issue 32).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import orjson

from ...eventtime import EventTimes
from ...records import EncodedBatch
from .batch import OpenBatch
from .frames import _HALF, _U32, _U32X2, SEQ_MASK, LumberjackError, LumberjackLimit
from .inflating import INFLATE_IN, INFLATE_MIN, INFLATE_STEP, Level
from .window import (
    _ATTRS,
    _CT_JSON,
    _KERNEL_HANDS_OVER,
    _MAX_NAME_CHARS,
    _REC_AFTER_LEN,
    _REC_HEAD,
    _T_A,
    _T_C,
    _T_D,
    _T_J,
    _T_W,
    _UNBOUNDED,
    _VER1,
    _VER2,
    STALL_INFLATE,
    STALL_ROOM,
    Limits,
    ResendMemory,
    Window,
    WindowKernels,
    _compile_paths,
    _JSONDecodeError,
    fingerprint,
)

__all__ = ["STALL_INFLATE", "STALL_ROOM", "Limits", "ServerConnection", "Window", "fingerprint"]

# A J payload this large is parsed as a view of the frame before it is copied (one step of
# inflating: smaller ones are the hot path, where a slice of bytes parses fastest).
_LARGE_PAYLOAD = INFLATE_STEP


class ServerConnection(OpenBatch):
    """The receiving side of one connection.

    ``producer`` goes into every record (peer ``ip:port`` or TLS subject CN). ``stream_fields``
    and ``topic_fields`` are dotted paths tried in order; the first non-empty string wins. In
    ``D`` frames, whose keys are flat, a path is looked up as one literal key.

    Without a budget (``room`` and ``inflate_room`` left unbounded) it parses whatever it is
    given; the server sets both to what it reserved.
    """

    __slots__ = (
        "_buf",
        "_inflated",
        "_kernel",
        "_kernel_tail",
        "_next",
        "_next_at",
        "_pushed",
        "_stream_paths",
        "_topic_paths",
        "inflate_room",
        "inflate_wanted",
    )

    def __init__(
        self,
        producer: str = "",
        *,
        limits: Limits | None = None,
        stream_fields: Sequence[str] = ("fields.app", "beat.name", "agent.name"),
        topic_fields: Sequence[str] = ("type", "fields.type"),
        kernels: WindowKernels | None = None,
    ) -> None:
        self._limits = limits or Limits()
        self._producer = producer.encode("utf-8", "replace")[:65535]
        self._stream_paths = _compile_paths(stream_fields)
        self._topic_paths = _compile_paths(topic_fields)
        self._stream_keys = tuple(p for p in stream_fields if p)
        self._topic_keys = tuple(p for p in topic_fields if p)
        # Raw bytes not in a C frame (an incomplete frame, or after one): a read's bytes as they
        # came (parsed in place), or a bytearray while a large frame grows.
        self._buf: bytes | bytearray = b""
        # A read whose head completed the J frame in _buf: parsed from _next_at where it is,
        # once that frame is (see _take); None between calls.
        self._next: bytes | None = None
        self._next_at = 0
        self._need = 0  # bytes the incomplete frame at the top needs, as far as known
        self._more = False  # complete frames (or inflatable bytes) left for the next call
        self._pushed = False  # _parse stopped at a C frame's header: parse inside it
        self._inflated = False  # this call entered a top-level C frame
        self._levels: list[Level] = []  # C frames being read, outermost first
        self._in_c_window_done = False  # the window ended inside the current top-level C
        self._window_size = 0  # 0: no W seen yet, windows close at max_window or idle
        self._version = _VER2
        self._count = 0  # data frames not yet acknowledged in a returned Window
        # Data frames since the sender's window began: windows close on the sender's
        # boundaries even after an idle flush acknowledged part of one.
        self._in_window = 0
        self._high = 0
        self._parts: list[bytes | bytearray] = []  # records of the open batch, in pieces
        self._records = 0  # how many
        self._nbytes = 0  # journal bytes of the open batch (self._parts)
        # The compiled window kernel, when the glue gives one (taproom.servers.lumberjack.kernel)
        # and it fits the paths: it takes runs of J frames it is certain of, Python the rest.
        self._kernel = kernels.for_paths(stream_fields, topic_fields) if kernels else None
        self._kernel_tail = {v: self._producer + attrs for v, attrs in _ATTRS.items()}
        self._received_ns = 0
        self._events: list[Window] = []
        self._json_cache: dict[tuple[int, str, str], tuple[bytes, int, int, int]] = {}
        self._kv_cache: dict[tuple[int, str, str], tuple[bytes, int, int, int]] = {}
        # Resend recognition: the glue's remembered windows of this sender, by the
        # fingerprint of their first event; matched from the first event of each window.
        self.resend: ResendMemory | Mapping[int, Sequence[int]] | None = None
        self._matching = False
        self._match: Sequence[int] | None = None
        self._match_key = 0
        self._match_at = 0
        self._skipped: list[int] = []
        self.events_total = 0
        # Each event's ``@timestamp`` (ISO 8601 text, as Beats and Logstash write it) becomes
        # the record's ts_ns by the event-time rule; ``times.out_of_range`` counts the ones the
        # journal cannot hold (year 9999 or 0001), stored absent. The server reads and resets it.
        self.times = EventTimes()
        # The budget, granted by the glue before the bytes are made.
        self.room = _UNBOUNDED  # journal record bytes this connection may still add
        self.inflate_room = _UNBOUNDED  # inflated bytes it may hold at once
        self.stalled = 0  # STALL_ROOM / STALL_INFLATE: why the last call stopped early
        self.room_wanted = 0
        self.inflate_wanted = 0

    # -- public API ---------------------------------------------------------------------------

    @property
    def pending_events(self) -> int:
        """Data frames received and not yet acknowledged in a returned window."""
        return self._count

    @property
    def open_batch_bytes(self) -> int:
        """Journal bytes of events parsed into the batch not yet returned."""
        return self._nbytes

    @property
    def raw_bytes(self) -> int:
        """Received bytes held, not yet parsed or inflated: an incomplete frame, frames after
        a ``C`` frame, and the compressed bytes of the ``C`` frame being read."""
        levels = self._levels
        return len(self._buf) + (levels[0].pending if levels else 0)

    @property
    def inflated_bytes(self) -> int:
        """Inflated bytes held, not yet parsed (the start of an incomplete frame inside a ``C``
        frame, and the compressed bytes of nested ones)."""
        levels = self._levels
        if not levels:
            return 0
        return sum(level.held() for level in levels) + sum(lv.pending for lv in levels[1:])

    @property
    def inflate_needed(self) -> int:
        """Inflated bytes this connection will hold to finish the frame it is completing
        inside a ``C`` frame (its size is known from its header): what the glue keeps
        reserved for it between steps; ``inflated_bytes`` when there is no such frame."""
        held = self.inflated_bytes
        levels = self._levels
        if levels and levels[-1].tail and self._need > levels[-1].held():
            return held + self._need - levels[-1].held()
        return held

    @property
    def buffered_bytes(self) -> int:
        """Everything held for a later call except the open batch: raw and inflated bytes."""
        return self.raw_bytes + self.inflated_bytes

    @property
    def incomplete_frame_bytes(self) -> int:
        """The whole size of the incomplete frame being received outside any ``C`` frame, as
        far as its header tells (a ``D`` frame's grows as its pairs arrive); 0 when none is."""
        if self._levels or not self._buf or self._more:
            return 0
        return max(self._need, len(self._buf))

    @property
    def more_buffered(self) -> bool:
        """Complete frames or inflatable bytes are buffered: call ``receive_data(b"", now_ns)``
        for them (after granting what ``stalled`` asks for, if set).

        One call enters at most one top-level ``C`` frame (a window for real senders), and
        stops inside a ``C`` frame once a batch is ready: what one call produces is about one
        batch (``max_batch_bytes``, or one event larger than that).
        """
        return self._more

    @property
    def version(self) -> int:
        """Version byte of the latest frame (acks and keepalives answer in it)."""
        return self._version

    def receive_data(self, data: bytes, now_ns: int) -> list[Window]:
        """Parse ``data``; return the batches it completed, in order (see ``more_buffered``)."""
        self._received_ns = now_ns
        events: list[Window] = []
        self._events = events
        self._more = self._inflated = False
        self.stalled = 0
        try:
            if data:
                self._take(data)
            self._run()
        except (LumberjackError, LumberjackLimit) as exc:
            if self._count:
                # What the window had before the bad frame: committed and (v2) acknowledged
                # before the close, so the sender resends only the rest.
                self._close_window("refused")
            exc.windows = events
            self._buf = b""
            self._next = None
            self._levels = []
            raise
        finally:
            self._events = []  # the caller owns the windows now: hold no batch past the call
            if self._next is not None:  # an error before the read's rest was parsed: kept
                self._buf = self._buf + self._next[self._next_at :]
                self._next = None
        return events

    def hand_over(self) -> Window | None:
        """The open batch as a part of its window, if it has events (v2: with a partial ack).

        For the glue before it waits for room: waiting while holding a batch could wait
        forever (everyone's room held by open batches); handed over, it is committed and its
        room freed.
        """
        if not self._nbytes:
            return None
        window = self._close_window("part")
        self._events = []
        return window

    def flush(self, *, ending: bool = False) -> Window | None:
        """Acknowledge the open window's frames so far (the connection went idle), or hand
        them over unacknowledged on v1 when the input ends inside a ``C`` frame (``ending``).

        The sender's window stays open: it still closes after ``W`` frames in total. Inside a
        ``C`` frame nothing is flushed while the connection lives: the sender is mid-frame (a
        v1 sender would take the ack for its whole window). Returns None when nothing is due.
        """
        if not self._count:
            return None
        if self._levels:
            if not ending:
                return None
            window = self._close_window("refused")
            self._events = []
            return window
        window = self._close_window("flush")
        self._events = []
        return window

    # -- input --------------------------------------------------------------------------------

    def _take(self, data: bytes) -> None:
        """Received bytes: the compressed ones of the C frame being read go to its stream, the
        rest waits in ``_buf`` (it is parsed once that C frame ends)."""
        levels = self._levels
        if levels and levels[0].remaining:
            level = levels[0]
            n = level.remaining
            taken = data if len(data) <= n else data[:n]
            if level.pending:
                level.inbuf = level.inbuf[level.inpos :] + taken
            else:
                level.inbuf = taken
            level.inpos = 0
            level.remaining = n - len(taken)
            if len(data) <= n:
                return
            data = data[n:]
        buf = self._buf
        if not buf:
            self._buf = data if type(data) is bytes else bytes(data)  # parsed where it is
        elif (
            not levels
            and type(buf) is bytes
            and type(data) is bytes
            and len(buf) >= 10
            and buf[1] == _T_J
            and len(buf) < self._need <= len(buf) + len(data)
            and len(buf) <= len(data)
        ):
            # The end of a J frame and the next frames, as a read of a stream of them mostly
            # is: the frame is completed from the read's head (a copy of one event), the rest
            # of the read parsed where it is (_run), not the whole read copied behind it.
            at = self._need - len(buf)
            self._buf = buf + data[:at]
            self._next = data
            self._next_at = at
        elif type(buf) is bytes and len(buf) <= len(data):
            # The start of a frame and a read at least as large: one copy (the buffer doubles
            # at least, so a frame arriving in pieces is copied a bounded number of times).
            self._buf = buf + data
        else:
            if type(buf) is bytes:
                buf = bytearray(buf)
            buf += data
            self._buf = buf

    def _run(self) -> None:
        """Parse and inflate until more input, more room or the next call is needed."""
        levels = self._levels
        inflated = 0  # bytes inflated in this call: one call does a bounded amount of work
        while True:
            if not levels:
                buf = self._buf
                if not buf or len(buf) < self._need or self._more:
                    return
                # Parsed as bytes (not a memoryview: markedly faster for the many small slices
                # of D and J frames); a read's own bytes are parsed without a copy.
                data = buf if type(buf) is bytes else bytes(buf)
                self._pushed = False
                pos = self._parse(data, 0, len(data), 0)
                following = self._next
                if following is not None:
                    # _buf was a J frame completed from the head of this read (_take)
                    self._next = None
                    at = self._next_at
                    if pos == len(data) and not self.stalled:
                        data = following  # the frame is stored: the read from where it was
                        pos = self._parse(data, at, len(data), 0)
                    else:
                        data = data[pos:] + following[at:]  # it waits (room): held as one
                        pos = 0
                self._buf = data[pos:] if pos < len(data) else b""
                if not self._pushed:
                    if not self._buf:
                        self._need = 0
                    return
                continue
            top = levels[-1]
            if top.tail and top.held() >= self._need:
                # A large frame inflated a step at a time (a bytearray of its size) is whole
                # now. A large J frame is parsed from the bytearray itself: _parse reads its
                # payload through a view and copies it to bytes once it is a JSON object (a
                # zlib bomb's 12 MiB event is refused with no copy of ours beside the frame;
                # orjson's error makes one). Any other frame, sliced as it is parsed, is
                # copied to bytes once and the bytearray let go before parsing.
                tail = top.tail
                if type(tail) is not bytes and (
                    tail[1] != _T_J or self._matching or len(tail) - 10 < _LARGE_PAYLOAD
                ):
                    top.tail = tail = bytes(tail)
                self._pushed = False
                pos = self._parse(cast(bytes, tail), 0, len(tail), len(levels))
                if pos:
                    top.tail = tail[pos:] if pos < len(tail) else b""
                del tail
                if self._pushed:
                    continue
                if self.stalled or self._more:
                    self._more = True
                    return
            if top.decomp.eof:
                if top.tail:
                    raise LumberjackError(
                        "C content ends inside a frame", reason="truncated_compressed"
                    )
                levels.pop()
                self._need = 0
                if not levels:
                    self._in_c_window_done = False
                continue
            if inflated and (self._events or inflated >= INFLATE_STEP):
                # A batch is ready, or a step's worth was inflated: stop inside the C frame,
                # so the glue submits the batch before more is inflated, and other connections
                # (and /health) get the loop between steps.
                self._more = True
                return
            produced = self._inflate(len(levels) - 1)
            if produced < 0:
                return
            inflated += produced or 1

    def _inflate(self, index: int) -> int:
        """Inflate a piece of ``levels[index]`` (feeding it from the level below, inflating that
        first if need be): the bytes it made, or -1 when more input or more room is needed."""
        levels = self._levels
        level = levels[index]
        if not level.pending:
            if not level.remaining:
                raise LumberjackError(
                    "C payload is a truncated zlib stream", reason="bad_compressed"
                )
            if index == 0:
                return -1  # the rest of the compressed bytes is still on its way
            below = levels[index - 1]
            if not below.tail and self._inflate(index - 1) < 0:
                return -1
            n = min(level.remaining, len(below.tail))
            level.inbuf = below.tail[:n]
            level.inpos = 0
            below.tail = below.tail[n:]
            level.remaining -= n
        top = index == len(levels) - 1
        tail_len = level.held()
        rest = self._need - tail_len if top and tail_len else 0
        free = self.inflate_room - self.inflated_bytes
        if rest > 0:
            # The frame being completed has its size: room for all of it first (a connection
            # never waits holding half an event it has room for), then a step at a time.
            if free < rest:
                return self._stall_inflate(free, rest)
            want = min(rest, INFLATE_STEP)
        else:
            want = INFLATE_STEP
            if free < want:
                if free < INFLATE_MIN:
                    return self._stall_inflate(free, want)
                want = free
        try:
            chunk = memoryview(level.inbuf)[level.inpos : level.inpos + INFLATE_IN]
            piece = level.decomp.decompress(chunk, want)
        except Exception as exc:  # zlib_ng.error
            raise LumberjackError(
                f"C payload is not zlib: {exc}", reason="bad_compressed"
            ) from None
        level.inpos += len(chunk) - len(level.decomp.unconsumed_tail)
        if level.inpos >= len(level.inbuf):
            level.inbuf = b""
            level.inpos = 0
        if level.decomp.unused_data or (level.decomp.eof and (level.remaining or level.pending)):
            raise LumberjackError(
                "bytes after the zlib stream in a C frame", reason="bad_compressed"
            )
        if piece:
            if not tail_len:
                level.tail = piece
            elif type(level.tail) is bytearray:
                end = tail_len + len(piece)  # at most the frame's size: want <= rest
                level.tail[tail_len:end] = piece
                level.fill = end
            elif rest > len(piece):
                # A large frame: a bytearray of its whole size, filled in place step by step.
                # Grown instead, each resize could copy it (the old and the new block held at
                # once) and leave freed blocks of every size in malloc's heap.
                grown = bytearray(self._need)
                grown[:tail_len] = level.tail
                end = tail_len + len(piece)
                grown[tail_len:end] = piece
                level.fill = end
                level.tail = grown
            else:
                level.tail = level.tail + piece
        return len(piece)

    def _stall_inflate(self, free: int, want: int) -> int:
        self.stalled = STALL_INFLATE
        self.inflate_wanted = self.inflate_room - free + want
        self._more = True
        return -1

    # -- parsing ------------------------------------------------------------------------------

    def _parse(self, view: bytes, pos: int, end: int, depth: int) -> int:
        """Handle complete frames in ``view[pos:end]``; return where it stopped: at an
        incomplete frame (``_need``), after a ``C`` frame's header (``_pushed``), or before an
        event there is no room for (``stalled``)."""
        unpack2 = _U32X2.unpack_from
        unpack1 = _U32.unpack_from
        limits = self._limits
        max_event = limits.max_event_bytes
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
        kernel = self._kernel
        large = _LARGE_PAYLOAD
        python_at = -1  # the frame the kernel stopped before: Python's
        while end - pos >= 2:
            version = view[pos]
            ftype = view[pos + 1]
            if version != ver2 and version != ver1:
                raise LumberjackError(f"unknown version byte {version:#04x}", reason="bad_version")
            if ftype == t_json:
                if (
                    kernel is not None
                    and pos != python_at
                    and not self._matching
                    and not (depth and self._in_c_window_done)
                ):
                    # A run of J frames in C (lumberjack.c); what follows it is handled below.
                    target = self._window_size or max_window
                    res = kernel.run(
                        view,
                        pos,
                        end,
                        version,
                        max_event,
                        self._kernel_tail[version],
                        producer_len,
                        received_ns,
                        target - self._in_window,
                        max_batch - self._nbytes,
                        self.room,
                        self._count,
                        self._high,
                    )
                    taken = res.events
                    if res.stop in _KERNEL_HANDS_OVER:
                        python_at = res.pos
                    if taken:
                        size = res.out_bytes
                        parts.append(kernel.records())
                        self._records += taken
                        self.room -= size
                        self._nbytes += size
                        self._version = version
                        self._count = res.count
                        self._high = res.high
                        pos = res.pos
                        in_window = self._in_window + taken
                        if in_window >= target:
                            self._in_window = 0
                            self._close_window("done")
                            if depth:
                                self._in_c_window_done = self._window_size > 0
                        else:
                            self._in_window = in_window
                            if self._nbytes >= max_batch:
                                self._close_window("part")
                        continue
                if end - pos < 10:
                    self._need = 10
                    return pos
                seq, length = unpack2(view, pos + 2)
                if length > max_event:
                    raise LumberjackLimit(
                        f"J payload of {length} bytes, at most {max_event} (max_event_bytes)",
                        reason="frame_too_large",
                    )
                if length == 0:
                    raise LumberjackError("J frame with an empty payload", reason="empty_json")
                fend = pos + 10 + length
                if fend > end:
                    self._need = fend - pos
                    return pos
                if depth and self._in_c_window_done:
                    raise LumberjackError(
                        f"more events in a C frame than its window of {self._window_size}",
                        reason="window_overrun",
                    )
                if length < large or self._matching:
                    payload = view[pos + 10 : fend]
                    if self._matching and self._resent(seq, payload):
                        self._version = version
                        self._counted(seq)
                        pos = fend
                        continue
                    text: bytes | memoryview = payload
                else:
                    # A large payload is parsed from a view and copied only once it is an
                    # object: a bomb's is refused without a copy beside orjson's own.
                    text = memoryview(view)[pos + 10 : fend]
                    payload = b""
                try:
                    obj = loads(text)
                except json_error:
                    raise LumberjackError(
                        "J payload is not valid JSON", reason="bad_json"
                    ) from None
                if not payload:  # large (an empty payload was refused above)
                    payload = bytes(text)  # bytes, also when ``view`` is a frame's bytearray
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
                # The record encoding, inlined (the hottest path of the hub): head, then the
                # cached constant middle (protocol, content type, stream, topic, producer,
                # attrs), then the payload as received.
                entry = json_cache.get((version, stream, topic))
                if entry is None:
                    entry = self._cache_entry((version, _CT_JSON, stream, topic))
                    json_cache[(version, stream, topic)] = entry
                mid, mid_len, ls, lt = entry
                size = rec_size + mid_len + length
                if size > self.room:
                    self._stall_room(size)
                    return pos
                self.room -= size
                self._version = version
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
                pos = fend
            elif ftype == _T_D:
                pos = self._data_frames(view, pos, end, version, depth)
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
                    self._close_window("done")
                self._version = version
                self._window_size = size
                self._in_window = 0
                self._in_c_window_done = False
                self._matching = bool(self.resend)
                self._match = None
                if size == 0:
                    # Nothing will follow in this window; acknowledge it as such.
                    self._events.append(Window(EncodedBatch(0, b""), 0, version))
                pos += 6
            elif ftype == _T_C:
                if end - pos < 6:
                    self._need = 6
                    return pos
                if len(self._levels) >= limits.max_nesting:
                    raise LumberjackLimit(
                        f"C frames nested deeper than {limits.max_nesting}",
                        reason="nesting_too_deep",
                    )
                if not depth:
                    if self._inflated:
                        self._more = True  # one top-level C frame per call
                        self._need = 0
                        return pos
                    self._inflated = True
                (length,) = unpack1(view, pos + 2)
                if length == 0:
                    raise LumberjackError("C frame with no zlib stream", reason="bad_compressed")
                self._version = version
                # No bound on the length: the frame is streamed, never held whole.
                level = Level(length)
                start = pos + 6
                taken = min(length, end - start)
                level.inbuf = view[start : start + taken]
                level.remaining = length - taken
                self._levels.append(level)
                self._pushed = True
                self._need = 0
                return start + taken
            elif ftype == _T_A:
                raise LumberjackError("A frames are sent by readers only", reason="unexpected_ack")
            else:
                raise LumberjackError(f"unknown frame type {ftype:#04x}", reason="bad_frame_type")
        self._need = 2
        return pos
