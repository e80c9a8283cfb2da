"""Journal segments to Arrow record batches, without a Python object per field.

The Spark source spends its time here, so this module decodes the record layout documented in
:mod:`taproom.records` column-wise: one tight loop finds where each record starts (the only
per-record Python work), numpy gathers the fixed headers of all records at once, and every
variable-length field becomes an Arrow *view* array pointing into the batch body, which Arrow's
C++ cast then compacts into an ordinary string/binary column. ``attrs`` is the exception: it is
JSON and parsed per record, but only for records that carry any (most carry none).

Reading segments (:func:`iter_chunks`) follows :class:`taproom.journal.JournalReader`'s rules
(one walker, :func:`taproom.journal.segments.walk_frames`): frames are CRC-checked; damage at
the end of the last segment is "still being written" and reading stops there; any other damage
is skipped and its offsets are a gap, never renumbered. Planning (:func:`scan_frames`) reads
frame headers only, so splitting a journal into partitions costs one small ``pread`` per batch.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import orjson
import pyarrow as pa
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import CorruptSegment
from ..journal.segments import (
    FRAME,
    SEGMENT_HEADER,
    Damage,
    crc_of,
    segment_bases,
    segment_name,
    walk_frames,
)

__all__ = [
    "ARROW_SCHEMA",
    "FrameRef",
    "decode_records",
    "iter_batches",
    "iter_chunks",
    "join_batches",
    "journal_start",
    "scan_frames",
    "segment_bases",
]

# The record header of taproom.records: "<IqqQBBHHHHII", 46 bytes, little-endian, unpadded.
_HEAD_FIELDS = (
    ("length", "<u4", 0),
    ("received_ns", "<i8", 4),
    ("ts_ns", "<i8", 12),
    ("seq", "<u8", 20),
    ("lp", "u1", 28),
    ("lc", "u1", 29),
    ("ls", "<u2", 30),
    ("lt", "<u2", 32),
    ("lr", "<u2", 34),
    ("le", "<u2", 36),
    ("la", "<u4", 38),
    ("ll", "<u4", 42),
)
_HEAD_DTYPE = np.dtype(
    {
        "names": [f[0] for f in _HEAD_FIELDS],
        "formats": [f[1] for f in _HEAD_FIELDS],
        "offsets": [f[2] for f in _HEAD_FIELDS],
        "itemsize": 46,
    }
)
_HEAD_SIZE = 46
_HEAD_AFTER_LEN = _HEAD_SIZE - 4
_U32 = struct.Struct("<I")
# Chunks handed to Arrow stay well under 2 GiB: view offsets are int32.
_MAX_CHUNK_BYTES = 1 << 30

ATTRS_TYPE = pa.map_(pa.string(), pa.string())
ARROW_SCHEMA = pa.schema(
    [
        pa.field("journal", pa.string(), False),
        pa.field("offset", pa.int64(), False),
        pa.field("received", pa.timestamp("us", tz="UTC"), False),
        pa.field("protocol", pa.string(), False),
        pa.field("stream", pa.string(), False),
        pa.field("topic", pa.string(), False),
        pa.field("producer", pa.string(), False),
        pa.field("seq", pa.int64(), False),
        pa.field("event_id", pa.string(), False),
        pa.field("ts", pa.timestamp("us", tz="UTC"), True),
        pa.field("content_type", pa.string(), False),
        pa.field("payload", pa.binary(), False),
        pa.field("attrs", ATTRS_TYPE, False),
    ]
)


def _record_starts(body: bytes) -> np.ndarray:
    """Start position of every record: the one loop that has to touch each record."""
    starts: list[int] = []
    append = starts.append
    unpack = _U32.unpack_from
    pos = 0
    end = len(body)
    limit = end - _HEAD_SIZE
    while pos < end:
        if pos > limit:
            raise ValueError("truncated record header")
        append(pos)
        pos += 4 + unpack(body, pos)[0]
    if pos != end:
        raise ValueError("record length mismatch")
    return np.asarray(starts, dtype=np.int64)


def _views(buf: np.ndarray, positions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Arrow binary-view structs (16 bytes each) for values at ``positions`` in ``buf``.

    Values of at most 12 bytes are stored inline, longer ones as prefix +
    buffer 0 + offset, exactly as the Arrow columnar format defines views.
    """
    n = len(positions)
    out = np.empty((n, 16), dtype=np.uint8)
    if n == 0:
        return out
    # Inline values keep whatever bytes follow them instead of zero padding: every view
    # array here is cast to a plain string/binary column at once, and the cast copies only
    # ``length`` bytes of each value.
    out[:, 4:16] = sliding_window_view(buf, 12)[positions]
    words = out.view("<i4")
    words[:, 0] = lengths
    long_rows = lengths > 12
    if long_rows.any():
        words[long_rows, 2] = 0
        words[long_rows, 3] = positions[long_rows]
    return out


