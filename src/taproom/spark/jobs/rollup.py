"""``taproom spark rollup``: the batch job, journals → Parquet rollups partitioned by date.

Tables written under ``out``: ``requests`` (:func:`~taproom.spark.transforms.request_rollup`),
``exceptions``, ``logs``, and the console's drill-down: ``request_samples`` (the slowest and
the failed requests per minute and action) and ``request_ids`` (the request-id index, each
file sorted by id). Re-running the same range is idempotent: ``--since``/``--until``
are widened to whole UTC days and the job overwrites exactly the date partitions it writes
(dynamic partition overwrite), so no day is half-replaced and nothing is counted twice.

Sealed journal segments are parsed once and kept in the parsed-segment cache
(:mod:`~taproom.spark.segcache`, default ``<out>/_cache``); later runs read them as Parquet
and parse only the last segment of each journal. The parsed rows are read once per table;
the live part is persisted for the run so its payloads are parsed once. Nothing else is
persisted: the drill-down tables' columns persisted for ``request_samples`` and
``request_ids`` to share cost more than the second read they saved (docs/console.md).

With the cache, ``request_samples`` and ``request_ids`` are written once per sealed segment
(:mod:`~taproom.spark.jobs.parts`: ``<table>/date=.../part=.../``, readers merge the parts);
a warm run writes only each journal's live part. ``--since``/``--until`` limit the other
tables only. Without a cache (an output URL, ``cache=False``) every table is written whole
as before (``<table>/date=.../``).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import transforms as T
from ..segcache import PARSE_COLUMNS, CacheStats, parsed_events
from ..settings import SparkSettings
from ..sources import SourceSpec
from .parts import PART_TABLES, drop_markers, write_parts

__all__ = [
    "ROLLUP_COLUMNS",
    "TABLES",
    "day_range",
    "default_cache",
    "read_events",
    "rollup_tables",
    "run_rollup",
]

TABLES = ("requests", "exceptions", "logs", "request_samples", "request_ids")
# What the rollups read (what parse_events needs): producer, seq and event_id are never decoded.
ROLLUP_COLUMNS = PARSE_COLUMNS


def read_events(spark: Any, journals: SourceSpec | Sequence[str], **options: str) -> Any:
    """The ``taproom`` source over ``journals`` (a spec, or journal directories)."""
    return (
        spark.read.format("taproom")
        .options(**SourceSpec.of(journals).options())
        .options(**options)
        .load()
    )


def day_range(
    since: dt.datetime | None, until: dt.datetime | None
) -> tuple[dt.datetime | None, dt.datetime | None]:
    """``[since, until)`` widened to whole UTC days (naive datetimes are taken as UTC)."""

    def utc(value: dt.datetime) -> dt.datetime:
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)

    lo = hi = None
    if since is not None:
        lo = utc(since).replace(hour=0, minute=0, second=0, microsecond=0)
    if until is not None:
        end = utc(until)
        hi = end.replace(hour=0, minute=0, second=0, microsecond=0)
        if hi < end:
            hi += dt.timedelta(days=1)
    return lo, hi


def rollup_tables(
    events: Any,
    lo: dt.datetime | None = None,
    hi: dt.datetime | None = None,
    settings: SparkSettings | None = None,
) -> dict[str, Any]:
    """The rollup DataFrames of :data:`TABLES` for ``events`` (raw or already parsed), limited
    to minutes in ``[lo, hi)``; ``settings`` bound the drill-down tables."""
    from pyspark.sql import functions as F

    settings = settings or SparkSettings()

    def in_range(df: Any) -> Any:
        if lo is not None:
            df = df.filter(F.col("minute") >= F.lit(lo))
        if hi is not None:
            df = df.filter(F.col("minute") < F.lit(hi))
        return df

    parsed = T.parsed_rows(events)
    # Every table reads the parsed rows on its own (Parquet reads only its columns). Persisted
    # for several tables, they cost more than the reads they saved: the whole parsed request
    # filled the 1 GiB heap; every resource as a column of its own cost more; the drill-down's
    # columns shared by request_samples and request_ids cost 3 to 5 CPU-s a run (of 33 to 38
    # for all five tables at 1M requests) more than the second read (docs/console.md).
    requests = parsed.transform(T.logjam_requests).transform(in_range)
    return {
        "requests": requests.transform(T.request_rollup),
        "exceptions": requests.transform(T.exception_rollup, samples=settings.exception_samples),
        "logs": parsed.transform(T.log_rollup).transform(in_range),
        "request_samples": requests.transform(
            T.request_samples,
            slow=settings.slow_requests_per_action,
            failed=settings.failed_requests_per_action,
        ),
        "request_ids": requests.transform(T.request_index),
    }


class _Progress:
    """Prints one line every few seconds while Spark works: stage and task counts."""

    def __init__(self, spark: Any, label: Callable[[], str], every_s: float = 5.0) -> None:
        self.spark = spark
        self.label = label
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rollup-progress")

    def _run(self) -> None:
        tracker = self.spark.sparkContext.statusTracker()
        started = time.monotonic()
        while not self._stop.wait(self.every_s):
            done = total = 0
            for stage_id in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    done += info.numCompletedTasks
                    total += info.numTasks
            print(
                f"rollup: {self.label()}: {done}/{total} tasks, "
                f"{time.monotonic() - started:.0f}s elapsed",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def default_cache(out: str) -> str | None:
    """``<out>/_cache`` for a local output directory; None (no cache) for a URL such as
    ``hdfs://`` or ``s3a://``, which plain file I/O cannot reach."""
    if "://" in out and not out.startswith("file://"):
        return None
    return os.path.join(out.removeprefix("file://"), "_cache")


