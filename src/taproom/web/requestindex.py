"""Finding a request by its id in the ``request_ids`` table, without a scan.

The index maps request id -> (journal, offset), partitioned by date. A lookup reads only the
Parquet row groups that can hold the id, chosen from statistics kept in memory per file (files
never change once committed; an entry is keyed by path, size and modification time):

* the batch job sorts each file by id and writes small row groups (``[spark]
  index_row_group_bytes``): a group's min/max id pins the id to one group per file;
* a streaming query cannot sort (Spark refuses to), so its files span every id; there the
  ``minute`` column's min/max does the work when the id carries its time: logjam_agent sends
  version 1 UUIDs (32 hex digits, no dashes), whose timestamp is the request's start. The id's
  minute (within :data:`CLOCK_SLACK_MINUTES`) selects the few files of that time;
* a batch job with a parsed-segment cache writes a part per journal segment
  (``date=D/part=P/``, :meth:`~.tables.TableFiles.parts`), each file sorted by id: a segment is
  contiguous in the journal, so a part's ``minute`` range is its segment's time and a v1 id
  reads the one row group holding it in the one or two parts of its time (measured in
  tests/web/test_requestindex.py: 1.7 row groups a lookup on a day of 48 parts of 8 groups);
  an id without a time reads a group per part until it is found.

Dates searched: ``date`` when given; else the dates around a version 1 UUID's time; else the
newest ``[console] find_dates`` dates. Called in worker threads.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .tables import FileMemo, TableFiles, relisted

__all__ = ["CLOCK_SLACK_MINUTES", "IndexHit", "RequestIndex", "uuid1_time"]

TABLE = "request_ids"
# How far a request's start (its minute in the index) may be from its id's UUID time: both
# come from the agent's clock at the start of the request, so a minute or two covers rounding
# and a slow start; a wrong guess only costs a wider search.
CLOCK_SLACK_MINUTES = 2
# Files whose row-group statistics are kept: a streaming day has one file per micro-batch.
CACHED_FILES = 100_000
# 100 ns intervals from the Gregorian reform (UUID epoch) to the Unix epoch.
_UUID_EPOCH_100NS = 0x01B21DD213814000
_COLUMNS = ("request_id", "journal", "offset", "app", "env", "minute")


@dataclass(frozen=True)
class IndexHit:
    request_id: str
    journal: str
    offset: int
    app: str
    env: str
    minute_ms: int
    date: str


@dataclass(frozen=True)
class _Group:
    index: int
    min_id: str | None  # None: no statistics (every id may be in it)
    max_id: str | None
    min_minute: int | None  # epoch microseconds
    max_minute: int | None


def uuid1_time(request_id: str) -> dt.datetime | None:
    """The time in a version 1 UUID (with or without dashes), else None."""
    text = request_id.replace("-", "")
    if len(text) != 32:
        return None
    try:
        value = int(text, 16)
    except ValueError:
        return None
    if (value >> 76) & 0xF != 1:  # the version nibble
        return None
    time_low = value >> 96
    time_mid = (value >> 80) & 0xFFFF
    time_hi = (value >> 64) & 0x0FFF
    ticks = (time_hi << 48) | (time_mid << 32) | time_low
    seconds = (ticks - _UUID_EPOCH_100NS) / 1e7
    if not 0 < seconds < 2**33:
        return None
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def _stat(stats: Any, which: str) -> Any:
    if stats is None or not stats.has_min_max:
        return None
    return getattr(stats, which)


def _micros(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return int(value.timestamp() * 1_000_000)
    return int(value)


class RequestIndex:
    """Lookups in ``<rollups>/request_ids``."""

    def __init__(self, tables: TableFiles, find_dates: int) -> None:
        self.tables = tables
        self.find_dates = find_dates
        self._files: FileMemo[tuple[Any, list[_Group]]] = FileMemo(CACHED_FILES)
        self.groups_read = 0  # row groups read by lookups (tests and the bench look at it)

    def _groups(self, path: str) -> tuple[Any, list[_Group]]:
        """The file's metadata and its row groups' id and minute ranges (cached)."""
        # FileNotFoundError: replaced since the listing (find lists again)
        stamp, kept, found = self._files.get(path)
        if found and kept is not None:
            return kept
        metadata = pq.read_metadata(path)
        schema = metadata.schema.to_arrow_schema()
        id_col = schema.get_field_index("request_id")
        minute_col = schema.get_field_index("minute")
        groups = []
        for i in range(metadata.num_row_groups):
            rg = metadata.row_group(i)
            ids = rg.column(id_col).statistics if id_col >= 0 else None
            minutes = rg.column(minute_col).statistics if minute_col >= 0 else None
            groups.append(
                _Group(
                    i,
                    _stat(ids, "min"),
                    _stat(ids, "max"),
                    _micros(_stat(minutes, "min")),
                    _micros(_stat(minutes, "max")),
                )
            )
        return self._files.put(path, stamp, (metadata, groups))

    def _search(
        self, request_id: str, date: str, window: tuple[int, int] | None
    ) -> IndexHit | None:
        for path in self.tables.files(TABLE, date):
            metadata, groups = self._groups(path)
            candidates = [
                g.index
                for g in groups
                if (g.min_id is None or g.min_id <= request_id <= g.max_id)  # type: ignore[operator]
                and (
                    window is None
                    or g.min_minute is None
                    or (g.min_minute <= window[1] and window[0] <= g.max_minute)  # type: ignore[operator]
                )
            ]
            if not candidates:
                continue
            parquet = pq.ParquetFile(path, metadata=metadata)
            for index in candidates:
                self.groups_read += 1
                group = parquet.read_row_group(index, columns=list(_COLUMNS))
                hits = group.filter(pc.equal(group.column("request_id"), request_id))
                if hits.num_rows:
                    return _hit(hits, date)
        return None

    @relisted
    def find(self, request_id: str, date: str = "") -> IndexHit | None:
        """Where the request ``request_id`` is stored, or None."""
        dates = self.tables.dates(TABLE)
        if date:
            return self._search(request_id, date, None) if date in dates else None
        started = uuid1_time(request_id)
        searched: set[str] = set()
        if started is not None:
            slack = dt.timedelta(minutes=CLOCK_SLACK_MINUTES)
            lo, hi = started - slack, started + slack
            window = (_micros(lo.replace(second=0, microsecond=0)), _micros(hi))
            for day in sorted({lo.date().isoformat(), hi.date().isoformat()}):
                if day in dates:
                    hit = self._search(request_id, day, window)  # type: ignore[arg-type]
                    if hit is not None:
                        return hit
        for day in dates[: self.find_dates]:
            if day not in searched:
                searched.add(day)
                hit = self._search(request_id, day, None)
                if hit is not None:
                    return hit
        return None


def _hit(rows: pa.Table, date: str) -> IndexHit:
    row = rows.slice(0, 1).to_pylist()[0]
    minute = row["minute"]
    return IndexHit(
        request_id=row["request_id"],
        journal=row["journal"],
        offset=int(row["offset"]),
        app=row["app"],
        env=row["env"],
        minute_ms=(_micros(minute) or 0) // 1000,
        date=date,
    )
