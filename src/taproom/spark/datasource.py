"""PySpark Python data sources: ``taproom`` (journals) and ``keg`` (Lager *.lgr files).

``taproom`` reads journals, in batch and as a Structured Streaming source: journal directories
(shared storage every executor mounts) and hubs by address (their network read API), in any
mix (:mod:`.sources`). It yields Arrow record batches built column-wise by :mod:`.arrowdecode`
(never rows one by one). Partitions are offset ranges of about ``partitionBytes``, so all cores
of ``local[2]`` (or all executors of a cluster) share a read.

Streaming offsets are ``{journal id: next offset}`` (the identity in each journal's directory,
so a hub reached at another address, or a directory mounted elsewhere, is the same journal).
A micro-batch is the offset range between two such maps, and Spark checkpoints both ends before
it runs, so replaying a batch after a crash reads exactly the same records: no duplicates, no
gaps. Read limits (``maxRecordsPerTrigger``) and ``Trigger.AvailableNow`` are honoured. With
``cursor`` set, each committed end is reported to the journal's named cursor (the hub's
retention keeps what it has not passed, with ``[journal] retain_unread``). A hub that cannot be
reached fails the micro-batch with an error naming it; the query resumes from its checkpoint.

Options (``spark.read.format("taproom").option(...)``):

* ``path`` / ``paths`` (what ``load()`` passes) or ``journals``: journal directories,
  comma-separated in ``journals``;
* ``hubs``: hub web listeners, ``host:port,host:port``; ``token``: their ``[web] token``
  (default: the ``TAPROOM_HUB_TOKEN`` environment variable of the driver);
* ``partitionBytes``: target bytes per partition (default 64 MiB);
* ``columns``: comma-separated event columns to read (default all): the others are never
  decoded nor sent to the JVM;
* ``ranges`` (batch only): JSON ``{journal: [[lo, hi], ...]}`` (journal: its id, directory
  or hub address), read only these offset ranges (``hi`` null: to the end); journals missing
  from it are not read;
* ``maxRecordsPerTrigger``: streaming read limit per micro-batch (default: none);
* ``startingOffsets``: ``earliest`` (default), ``latest`` or a JSON ``{journal: offset}``;
* ``cursor``: streaming: the cursor name under which committed offsets are reported.

Register both sources with :func:`register`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from ..errors import JournalError
from .schemas import EVENT_SCHEMA
from .sources import HubSlice, JournalSource, SourceSpec, read_partition

__all__ = ["JournalDataSource", "KegDataSource", "register"]

log = logging.getLogger("taproom.spark")

_DEFAULT_PARTITION_BYTES = 64 << 20


def _list(options: Any, key: str) -> list[str]:
    value = options.get(key)
    if not value:
        return []
    if key == "paths":
        return list(json.loads(value) if isinstance(value, str) else value)
    return [p.strip() for p in str(value).split(",") if p.strip()]


def _spec(options: Any) -> SourceSpec:
    journals = _list(options, "journals") + _list(options, "paths") + _list(options, "path")
    return SourceSpec(tuple(journals), tuple(_list(options, "hubs")), options.get("token"))


def _columns(options: Any) -> list[str] | None:
    """The ``columns`` option: only these event columns are decoded and sent to Spark (the
    Python data source API has no column pruning of its own)."""
    raw = options.get("columns")
    if not raw:
        return None
    wanted = {c.strip() for c in str(raw).split(",") if c.strip()}
    unknown = wanted - set(EVENT_SCHEMA.fieldNames())
    if unknown:
        raise ValueError(f"taproom source: unknown columns {sorted(unknown)}")
    return [name for name in EVENT_SCHEMA.fieldNames() if name in wanted]


def _keyed(given: dict[str, Any], source: JournalSource) -> Any:
    """The value ``given`` holds for ``source`` under its id, its name, or (checkpoints and
    options from before journal ids) its absolute path."""
    for key, value in given.items():
        if source.knows(key) or (os.path.isabs(key) and source.knows(os.path.abspath(key))):
            return value
    return None


def _ranges(options: Any, sources: list[JournalSource]) -> dict[str, list[tuple[int, int | None]]]:
    given = json.loads(str(options["ranges"]))
    out = {}
    for source in sources:
        spans = _keyed(given, source)
        if spans:
            out[source.id] = [(int(lo), None if hi is None else int(hi)) for lo, hi in spans]
    return out


class _JournalBatchReader(DataSourceReader):
    def __init__(self, options: Any) -> None:
        self.sources = _spec(options).open()
        self.target_bytes = int(options.get("partitionBytes", _DEFAULT_PARTITION_BYTES))
        self.columns = _columns(options)
        self.ranges = _ranges(options, self.sources) if options.get("ranges") else None

    def partitions(self) -> Sequence[InputPartition]:
        slices: list[InputPartition] = []
        for source in self.sources:
            if self.ranges is None:
                slices += source.plan(source.first_offset(), None, self.target_bytes)
                continue
            for lo, hi in self.ranges.get(source.id, []):
                slices += source.plan(lo, hi, self.target_bytes)
        # Spark needs at least one partition; an empty slice reads nothing.
        first = self.sources[0]
        return slices or [HubSlice(first.name, first.id, 0, 0, 0, None)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_partition(partition, self.columns)


class _JournalStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{journal id: next offset}``; one instance lives in the driver's planner."""

    def __init__(self, options: Any) -> None:
        self.sources = _spec(options).open()
        self.target_bytes = int(options.get("partitionBytes", _DEFAULT_PARTITION_BYTES))
        limit = options.get("maxRecordsPerTrigger")
        self.max_records = int(limit) if limit else None
        if self.max_records is not None and self.max_records < 1:
            raise ValueError("maxRecordsPerTrigger must be at least 1")
        self.starting = str(options.get("startingOffsets", "earliest"))
        self.columns = _columns(options)
        self.cursor = options.get("cursor") or None
        self.target: dict[str, int] | None = None  # set by Trigger.AvailableNow
        self._latest: dict[str, int] = {}

    def _available(self, source: JournalSource) -> int:
        end = source.available_end()
        self._latest[source.id] = end
        return end

    def initialOffset(self) -> dict:
        if self.starting == "earliest":
            offsets = {s.id: s.first_offset() for s in self.sources}
        elif self.starting == "latest":
            offsets = {s.id: self._available(s) for s in self.sources}
        else:
            given = json.loads(self.starting)
            offsets = {}
            for s in self.sources:
                value = _keyed(given, s)
                offsets[s.id] = s.first_offset() if value is None else int(value)
        # Register the cursor from the start: retention keeps what this query has not read.
        self._report(offsets)
        return offsets

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_records is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_records)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {s.id: self._available(s) for s in self.sources}

    def _start_of(self, start: dict, source: JournalSource) -> int:
        value = _keyed(start, source)
        # A journal added since the checkpoint starts at its first retained offset.
        return source.first_offset() if value is None else int(value)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        ends: dict[str, int] = {}
        begins = {s.id: self._start_of(start, s) for s in self.sources}
        for source in self.sources:
            end = self.target[source.id] if self.target is not None else self._available(source)
            ends[source.id] = max(begins[source.id], end)
        if isinstance(limit, ReadMaxRows):
            ends = self._limit(begins, ends, int(limit.max_rows))
        # Keep journals the checkpoint knows but that are no longer configured, unchanged
        # (keys of configured journals from before ids were path keys: now under their id).
        for key, offset in start.items():
            if not any(s.knows(key) or s.knows(os.path.abspath(key)) for s in self.sources):
                ends.setdefault(key, int(offset))
        return ends

    @staticmethod
    def _limit(begins: dict[str, int], ends: dict[str, int], budget: int) -> dict[str, int]:
        """At most ``budget`` records in all: an equal share each, the rest to whoever has more."""
        backlog = {j: ends[j] - begins[j] for j in ends}
        take = {j: 0 for j in ends}
        share = max(1, budget // max(1, len(ends)))
        for j in ends:
            take[j] = min(backlog[j], share, budget - sum(take.values()))
        for j in ends:
            take[j] += min(backlog[j] - take[j], budget - sum(take.values()))
        return {j: begins[j] + take[j] for j in ends}

    def reportLatestOffset(self) -> dict | None:
        return dict(self._latest)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        slices: list[InputPartition] = []
        for source in self.sources:
            lo = self._start_of(start, source)
            hi = int(end.get(source.id, lo))
            if hi > lo:
                slices += source.plan(lo, hi, self.target_bytes)
        return slices

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_partition(partition, self.columns)

    def commit(self, end: dict) -> None:
        self._report({s.id: int(end[s.id]) for s in self.sources if s.id in end})

    def _report(self, offsets: dict[str, int]) -> None:
        """Report committed offsets to each journal's cursor. The checkpoint is the truth: a
        hub that is down now hears of it at the next commit, and a loss shows as a failed
        read, so a failed report is only logged."""
        if self.cursor is None:
            return
        for source in self.sources:
            if source.id in offsets:
                try:
                    source.report_cursor(self.cursor, offsets[source.id])
                except (OSError, JournalError) as exc:
                    log.warning(
                        "taproom source: cursor %s of %s: %s", self.cursor, source.name, exc
                    )


class JournalDataSource(DataSource):
    """``spark.read.format("taproom").load("/var/taproom/journal")``, or
    ``.option("hubs", "h1:8686,h2:8686").load()``."""

    @classmethod
    def name(cls) -> str:
        return "taproom"

    def schema(self) -> StructType:
        columns = _columns(self.options)
        if columns is None:
            return EVENT_SCHEMA
        return StructType([f for f in EVENT_SCHEMA.fields if f.name in columns])

    def reader(self, schema: StructType) -> DataSourceReader:
        return _JournalBatchReader(self.options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _JournalStreamReader(self.options)


def register(spark: Any) -> None:
    """Make ``format("taproom")`` and ``format("keg")`` available in ``spark``."""
    spark.dataSource.register(JournalDataSource)
    spark.dataSource.register(KegDataSource)


from .kegsource import KegDataSource  # noqa: E402  (defined beside its reader)
