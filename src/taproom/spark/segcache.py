"""Parsed-segment cache: each sealed journal segment is parsed once and kept as Parquet.

A sealed segment (every segment but a journal's last) never changes: the hub appends only
to the last one, and retention deletes whole segments. So the rollup job parses a sealed
segment's events once (:func:`~taproom.spark.transforms.parse_events`: JSON payloads, the
importer's defaults) and stores the parsed rows (:data:`PARSED_EVENT_SCHEMA`, narrow and
typed) under the cache directory; later runs read them with Spark's own vectorised Parquet
reader instead of decoding and parsing again. The last segment of each journal is always
read live through the ``taproom`` source.

Layout: ``<cache>/v<CACHE_VERSION>/<journal id>/<first offset>-<end offset>-<bytes>/``, where
the journal id is the journal's identity (its ``JOURNAL`` file names the directory or hub it
was read from) and the entry name pins the segment's offsets and size: a segment cut back by
``journal check --repair`` gets a new entry. An entry is built in a temporary directory and renamed into
place, so a run killed half-way leaves no half entry; entries of segments that retention
deleted are removed. Builders take an exclusive lock on ``<cache>/.lock``, so two jobs never
build the same entries. Bump :data:`CACHE_VERSION` whenever ``parse_events`` or the parsed
schema changes: old entries are then ignored (and can be deleted).

Journals read from hubs are cached the same way: a hub's read API lists its segments, sealed
ones with their end offset and size, so a remote sealed segment is parsed once too.

The cache is plain files: the directory must be a local path or a POSIX mount every executor
(and the driver) can read.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .schemas import PARSED_EVENT_SCHEMA
from .sources import JournalSource, Segment, SourceSpec

__all__ = ["CACHE_VERSION", "CacheStats", "SealedPart", "live_part", "locked", "parsed_events"]

# 2: parsed rows carry the request's resources; 3: keyed by journal id, `journal` is the id;
# 4: raw logjam bodies are not requests; 5: the event-time rule on started
CACHE_VERSION = 6  # 6: journal, offset, request_id and host kept (the drill-down tables)
# What parse_events needs from the source: producer, seq and event_id are never decoded.
PARSE_COLUMNS = "journal,offset,received,ts,protocol,stream,topic,content_type,payload,attrs"


@dataclass(frozen=True)
class SealedPart:
    """A sealed segment as a part of the per-segment tables (jobs/parts.py): its part name,
    ``s<journal id>.<entry>``, and its cache entry (a directory of Parquet files)."""

    name: str
    path: str


def live_part(journal_id: str) -> str:
    """The part name of a journal's last (live) segment."""
    return f"s{journal_id}.live"


@dataclass
class CacheStats:
    """What one run took from the cache and what it had to parse; with a cache, also what
    the per-segment tables need: every sealed segment's part and the live rows."""

    cached: int = 0  # sealed segments read from the cache
    built: int = 0  # sealed segments parsed and added to the cache this run
    live: int = 0  # segments read through the source (the last of each journal)
    removed: int = 0  # entries of segments no longer in their journal
    persisted: list[Any] = field(default_factory=list)  # frames to unpersist after the run
    sealed: list[SealedPart] = field(default_factory=list)  # every sealed segment, cached now
    live_journals: list[str] = field(default_factory=list)  # ids of journals with a live part
    live_rows: Any = None  # the parsed rows of the live segments (None: there are none)
    parts_written: dict[str, int] = field(default_factory=dict)  # per table (jobs/parts.py)

    def release(self) -> None:
        for frame in self.persisted:
            frame.unpersist()
        self.persisted.clear()


def _journal_dir(root: str, source: JournalSource) -> str:
    return os.path.join(root, f"v{CACHE_VERSION}", source.id)