def run_rollup(
    spark: Any,
    journals: SourceSpec | Sequence[str],
    out: str,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    *,
    progress: bool = True,
    tables: tuple[str, ...] = TABLES,
    cache: str | bool | None = True,
    settings: SparkSettings | None = None,
) -> CacheStats:
    """Write the rollup tables for ``journals`` (a :class:`~taproom.spark.sources.SourceSpec`:
    directories and hubs, or journal directories) to ``out/<table>/date=YYYY-MM-DD/``.

    ``cache``: True for :func:`default_cache`, a directory, or False/None for none. With a
    cache, ``request_samples`` and ``request_ids`` are written per segment
    (:mod:`~taproom.spark.jobs.parts`, whatever the range), else whole.
    ``settings``: the ``[spark]`` section (the drill-down tables' bounds).
    """
    settings = settings or SparkSettings()
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ValueError(f"unknown tables {sorted(unknown)}; known: {sorted(TABLES)}")
    lo, hi = day_range(since, until)
    cache_dir = default_cache(out) if cache is True else (cache or None)
    if cache_dir is None:
        drop_markers(out, tables)  # whole date directories replace the parts
    current = {"table": "parsing sealed segments"}
    with _Progress(spark, lambda: current["table"]) if progress else _NoProgress():
        parsed, stats = parsed_events(spark, journals, cache_dir, persist_live=True)
        try:
            current["table"] = "parsing the live segments"
            for frame in stats.persisted:
                frame.count()  # once, before the tables' jobs all want it at the same time
            frames = rollup_tables(parsed, lo, hi, settings)
            current["table"] = ", ".join(tables)

            def write(name: str) -> None:
                if cache_dir is not None and name in PART_TABLES:
                    stats.parts_written[name] = len(write_parts(spark, stats, out, name, settings))
                    return
                path = os.path.join(out, name)
                frame = frames[name]
                writer_options = {}
                if name == "request_ids":
                    # Sorted files with small row groups: a lookup by id reads the one row
                    # group per file whose min/max holds it. By id alone: the partitioned
                    # write keeps a writer open per date (spark.sql.maxConcurrentOutputFileWriters,
                    # session.py), so each date's file gets its rows in id order. With the
                    # date leading, every row of a day had the same sort prefix and each
                    # comparison fell through to the whole key (-0.7 CPU-s of ~5.6 at 1M
                    # requests, docs/console.md). A task with more dates than open writers
                    # sorts the rest by date (Spark's fallback), which can interleave id runs:
                    # a lookup is still right (min/max per group), it may read more groups.
                    frame = frame.sortWithinPartitions("request_id")
                    writer_options["parquet.block.size"] = str(settings.index_row_group_bytes)
                writer = frame.write.mode("overwrite").partitionBy("date").options(**writer_options)
                writer.parquet(path)

            # The tables' jobs run side by side: while one is in a serial part (planning, its
            # last task, the commit), the other cores work on the next (about 20% less wall
            # time than one after the other on local[2]).
            with ThreadPoolExecutor(max(1, len(tables)), thread_name_prefix="rollup-write") as pool:
                for done in [pool.submit(write, name) for name in tables]:
                    done.result()
        finally:
            stats.release()
    return stats


class _NoProgress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
