"""Kegs: Lager's ``*.lgr`` files, written by a keg writer (a mug) and read back.

Layout (seed, "Kegs"), all integers network byte order::

    u16  keg format version (taproom writes 1)
    u64  dataFormatOffset: where the XML starts; 0 while the keg is being recorded
    records, back to back:  uuid (16 bytes) | timestamp ns (u64) | payload (the tap's row)
    UTF-8 XML <keg><formats>...</formats><metadata>...</metadata></keg> at dataFormatOffset

A record has no length: its size comes from the format registered for its uuid. The writer
patches dataFormatOffset only when it stops, so a keg whose writer died has a zero there. To
make such a keg readable the writer keeps a sidecar ``<keg>.format`` (the same XML, replaced
atomically whenever a tap is added, before that tap's first record) while it records;
:func:`read_keg` uses it to recover the records, dropping (and reporting) a torn last record.
nasa/lager's writer leaves the whole header zero (version too) until it stops, and *appends*
the complete ``<keg>`` document to its sidecar at every format it learns: the reader takes the
last complete document (each holds every format so far).

Public, stable API (the Spark keg source uses it): :func:`read_keg` -> :class:`KegContents`
and :class:`KegFileWriter`. File I/O only; no sockets, no clock.
"""

from __future__ import annotations

import os
import re
import struct
import uuid as uuid_module
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import TaproomError
from .formats import DataFormat, FormatError, keg_xml, parse_keg_xml

__all__ = [
    "KEG_VERSION",
    "KegContents",
    "KegError",
    "KegFileWriter",
    "read_keg",
    "sidecar_path",
]

KEG_VERSION = 1
_HEADER = struct.Struct(">HQ")
HEADER_SIZE = _HEADER.size  # 10 bytes
_TS = struct.Struct(">Q")
RECORD_HEAD = 24  # uuid + timestamp


class KegError(TaproomError):
    """A keg that cannot be read (bad header, no formats, unparseable XML)."""


def sidecar_path(path: str | os.PathLike[str]) -> str:
    """The sidecar written while recording: ``<keg>.format`` (as nasa/lager does)."""
    return os.fspath(path) + ".format"


def _uuid_str(raw: bytes) -> str:
    return str(uuid_module.UUID(bytes=bytes(raw)))