def _column(
    buf: np.ndarray, data: pa.Buffer, positions: np.ndarray, lengths: np.ndarray, text: bool
) -> pa.Array:
    views = _views(buf, positions, lengths)
    typ = pa.string_view() if text else pa.binary_view()
    arr = pa.Array.from_buffers(typ, len(positions), [None, pa.py_buffer(views), data])
    if not text:
        return arr.cast(pa.binary())
    try:
        return arr.cast(pa.string())
    except pa.ArrowInvalid:
        # Fields are stored with surrogateescape; bytes that are not UTF-8 are shown with
        # U+FFFD here rather than failing the whole batch.
        raw = arr.cast(pa.binary()).to_pylist()
        return pa.array([v.decode("utf-8", "replace") for v in raw], pa.string())


def _attrs(body: bytes, positions: np.ndarray, lengths: np.ndarray) -> pa.Array:
    n = len(positions)
    present = np.flatnonzero(lengths)
    if len(present) == 0:
        offsets = pa.array(np.zeros(n + 1, dtype=np.int32))
        return pa.MapArray.from_arrays(
            offsets, pa.array([], pa.string()), pa.array([], pa.string())
        )
    sizes = np.zeros(n, dtype=np.int32)
    keys: list[str] = []
    items: list[str] = []
    for i in present.tolist():
        p = int(positions[i])
        try:
            obj = orjson.loads(body[p : p + int(lengths[i])])
        except orjson.JSONDecodeError:
            obj = {}
        if isinstance(obj, dict):
            sizes[i] = len(obj)
            for k, v in obj.items():
                keys.append(str(k))
                items.append(v if isinstance(v, str) else str(v))
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    return pa.MapArray.from_arrays(
        pa.array(offsets), pa.array(keys, pa.string()), pa.array(items, pa.string())
    )