@contextmanager
def locked(root: str) -> Iterator[None]:
    """An exclusive lock on ``<root>/.lock`` (made if missing) while the block runs: one
    process at a time builds the cache's entries, or commits a table's parts (jobs/parts.py)."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _source(spark: Any, spec: SourceSpec, ranges: dict[str, list[list[int | None]]] | None) -> Any:
    """Parsed rows of the journals of ``spec`` (only ``ranges``, keyed by journal id, if given)."""
    from .transforms import parse_events

    reader = spark.read.format("taproom").options(**spec.options())
    if ranges is not None:
        reader = reader.option("ranges", json.dumps(ranges))
    return reader.option("columns", PARSE_COLUMNS).load().transform(parse_events)


def _build(
    spark: Any, root: str, spec: SourceSpec, missing: list[tuple[JournalSource, Segment]]
) -> None:
    """Parse ``missing`` sealed segments in one Spark job and move each into its entry."""
    from pyspark.sql import functions as F

    # Partition value of each segment's rows: "<journal id>.<entry>", unique across journals.
    names = {(src.id, seg): f"{src.id}.{seg.entry}" for src, seg in missing}
    ranges: dict[str, list[list[int | None]]] = {}
    entry = F.lit(None).cast("string")
    for src, seg in missing:
        ranges.setdefault(src.id, []).append([seg.base, seg.end])
        where = (F.col("journal") == src.id) & F.col("offset").between(
            seg.base, int(seg.end or 0) - 1
        )
        entry = F.when(where, F.lit(names[src.id, seg])).otherwise(entry)
    tmp = os.path.join(root, f".tmp-{uuid.uuid4().hex}")
    try:
        (
            _source(spark, spec, ranges)
            .select(*PARSED_EVENT_SCHEMA.fieldNames(), entry.alias("entry"))
            .write.partitionBy("entry")
            .parquet(tmp)
        )
        for src, seg in missing:
            final = os.path.join(_journal_dir(root, src), seg.entry)
            built = os.path.join(tmp, f"entry={names[src.id, seg]}")
            if not os.path.isdir(built):  # a segment with no records
                os.makedirs(built)
            os.rename(built, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parsed_events(
    spark: Any,
    journals: SourceSpec | Sequence[str],
    cache: str | None,
    *,
    persist_live: bool = False,
) -> tuple[Any, CacheStats]:
    """Parsed rows (:data:`PARSED_EVENT_SCHEMA`) of every event in ``journals`` (a
    :class:`~taproom.spark.sources.SourceSpec`, or journal directories).

    With ``cache`` None every segment is read and parsed through the source. Otherwise
    sealed segments come from the cache (built first where missing) and only the last
    segment of each journal is parsed live. ``persist_live`` keeps the live rows in memory
    (spilling to disk) for a job that reads them several times; ``stats.release()`` frees
    them.
    """
    from pyspark import StorageLevel

    def parsed_live(frame: Any) -> Any:
        frame = frame.select(*PARSED_EVENT_SCHEMA.fieldNames())
        if persist_live:
            frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
            stats.persisted.append(frame)
        return frame

    spec = SourceSpec.of(journals)
    sources = spec.open()
    stats = CacheStats()
    if cache is None:
        stats.live = sum(len(s.segments()) for s in sources)
        return parsed_live(_source(spark, spec, None)), stats
    root = os.path.abspath(cache)
    entries: list[str] = []
    live: dict[str, list[list[int | None]]] = {}
    with locked(root):
        for name in os.listdir(root):
            if name.startswith(".tmp-"):  # left by a job that died while building
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        missing: list[tuple[JournalSource, Segment]] = []
        for source in sources:
            jdir = _journal_dir(root, source)
            os.makedirs(jdir, exist_ok=True)
            with open(os.path.join(jdir, "JOURNAL"), "w") as f:
                f.write(source.name + "\n")
            segments = source.segments()
            wanted = {s.entry for s in segments if s.sealed}
            for name in os.listdir(jdir):
                if name != "JOURNAL" and name not in wanted:
                    shutil.rmtree(os.path.join(jdir, name), ignore_errors=True)
                    stats.removed += 1
            for seg in segments:
                if not seg.sealed:
                    live.setdefault(source.id, []).append([seg.base, None])
                    stats.live += 1
                elif os.path.isdir(os.path.join(jdir, seg.entry)):
                    stats.cached += 1
                else:
                    missing.append((source, seg))
            entries += [os.path.join(jdir, s.entry) for s in segments if s.sealed]
            stats.sealed += [
                SealedPart(f"s{source.id}.{s.entry}", os.path.join(jdir, s.entry))
                for s in segments
                if s.sealed
            ]
        if missing:
            _build(spark, root, spec, missing)
            stats.built = len(missing)
    frames = []
    if entries:
        frames.append(spark.read.schema(PARSED_EVENT_SCHEMA).parquet(*entries))
    if live or not frames:
        stats.live_rows = parsed_live(_source(spark, spec, live or None))
        stats.live_journals = sorted(live)
        frames.append(stats.live_rows)
    out = frames[0]
    for frame in frames[1:]:
        out = out.unionByName(frame)
    return out, stats