def _write_atomically(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class KegFileWriter:
    """Writes one keg. Not thread-safe. ``close()`` appends the XML and patches the header.

    ``fsync`` makes ``flush()`` and ``close()`` durable (a crash after ``flush()`` keeps
    everything written so far).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        formats: Mapping[str, DataFormat] | None = None,
        metadata: Mapping[str, str] | None = None,
        *,
        fsync: bool = True,
        buffer_bytes: int = 1 << 20,
    ) -> None:
        self.path = os.fspath(path)
        self.fsync = fsync
        self.formats: dict[str, DataFormat] = {}
        self._sizes: dict[bytes, int] = {}
        self._packers: dict[bytes, Any] = {}
        self.metadata = dict(metadata or {})
        self.records = 0
        self.closed = False
        self._file = open(self.path, "wb", buffering=buffer_bytes)  # noqa: SIM115
        self._file.write(_HEADER.pack(KEG_VERSION, 0))
        for uuid, fmt in (formats or {}).items():
            self._remember(uuid, fmt)
        self._write_sidecar()
        if fsync:
            self.flush()

    def _remember(self, uuid: str, fmt: DataFormat) -> None:
        key = uuid_module.UUID(uuid)
        self.formats[str(key)] = fmt
        self._sizes[key.bytes] = fmt.row_size
        # One struct per row size packs a whole record in one call (~4x a concatenation).
        self._packers[key.bytes] = struct.Struct(f">16sQ{fmt.row_size}s").pack

    def _write_sidecar(self) -> None:
        _write_atomically(sidecar_path(self.path), keg_xml(self.formats, self.metadata).encode())

    def add_format(self, uuid: str | bytes, fmt: DataFormat) -> None:
        """Make a tap recordable; the sidecar is rewritten before its first record."""
        text = _uuid_str(uuid) if isinstance(uuid, bytes) else str(uuid_module.UUID(uuid))
        known = self.formats.get(text)
        if known is not None and known.row_size != fmt.row_size:
            raise KegError(f"tap {text} changed its row size while recording")
        if known == fmt:
            return
        self._remember(text, fmt)
        self._write_sidecar()

    def has(self, uuid: bytes) -> bool:
        return uuid in self._sizes

    def write(self, uuid: bytes, ts_ns: int, payload: bytes) -> None:
        """One record. The payload must be one row of the tap's format."""
        size = self._sizes.get(uuid)
        if size is None:
            raise KegError(f"tap {_uuid_str(uuid)} has no format in this keg")
        if len(payload) != size:  # struct's "s" would pad or cut silently: check first
            raise FormatError(
                f"row is {len(payload)} bytes, the format needs {size}", reason="payload_size"
            )
        try:
            record = self._packers[uuid](uuid, ts_ns, payload)
        except struct.error:
            raise FormatError(f"timestamp {ts_ns} is not a u64", reason="bad_value") from None
        self._file.write(record)
        self.records += 1

    def write_many(self, uuid: bytes, ts_ns: Any, rows: bytes | memoryview) -> None:
        """Many records of one tap at once: ``ts_ns`` array-like, ``rows`` back to back."""
        size = self._sizes.get(uuid)
        if size is None:
            raise KegError(f"tap {_uuid_str(uuid)} has no format in this keg")
        ts = np.asarray(ts_ns, dtype=np.uint64)
        n = len(ts)
        if len(rows) != n * size:
            raise FormatError(
                f"{len(rows)} bytes are not {n} rows of {size}", reason="payload_size"
            )
        block = np.empty(n, dtype=np.dtype([("u", "V16"), ("t", ">u8"), ("p", f"V{size}")]))
        block["u"] = np.frombuffer(uuid, dtype="V16")[0]
        block["t"] = ts
        block["p"] = np.frombuffer(rows, dtype=f"V{size}")
        self._file.write(block.tobytes())
        self.records += n

    def flush(self) -> None:
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Append the XML, patch dataFormatOffset, remove the sidecar."""
        if self.closed:
            return
        self.closed = True
        self._file.flush()
        offset = self._file.tell()
        self._file.write(keg_xml(self.formats, self.metadata).encode("utf-8"))
        self.flush()
        self._file.seek(2)
        self._file.write(_TS.pack(offset))
        self.flush()
        self._file.close()
        try:
            os.unlink(sidecar_path(self.path))
        except FileNotFoundError:
            pass

    def abandon(self) -> None:
        """Close the file without finishing it (as a crash would); for tests and tools."""
        self._file.flush()
        self._file.close()
        self.closed = True

    def __enter__(self) -> KegFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class KegContents:
    """A keg read into memory.

    ``formats`` maps uuid strings to :class:`DataFormat`; ``uuids`` (16-byte values),
    ``timestamps`` (uint64 ns) and ``starts`` (offset of each record's payload in ``data``)
    are numpy arrays in file order. ``recovered_unfinished`` says the header was never
    patched and the sidecar supplied the formats; ``dropped_bytes`` counts the torn or
    unreadable tail that was left out (``problem`` says why).
    """

    path: str
    version: int
    formats: dict[str, DataFormat]
    metadata: dict[str, str]
    data: bytes = field(repr=False)
    uuids: np.ndarray[Any, Any] = field(repr=False)
    timestamps: np.ndarray[Any, Any] = field(repr=False)
    starts: np.ndarray[Any, Any] = field(repr=False)
    recovered_unfinished: bool = False
    dropped_bytes: int = 0
    problem: str = ""

    def __len__(self) -> int:
        return len(self.timestamps)

    @property
    def record_count(self) -> int:
        return len(self.timestamps)

    def counts(self) -> dict[str, int]:
        """Records per tap uuid string."""
        values, counts = np.unique(self.uuids, return_counts=True)
        return {_uuid_str(v.tobytes()): int(c) for v, c in zip(values, counts, strict=True)}

    def iter_records(self) -> Iterator[tuple[str, int, bytes]]:
        """``(uuid string, timestamp ns, payload bytes)`` in file order."""
        names = {}
        sizes = {}
        for text, fmt in self.formats.items():
            raw = uuid_module.UUID(text).bytes
            names[raw] = text
            sizes[raw] = fmt.row_size
        data = self.data
        for u, ts, start in zip(
            self.uuids.tolist(), self.timestamps.tolist(), self.starts.tolist(), strict=True
        ):
            yield names[u], ts, data[start : start + sizes[u]]

    def rows(self) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """``(uuid string, timestamp ns, decoded row)`` in file order (slow path: typed dicts)."""
        for text, ts, payload in self.iter_records():
            yield text, ts, self.formats[text].decode_row(payload)

    def table(self, uuid: str) -> dict[str, np.ndarray[Any, Any]]:
        """One tap's records as columns: ``timestamp_ns`` plus one array per item."""
        text = str(uuid_module.UUID(uuid))
        fmt = self.formats[text]
        mask = self.uuids == np.frombuffer(uuid_module.UUID(text).bytes, dtype="V16")[0]
        size = fmt.row_size
        columns: dict[str, np.ndarray[Any, Any]] = {"timestamp_ns": self.timestamps[mask]}
        n = len(self.timestamps)
        if n and {f.row_size for f in self.formats.values()} == {size}:
            # Fixed stride: view the records in place with this format's row dtype.
            records = np.frombuffer(
                self.data,
                dtype=np.dtype([("u", "V16"), ("t", ">u8"), ("p", fmt.numpy_dtype)]),
                count=n,
                offset=HEADER_SIZE,
            )
            columns.update(fmt.columns(records["p"][mask]))
            return columns
        starts = self.starts[mask]
        if not len(starts):
            columns.update(fmt.decode_buffer(b""))
            return columns
        # Rows at irregular offsets: one fancy-index gather over an overlapping view whose
        # element i is the ``size`` bytes at offset i (no per-row Python step, no index blowup).
        rows = _sliding(self.data, f"V{size}", 0, len(self.data) - size + 1)[starts]
        columns.update(fmt.columns(rows.view(fmt.numpy_dtype)))
        return columns


# One whole <keg> document; nasa/lager's sidecar holds several back to back (declarations
# between them), the last one possibly torn by the crash.
_KEG_DOCUMENT = re.compile(rb"<keg[\s>].*?</keg\s*>", re.DOTALL)


def _read_sidecar(path: str) -> tuple[dict[str, DataFormat], dict[str, str]]:
    try:
        with open(sidecar_path(path), "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise KegError(
            f"{path}: unfinished keg (dataFormatOffset is 0) and no sidecar {sidecar_path(path)}"
        ) from None
    documents = [m.group() for m in _KEG_DOCUMENT.finditer(text)]
    error: FormatError | None = None
    for document in reversed(documents):  # the last whole one knows every format
        try:
            return parse_keg_xml(document)
        except FormatError as exc:
            error = error or exc
    raise KegError(f"{sidecar_path(path)}: {error or 'no complete <keg> document'}")


def read_keg(path: str | os.PathLike[str]) -> KegContents:
    """Read a keg, recovering an unfinished one from its sidecar. Raises :class:`KegError`."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < HEADER_SIZE:
        raise KegError(f"{path}: {len(blob)} bytes, shorter than the keg header")
    version, offset = _HEADER.unpack_from(blob)
    # Unfinished: taproom writes its version and offset 0, nasa/lager a zero header.
    recovered = offset == 0 and version in (0, KEG_VERSION)
    if version != KEG_VERSION and not recovered:
        raise KegError(f"{path}: keg version {version}, taproom reads {KEG_VERSION}")
    if recovered:
        formats, metadata = _read_sidecar(path)
        end = len(blob)
    else:
        if not HEADER_SIZE <= offset <= len(blob):
            raise KegError(f"{path}: dataFormatOffset {offset} outside the file")
        try:
            formats, metadata = parse_keg_xml(blob[offset:])
        except FormatError as exc:
            raise KegError(f"{path}: format XML: {exc}") from None
        end = offset
    sizes = {uuid_module.UUID(text).bytes: fmt.row_size for text, fmt in formats.items()}
    uuids, timestamps, starts, stop, problem = _index(blob, HEADER_SIZE, end, sizes)
    dropped = end - stop
    if dropped and not problem:
        problem = "torn last record"
    return KegContents(
        path=path,
        version=version,
        formats=formats,
        metadata=metadata,
        data=blob,
        uuids=uuids,
        timestamps=timestamps,
        starts=starts,
        recovered_unfinished=recovered,
        dropped_bytes=dropped,
        problem=problem if dropped else "",
    )


def _index(
    blob: bytes, begin: int, end: int, sizes: dict[bytes, int]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], int, str]:
    """Find every whole record between ``begin`` and ``end``.

    When all taps share one row size the records have a fixed stride and numpy does the whole
    walk; otherwise :func:`_index_mixed` finds the boundaries without a per-record Python step.
    """
    distinct = set(sizes.values())
    if len(distinct) != 1:
        return _index_mixed(blob, begin, end, sizes)
    size = distinct.pop()
    stride = RECORD_HEAD + size
    n = (end - begin) // stride
    table = np.frombuffer(
        blob,
        dtype=np.dtype([("u", "V16"), ("t", ">u8"), ("p", f"V{size}")]),
        count=n,
        offset=begin,
    )
    uuids = table["u"]
    known = np.isin(uuids, np.array(list(sizes), dtype="V16"))
    problem = ""
    if not known.all():
        n = int(np.argmin(known))
        problem = "record with an unknown tap uuid"
    starts = begin + np.arange(n, dtype=np.int64) * stride + RECORD_HEAD
    return (
        uuids[:n].copy(),
        table["t"][:n].astype(np.uint64),
        starts,
        begin + n * stride,
        problem,
    )


# Candidate scan chunk: bounds the temporaries (a bool per byte) whatever the keg's size.
_SCAN_CHUNK = 1 << 20
# Up to this many distinct 2-byte uuid prefixes, comparing the sliding u16 view with each is
# faster than a lookup table gather (~2.5x for one or two taps); more use the table.
_SCAN_COMPARES = 4


def _sliding(blob: bytes, dtype: str, offset: int, count: int) -> np.ndarray[Any, Any]:
    """Element i = ``dtype`` read at byte ``offset + i`` (overlapping, read-only, no copy)."""
    return np.ndarray(shape=(count,), dtype=dtype, buffer=blob, offset=offset, strides=(1,))


def _index_mixed(
    blob: bytes, begin: int, end: int, sizes: dict[bytes, int]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], int, str]:
    """The record walk for taps of different row sizes, vectorised.

    A record's size depends on the uuid at its start, so the walk is a chain. Numpy finds every
    position where a known uuid occurs (a 2-byte prefix table, then a full 16-byte check), gives
    each its record end, and checks in one pass where candidate i's end is candidate i+1's start.
    Following the chain from ``begin`` then costs one step per break, not per record: a break is
    the end of the data, an unknown uuid, or a uuid's bytes occurring inside a payload (a false
    candidate, skipped because the chain never lands on it). Same results as the plain walk:
    stop at the first unknown uuid (``problem``) or the first record that does not fit.
    """
    last = end - RECORD_HEAD  # the last position a record can start at
    empty = (np.empty(0, dtype="V16"), np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64))
    if last < begin:
        return (*empty, begin, "")
    if not sizes:
        return (*empty, begin, "record with an unknown tap uuid")
    known = np.sort(np.array(list(sizes), dtype="V16"))
    known_sizes = np.array([sizes[k.tobytes()] for k in known], dtype=np.int64)
    keys = sorted({k.tobytes()[0] | k.tobytes()[1] << 8 for k in known})  # little-endian u16
    prefix = np.zeros(1 << 16, dtype=bool)
    prefix[keys] = True
    span = last - begin + 1
    found = []
    for lo in range(0, span, _SCAN_CHUNK):
        count = min(_SCAN_CHUNK, span - lo)
        window = _sliding(blob, "<u2", begin + lo, count)
        if len(keys) <= _SCAN_COMPARES:
            mask = window == keys[0]
            for key in keys[1:]:
                mask |= window == key
        else:
            mask = prefix[window]
        found.append(np.flatnonzero(mask) + (begin + lo))
    cand = np.concatenate(found).astype(np.int64)
    values = _sliding(blob, "V16", begin, span)[cand - begin]
    which = np.minimum(np.searchsorted(known, values), len(known) - 1)
    real = known[which] == values
    cand, which = cand[real], which[real]
    ends = cand + RECORD_HEAD + known_sizes[which]
    breaks = np.flatnonzero(ends[:-1] != cand[1:])  # candidate i's chain does not reach i+1
    pieces: list[np.ndarray[Any, Any]] = []
    problem = ""
    pos = begin
    while pos <= last:
        j = int(np.searchsorted(cand, pos))
        if j == len(cand) or cand[j] != pos:
            problem = "record with an unknown tap uuid"
            break
        k = int(np.searchsorted(breaks, j))
        b = int(breaks[k]) if k < len(breaks) else len(cand) - 1
        if ends[b] <= end:
            pieces.append(np.arange(j, b + 1))
            pos = int(ends[b])
        else:  # the last record of this run is torn
            pieces.append(np.arange(j, b))
            pos = int(cand[b])
            break
    if not pieces:
        return (*empty, pos, problem)
    chosen = np.concatenate(pieces)
    where = cand[chosen]
    uuids = known[which[chosen]]
    timestamps = _sliding(blob, ">u8", begin + 16, span)[where - begin].astype(np.uint64)
    return uuids, timestamps, where + RECORD_HEAD, pos, problem