def decode_records(
    body: bytes,
    first_offset: int,
    lo: int,
    hi: int,
    journal: str,
    columns: Sequence[str] | None = None,
) -> pa.RecordBatch | None:
    """Records of ``body`` (one or more batch bodies back to back, offsets from
    ``first_offset``) whose offsets fall in ``[lo, hi)``, as one Arrow record batch with
    ``columns`` (default: all of :data:`ARROW_SCHEMA`, in its order); columns not asked for
    are never built."""
    if len(body) >= _MAX_CHUNK_BYTES:
        raise ValueError("chunk too large for one Arrow batch")
    starts = _record_starts(body)
    total = len(starts)
    keep_from = max(0, lo - first_offset)
    keep_to = min(total, hi - first_offset)
    if keep_to <= keep_from:
        return None
    starts = starts[keep_from:keep_to]
    n = len(starts)
    # Padding lets the fixed-width gathers run past the last record without a bounds check.
    padded = body + bytes(_HEAD_SIZE + 16)
    buf = np.frombuffer(padded, dtype=np.uint8)
    data = pa.py_buffer(padded)
    head = sliding_window_view(buf, _HEAD_SIZE)[starts].view(_HEAD_DTYPE).reshape(n)
    names = ("lp", "lc", "ls", "lt", "lr", "le", "la", "ll")
    lengths = [head[name].astype(np.int64) for name in names]
    if not np.array_equal(head["length"].astype(np.int64), _HEAD_AFTER_LEN + sum(lengths)):
        raise ValueError("record length mismatch")
    positions = []
    pos = starts + _HEAD_SIZE
    for length in lengths:
        positions.append(pos)
        pos = pos + length
    text_fields = {
        "protocol": 0,
        "content_type": 1,
        "stream": 2,
        "topic": 3,
        "producer": 4,
        "event_id": 5,
    }

    def build(name: str) -> pa.Array:
        if name in text_fields:
            k = text_fields[name]
            return _column(buf, data, positions[k], lengths[k], True)
        if name == "payload":
            return _column(buf, data, positions[7], lengths[7], False)
        if name == "attrs":
            return _attrs(body, positions[6], lengths[6])
        if name == "offset":
            return pa.array(
                np.arange(first_offset + keep_from, first_offset + keep_to, dtype=np.int64)
            )
        if name in ("received", "ts"):
            ns = head["received_ns" if name == "received" else "ts_ns"]
            mask = None if name == "received" else ns == 0
            return pa.array(ns // 1000, pa.int64(), mask=mask).cast(pa.timestamp("us", tz="UTC"))
        if name == "seq":
            return pa.array(head["seq"].view(np.int64), pa.int64())
        if name == "journal":
            return pa.repeat(pa.scalar(journal, pa.string()), n)
        raise ValueError(f"no column {name!r}")

    schema = (
        ARROW_SCHEMA if columns is None else pa.schema([ARROW_SCHEMA.field(c) for c in columns])
    )
    return pa.RecordBatch.from_arrays([build(f.name) for f in schema], schema=schema)


# --- segments ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrameRef:
    """Where one batch frame sits: enough to start reading there without scanning."""

    segment: int  # base offset of the segment file
    position: int  # file position of the frame header
    base_offset: int
    count: int
    length: int  # body length


def _segment_path(path: str, base: int) -> str:
    return os.path.join(path, segment_name(base))


def journal_start(path: str) -> int:
    """First offset still on disk (retention may have deleted older segments)."""
    bases = segment_bases(path)
    return bases[0] if bases else 0


def scan_frames(path: str, lo: int = 0, hi: int | None = None) -> list[FrameRef]:
    """Frame headers overlapping ``[lo, hi)``, walking past damage as the journal does.

    Only headers are read; bodies are CRC-checked by :func:`iter_chunks` when read (frames
    found by resynchronising after damage are checked here already). Damage at the end of the
    last segment ends the list (it is being written); any other damage is skipped: its offsets
    are a gap between the frames listed.
    """
    bases = segment_bases(path)
    frames: list[FrameRef] = []
    for i, base in enumerate(bases):
        nxt = bases[i + 1] if i + 1 < len(bases) else None
        if hi is not None and base >= hi:
            break
        if nxt is not None and nxt <= lo:
            continue
        try:
            fd = os.open(_segment_path(path, base), os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            size = os.fstat(fd).st_size
            for item in walk_frames(
                fd, segment_name(base), SEGMENT_HEADER.size, base, size, verify=False, end_bound=nxt
            ):
                if isinstance(item, Damage):
                    continue  # at_end is the last item: the walk ends by itself
                if hi is not None and item.base_offset >= hi:
                    break
                if item.end_offset <= lo:
                    continue
                frames.append(
                    FrameRef(base, item.position, item.base_offset, item.count, item.body_length)
                )
        finally:
            os.close(fd)
    return frames


def verified_end(path: str, frames: list[FrameRef]) -> int:
    """End offset of the last of ``frames`` whose body passes its CRC (-1 if none does).

    The planner of a streaming micro-batch promises these offsets to Spark, so it checks the
    frames it has not promised before. A frame that fails with a later frame passing is
    damage (the reader skips it); one that fails with none passing after it may be a batch in
    flight in the last segment, so the promise stops before it.
    """
    end = -1
    fd = -1
    current = -1
    try:
        for frame in frames:
            if frame.segment != current:
                if fd >= 0:
                    os.close(fd)
                fd = os.open(_segment_path(path, frame.segment), os.O_RDONLY)
                current = frame.segment
            raw = os.pread(fd, FRAME.size + frame.length, frame.position)
            length, crc, base, count = FRAME.unpack_from(raw)
            body = raw[FRAME.size :]
            if len(body) == length and crc_of(base, count, body) == crc:
                end = base + count
    finally:
        if fd >= 0:
            os.close(fd)
    return end


def iter_batches(path: str, start: FrameRef, hi: int) -> Iterator[tuple[int, int, bytes]]:
    """Verified ``(base, count, body)`` of a journal directory from frame ``start`` on, until
    ``hi``: the local counterpart of :meth:`taproom.journal.remote.HubJournal.read_batches`.
    Damage the walk skips is a gap (the next frame's base does not follow)."""
    bases = segment_bases(path)
    if start.segment not in bases:
        raise CorruptSegment(f"segment {start.segment} vanished", segment=path)
    expected = start.base_offset
    position = start.position
    for i in range(bases.index(start.segment), len(bases)):
        base = bases[i]
        nxt = bases[i + 1] if i + 1 < len(bases) else None
        if base >= hi:
            return
        walk_from = (position, expected) if position else (SEGMENT_HEADER.size, base)
        fd = os.open(_segment_path(path, base), os.O_RDONLY)
        try:
            file_size = os.fstat(fd).st_size
            for item in walk_frames(
                fd, segment_name(base), *walk_from, file_size, verify=True, end_bound=nxt
            ):
                if isinstance(item, Damage):
                    continue
                if item.base_offset >= hi:
                    return
                assert item.body is not None
                yield item.base_offset, item.count, item.body
                expected = item.end_offset
                if expected >= hi:
                    return
        finally:
            os.close(fd)
        position = 0


def join_batches(
    batches: Iterator[tuple[int, int, bytes]], hi: int, chunk_bytes: int = 16 << 20
) -> Iterator[tuple[bytes, int]]:
    """Consecutive batch bodies joined into chunks of about ``chunk_bytes``: yields
    ``(joined bodies, offset of their first record)`` until ``hi``.

    Record encoding is self-delimiting and consecutive frames continue each other's offsets,
    so bodies can be decoded as one long body; a chunk never spans a gap (damage the walk
    skipped, or offsets between segments).
    """
    parts: list[bytes] = []
    size = 0
    first = expected = -1
    for base, count, body in batches:
        if base >= hi:
            break
        if parts and base != expected:
            yield b"".join(parts), first
            parts, size = [], 0
        if not parts:
            first = base
        parts.append(body)
        size += len(body)
        expected = base + count
        if size >= chunk_bytes:
            yield b"".join(parts), first
            parts, size = [], 0
        if expected >= hi:
            break
    if parts:
        yield b"".join(parts), first


def iter_chunks(
    path: str, start: FrameRef, hi: int, chunk_bytes: int = 16 << 20
) -> Iterator[tuple[bytes, int]]:
    """Verified batch bodies of a journal directory from frame ``start`` on, joined into
    chunks (:func:`join_batches`)."""
    return join_batches(iter_batches(path, start, hi), hi, chunk_bytes)
