"""The files of a rollup table, as Spark would read them: only committed ones.

``taproom spark rollup`` writes a table with a batch job (its files appear by rename at commit);
``taproom spark stream`` writes it with Spark's file sink, which records every committed
micro-batch's files in ``<table>/_spark_metadata/`` (``N`` deltas, ``N.compact`` every few
batches). Files of a micro-batch that was killed half-way are in the directory but not in the
log: Spark's own reader ignores them, and so does the console, or a drill-down table would
show such requests twice. Listings are cached by the log's (or the partition's) file names,
sizes and modification times.

A batch job with a parsed-segment cache writes the drill-down tables a part per journal
segment (docs/spark.md): ``date=D/part=P/*.parquet``, ``P`` naming a sealed segment
(``s<journal>.<first>-<end>-<bytes>``, written once) or a journal's live segment
(``s<journal>.live``, rewritten each run), and a marker ``<table>/_parts/P`` once a part's
files are in place. :meth:`TableFiles.parts` lists them by part, for the readers that merge a
group's rows over its parts (:mod:`.drilldown`). A date directory that
has parts may still hold flat files of an earlier version's run over the same requests: those
are not read, or a request would show twice. Called in worker threads.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar
from urllib.parse import unquote, urlsplit

__all__ = ["READ_ATTEMPTS", "FileMemo", "TableFiles", "relisted"]

_LOG = "_spark_metadata"
_BATCH = re.compile(r"^(\d+)(\.compact)?$")
_DATE_DIR = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")
_PART_DIR = "part="
_MARKERS = "_parts"  # <table>/_parts/<P>: part P's files are all in place
# Listings kept (tables x logs); each a few KB to a few MB for a long-running stream.
_CACHED = 32
# Answers read again from a fresh listing when a listed file went meanwhile (the job replaced
# the live part, or retention deleted a part): a run replacing parts as we read costs one more.
READ_ATTEMPTS = 3
# Files whose minute range is kept (a few dozen bytes each): a day has a part per segment.
_CACHED_RANGES = 100_000


_Answer = TypeVar("_Answer")
_Value = TypeVar("_Value")


class FileMemo(Generic[_Value]):
    """What was read from a file (its statistics, a marker's JSON), kept per path while the
    file's size and modification time stay the same; the least recently used beyond ``size``
    are dropped. Thread-safe: ``get`` and ``put`` hold a lock, the read between them does not."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[tuple[int, int], _Value]] = OrderedDict()

    def get(self, path: str) -> tuple[tuple[int, int], _Value | None, bool]:
        """``(stamp, value, found)``: the file's stamp now and what was kept for it, if it was
        kept for that stamp. FileNotFoundError when the file is gone."""
        st = os.stat(path)
        stamp = (st.st_size, st.st_mtime_ns)
        with self._lock:
            kept = self._kept.get(path)
            if kept is not None and kept[0] == stamp:
                self._kept.move_to_end(path)
                return stamp, kept[1], True
        return stamp, None, False

    def put(self, path: str, stamp: tuple[int, int], value: _Value) -> _Value:
        with self._lock:
            self._kept[path] = (stamp, value)
            self._kept.move_to_end(path)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return value


def relisted(method: Callable[..., _Answer]) -> Callable[..., _Answer]:
    """``method`` (a reader's answer) again, up to :data:`READ_ATTEMPTS` times, when a file it
    listed is gone: the next call lists the files again."""

    @functools.wraps(method)
    def answer(*args: Any, **kwargs: Any) -> _Answer:
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return method(*args, **kwargs)
            except FileNotFoundError:
                if attempt == READ_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    return answer


def _parquet(names: list[str]) -> list[str]:
    # Spark's committed files; "_"- and "."-names are its markers and checksums.
    return [n for n in names if n.endswith(".parquet") and n[0] not in "._"]


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _fingerprint(path: str) -> tuple[tuple[str, int, int], ...]:
    try:
        with os.scandir(path) as entries:
            found = [
                (e.name, st.st_size, st.st_mtime_ns)
                for e in entries
                if e.is_file() and (st := e.stat())
            ]
    except (FileNotFoundError, NotADirectoryError):
        return ()
    return tuple(sorted(found))


class TableFiles:
    """Committed Parquet files of the tables under ``directory`` (``<directory>/<table>``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._logs: dict[str, tuple[object, dict[str, set[str]]]] = {}
        self._ranges: FileMemo[tuple[int, int] | None] = FileMemo(_CACHED_RANGES)
        self._made: FileMemo[tuple[int, int] | None] = FileMemo(_CACHED_RANGES)  # markers' bounds

    def table_dir(self, table: str) -> str:
        return os.path.join(self.directory, table)

    def streamed(self, table: str) -> bool:
        """True when the table was written by a streaming query (it has a sink log)."""
        return os.path.isdir(os.path.join(self.table_dir(table), _LOG))

    def dates(self, table: str) -> list[str]:
        """The table's date partitions, newest first."""
        try:
            names = os.listdir(self.table_dir(table))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted((m.group(1) for n in names if (m := _DATE_DIR.match(n))), reverse=True)

    def files(self, table: str, date: str) -> list[str]:
        """Absolute paths of the committed Parquet files of ``table`` for ``date``."""
        parts = self.parts(table, date)
        if parts:
            return sorted(path for files in parts.values() for path in files)
        part = os.path.join(self.table_dir(table), f"date={date}")
        if self.streamed(table):
            committed = self._committed(table).get(f"date={date}", set())
            return sorted(os.path.join(part, name) for name in committed)
        return sorted(os.path.join(part, n) for n in _parquet(_listdir(part)))

    def parts(self, table: str, date: str) -> dict[str, list[str]]:
        """part directory name (``part=P``) -> its Parquet files, for a table written a part
        per journal segment; empty for a flat date directory (a stream's, an older job's).
        A part's files appear by rename, so a listed part is whole. Once the job has written
        markers (``<table>/_parts/<P>``, each after its part's files), only the parts with one
        are listed: a sealed part that replaces the live one gets its marker after the live
        part is gone, so no request is listed twice (for a moment, neither may be)."""
        if self.streamed(table):
            return {}
        day = os.path.join(self.table_dir(table), f"date={date}")
        markers = os.path.join(self.table_dir(table), _MARKERS)
        committed = set(_listdir(markers)) if os.path.isdir(markers) else None
        found: dict[str, list[str]] = {}
        for name in _listdir(day):
            if name.startswith(_PART_DIR):
                if committed is not None and unquote(name[len(_PART_DIR) :]) not in committed:
                    continue
                directory = os.path.join(day, name)
                files = _parquet(_listdir(directory))
                if files:
                    found[name] = sorted(os.path.join(directory, n) for n in files)
        return dict(sorted(found.items()))

    def part_bounds(self, table: str, parts: Iterable[str]) -> tuple[int, int] | None:
        """The ``(slow, failed)`` bounds the job wrote the parts ``parts`` (``part=P``
        directory names) with, from their markers (JSON: ``slow``, ``failed``); None when a
        marker is missing or has none, or when they differ. The job writes every part of a
        table again when its bounds change, so the committed parts agree."""
        found: set[tuple[int, int] | None] = set()
        for name in parts:
            found.add(self._marker_bounds(table, unquote(name.removeprefix(_PART_DIR))))
            if len(found) > 1:
                return None
        return found.pop() if found else None

    def _marker_bounds(self, table: str, part: str) -> tuple[int, int] | None:
        path = os.path.join(self.table_dir(table), _MARKERS, part)
        try:
            stamp, bounds, found = self._made.get(path)
        except FileNotFoundError:
            return None
        if found:
            return bounds
        try:
            with open(path, "rb") as f:
                made = json.loads(f.read(64 * 1024) or b"null")
        except (OSError, ValueError):
            made = None
        if isinstance(made, dict):
            slow, failed = made.get("slow"), made.get("failed")
            if isinstance(slow, int) and isinstance(failed, int) and slow >= 0 and failed >= 0:
                bounds = (slow, failed)
        return self._made.put(path, stamp, bounds)

    def fingerprint(self, table: str, date: str) -> tuple[object, ...]:
        """Changes whenever the committed files of ``table`` for ``date`` may have changed:
        a file or a part directory appearing, changing or going."""
        day = os.path.join(self.table_dir(table), f"date={date}")
        log = os.path.join(self.table_dir(table), _LOG)
        parts = tuple(
            (name, _fingerprint(os.path.join(day, name)))
            for name in sorted(_listdir(day))
            if name.startswith(_PART_DIR)
        )
        markers = tuple(sorted(_listdir(os.path.join(self.table_dir(table), _MARKERS))))
        return (_fingerprint(day), parts, markers, _fingerprint(log) if os.path.isdir(log) else ())

    def minute_range(self, files: Iterable[str]) -> tuple[int, int] | None:
        """The least and greatest ``minute`` (epoch microseconds) of the rows of ``files``,
        from their Parquet statistics (kept per file path, size and modification time); None
        when a file has none (every minute may be in it). ``(1, 0)`` (empty) for no rows.
        FileNotFoundError when a file is gone (a part the job replaced since the listing)."""
        least, greatest = 1, 0
        for path in files:
            span = self._file_range(path)
            if span is None:
                return None
            if span[0] > span[1]:
                continue
            if least > greatest:
                least, greatest = span
            else:
                least, greatest = min(least, span[0]), max(greatest, span[1])
        return least, greatest

    def _file_range(self, path: str) -> tuple[int, int] | None:
        import pyarrow.parquet as pq  # the console loads pyarrow only for these pages

        # FileNotFoundError: replaced since the listing (read it again)
        stamp, kept, found = self._ranges.get(path)
        if found:
            return kept
        try:
            metadata = pq.read_metadata(path)
        except (OSError, ValueError):
            return None
        column = metadata.schema.to_arrow_schema().get_field_index("minute")
        least, greatest = 1, 0
        known = True
        for i in range(metadata.num_row_groups):
            group = metadata.row_group(i)
            if group.num_rows == 0:
                continue
            stats = group.column(column).statistics if column >= 0 else None
            if stats is None or not stats.has_min_max:
                known = False
                break
            lo, hi = _micros(stats.min), _micros(stats.max)
            if least <= greatest:
                lo, hi = min(least, lo), max(greatest, hi)
            least, greatest = lo, hi
        return self._ranges.put(path, stamp, (least, greatest) if known else None)

    def _committed(self, table: str) -> dict[str, set[str]]:
        """partition directory name -> committed file names, from the sink's log."""
        log = os.path.join(self.table_dir(table), _LOG)
        key = _fingerprint(log)
        with self._lock:
            cached = self._logs.get(table)
            if cached is not None and cached[0] == key:
                return cached[1]
        batches: dict[int, bool] = {}  # batch id -> compact
        for name, _, _ in key:
            if m := _BATCH.match(name):
                batches[int(m.group(1))] = bool(m.group(2))
        compacts = [b for b, compact in batches.items() if compact]
        start = max(compacts) if compacts else 0
        files: dict[str, set[str]] = {}
        for batch in sorted(b for b in batches if b >= start):
            name = f"{batch}.compact" if batches[batch] else str(batch)
            for entry in _entries(os.path.join(log, name)):
                path = unquote(urlsplit(str(entry.get("path", ""))).path)
                parent, base = os.path.split(path)
                partition = os.path.basename(parent)
                if entry.get("action") == "delete":
                    files.get(partition, set()).discard(base)
                elif not entry.get("isDir"):
                    files.setdefault(partition, set()).add(base)
        with self._lock:
            self._logs[table] = (key, files)
            while len(self._logs) > _CACHED:
                self._logs.pop(next(iter(self._logs)))
        return files


def _micros(value: object) -> int:
    """A ``minute`` statistic (a datetime, naive meaning UTC, or microseconds) as epoch
    microseconds."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return int(value)  # type: ignore[call-overload]


def _entries(path: str) -> list[dict[str, object]]:
    """The JSON lines of one log file after its version line ("v1")."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return []
    out = []
    for line in lines[1:]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # not an entry: Spark writes each log file whole (temp file, rename)
        if isinstance(entry, dict):
            out.append(entry)
    return out
