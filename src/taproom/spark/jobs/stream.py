"""``taproom spark stream``: the rollups as Structured Streaming queries, exactly once.

One query per table (requests, exceptions, logs, request_samples, request_ids), each with its own checkpoint under
``checkpoint/<table>``. The journal source's offsets and the aggregation state live in the
checkpoint; the Parquet file sink commits each micro-batch in ``out/<table>/_spark_metadata``,
so readers of ``out/<table>`` see every micro-batch exactly once even when the driver is
killed half-way through writing one (its files are left out of the log and ignored).

Append mode with a watermark on the minute: a minute's row is written once the watermark
(latest event time seen minus ``watermark``) has passed it, and then never changes. After a
stop, SIGKILL or restart, the finalized minutes equal the batch job's rows.

Journals are directories or hubs (:class:`~taproom.spark.sources.SourceSpec`). Each query
reports its committed offsets to the journals' cursor ``<cursor>-<table>`` (the hub's
retention, with ``retain_unread``, keeps what it has not read). A query that fails because a
hub is down is started again from its checkpoint until the hub is back: nothing is read twice
or skipped, because the checkpoint holds both ends of the micro-batch that failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import transforms as T
from ..settings import SparkSettings
from ..sources import SourceSpec

__all__ = ["TABLES", "run_stream", "start_query", "start_stream"]

TABLES = ("requests", "exceptions", "logs", "request_samples", "request_ids")
# What marks a query that failed because a hub could not be reached (the error's class name
# is in the Python traceback Spark carries over): such a query is restarted from its checkpoint.
_HUB_DOWN = "HubUnavailable"
# What marks a query whose source's planner (a Python process Spark starts for the data
# source) missed Spark's fixed 10 s to connect back to the JVM (PythonWorkerFactory's
# SparkException; not configurable): the query never read anything and is started again
# from its checkpoint, up to ``[spark] planner_start_retries`` times in a row.
_NO_CONNECT_BACK = "Python worker failed to connect back"
# How long a query's start may wait for the one before to initialize its source.
INIT_WAIT_S = 120.0


def _events(spark: Any, spec: SourceSpec, max_records: int | None, cursor: str | None) -> Any:
    from .rollup import ROLLUP_COLUMNS

    reader = (
        spark.readStream.format("taproom")
        .options(**spec.options())
        .option("columns", ROLLUP_COLUMNS)
    )
    if max_records:
        reader = reader.option("maxRecordsPerTrigger", str(max_records))
    if cursor:
        reader = reader.option("cursor", cursor)
    return reader.load()


def start_query(
    spark: Any,
    journals: SourceSpec | Sequence[str],
    table: str,
    out: str,
    checkpoint: str,
    *,
    watermark: str = "10 minutes",
    trigger_seconds: float = 10.0,
    available_now: bool = False,
    max_records: int | None = None,
    cursor: str | None = "taproom-stream",
    settings: SparkSettings | None = None,
) -> Any:
    """Start the query of one table (its checkpoint is ``checkpoint/<table>``); it reports
    its committed offsets to the cursor ``<cursor>-<table>`` of each journal. ``settings``:
    the ``[spark]`` section (the drill-down tables' bounds)."""
    settings = settings or SparkSettings()
    builders = {
        "requests": lambda ev: ev.transform(T.logjam_requests).transform(
            T.request_rollup, watermark
        ),
        "exceptions": lambda ev: ev.transform(T.logjam_requests).transform(
            T.exception_rollup, watermark, settings.exception_samples
        ),
        "logs": lambda ev: ev.transform(T.log_rollup, watermark),
        "request_samples": lambda ev: ev.transform(T.logjam_requests).transform(
            T.request_samples,
            watermark,
            settings.slow_requests_per_action,
            settings.failed_requests_per_action,
        ),
        # A projection: no state, no watermark; written as each micro-batch commits.
        "request_ids": lambda ev: ev.transform(T.logjam_requests).transform(T.request_index),
    }
    if table not in builders:
        raise ValueError(f"unknown table {table!r}; known: {sorted(builders)}")
    events = _events(
        spark, SourceSpec.of(journals), max_records, f"{cursor}-{table}" if cursor else None
    )
    writer = (
        builders[table](events)
        .writeStream.format("parquet")
        .outputMode("append")
        .partitionBy("date")
        .option("path", os.path.join(out, table))
        .option("checkpointLocation", os.path.join(checkpoint, table))
        .queryName(f"taproom_{table}")
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{trigger_seconds} seconds")
    return writer.start()


def start_stream(
    spark: Any,
    journals: SourceSpec | Sequence[str],
    out: str,
    checkpoint: str,
    *,
    tables: tuple[str, ...] = TABLES,
    **options: Any,
) -> list[Any]:
    """Start one query per table in ``tables`` and return them (running).

    Each query is started once the one before has initialized its source: initializing
    starts a Python process (the data source's planner) that must connect back to the JVM
    within Spark's fixed timeout, and five of them starting at once on a loaded two-core
    machine missed it (``Python worker failed to connect back``)."""
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ValueError(f"unknown tables {sorted(unknown)}; known: {sorted(TABLES)}")
    queries = []
    for table in tables:
        query = start_query(spark, journals, table, out, checkpoint, **options)
        _wait_initialized(query)
        queries.append(query)
    return queries


def _wait_initialized(query: Any, timeout_s: float = INIT_WAIT_S) -> None:
    """Until ``query`` has initialized its sources (or ended, or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while query.isActive and time.monotonic() < deadline:
        if not _initializing(query):
            return
        time.sleep(0.1)


def _initializing(query: Any) -> bool:
    """Whether ``query`` is still initializing its sources (its planner not yet connected)."""
    return str(query.status.get("message", "")).startswith("Initializing")


def run_stream(
    spark: Any,
    journals: SourceSpec | Sequence[str],
    out: str,
    checkpoint: str,
    *,
    tables: tuple[str, ...] = TABLES,
    retry_seconds: float = 10.0,
    **options: Any,
) -> int:
    """Run until stopped (SIGTERM/SIGINT stop cleanly), or until caught up with
    ``available_now``. A query that failed because a hub could not be reached is started
    again from its checkpoint every ``retry_seconds`` (not with ``available_now``: that run
    ends, failed). A query whose source's planner missed Spark's connect-back timeout is
    started again at once, up to ``[spark] planner_start_retries`` times in a row (each
    logged and counted). Returns 0, or 1 when a query failed otherwise."""
    from pyspark.errors import StreamingQueryException

    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ValueError(f"unknown tables {sorted(unknown)}; known: {sorted(TABLES)}")
    settings = options.get("settings") or SparkSettings()
    # Planner connect-back misses in a row per query (reset once its source is initialized),
    # and in all.
    missed: dict[str, int] = {}
    missed_total = 0

    def may_retry(table: str, error: object) -> bool:
        """Whether ``error`` is a planner's missed connect-back that may be retried (and if so
        count and log it)."""
        nonlocal missed_total
        if _NO_CONNECT_BACK not in str(error):
            return False
        if missed.get(table, 0) >= settings.planner_start_retries:
            return False
        missed[table] = missed.get(table, 0) + 1
        missed_total += 1
        print(
            f"stream taproom_{table}: its source's Python planner missed Spark's 10 s to "
            f"connect back; starting it again from the checkpoint (miss {missed[table]} in a "
            f"row of at most {settings.planner_start_retries}; {missed_total} in all)",
            file=sys.stderr,
            flush=True,
        )
        return True

    def start(table: str) -> Any:
        """Start ``table``'s query and wait until its source is initialized (see
        start_stream); a start that fails on a planner's missed connect-back is retried."""
        while True:
            try:
                query = start_query(spark, journals, table, out, checkpoint, **options)
            except Exception as exc:
                if may_retry(table, exc):
                    continue
                raise
            _wait_initialized(query)
            return query

    queries = {table: start(table) for table in tables}
    retry_at: dict[str, float] = {}  # queries that failed on a hub, and when to restart them
    running = set(tables)  # queries not finished for good
    stopping = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        stopping.set()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        while not stopping.is_set() and running:
            for table in sorted(running):
                q = queries[table]
                if q.isActive:
                    if missed.get(table) and not _initializing(q):
                        del missed[table]  # its planner connected: the next miss is new
                    with contextlib.suppress(StreamingQueryException):  # looked at below
                        q.awaitTermination(0.5)
                    continue
                if table in retry_at:
                    if time.monotonic() >= retry_at[table]:
                        del retry_at[table]
                        try:
                            queries[table] = start_query(spark, journals, table, out,
                                                         checkpoint, **options)  # fmt: skip
                        except Exception as exc:  # the hub may still be down: try again later
                            if _HUB_DOWN not in str(exc):
                                raise
                            retry_at[table] = time.monotonic() + retry_seconds
                    continue
                error = q.exception()
                if error is None and not options.get("available_now"):
                    time.sleep(0.2)  # a query that just ended may not show its error yet
                    error = q.exception()
                if (
                    error is not None
                    and _HUB_DOWN in str(error)
                    and not options.get("available_now")
                ):
                    print(
                        f"stream {q.name}: a hub is unavailable; restarting from the checkpoint "
                        f"in {retry_seconds:g}s: {_first_line(error)}",
                        file=sys.stderr,
                        flush=True,
                    )
                    retry_at[table] = time.monotonic() + retry_seconds
                    continue
                if error is not None and may_retry(table, error):
                    queries[table] = start(table)
                    continue
                running.discard(table)  # finished (available_now), or failed for good
                if error is not None:
                    failed = True
                    print(f"stream {q.name}: {error}", flush=True)
            if running and not any(queries[t].isActive for t in running):
                time.sleep(0.5)
        for q in queries.values():
            if q.isActive:
                q.stop()
        if missed_total:
            print(
                f"stream: {missed_total} query start(s) retried after a planner missed Spark's "
                "connect-back timeout",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 1 if failed else 0


def _first_line(error: Any) -> str:
    """The line of a Spark error that names the hub (the rest is JVM and Python stacks)."""
    text = str(error)
    for line in text.splitlines():
        if _HUB_DOWN in line:
            return line.strip()
    return text.splitlines()[0] if text else ""
