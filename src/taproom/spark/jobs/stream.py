"""``taproom spark stream``: the rollups as Structured Streaming queries, exactly once.

One query per table (requests, exceptions, logs), each with its own checkpoint under
``checkpoint/<table>``. The journal source's offsets and the aggregation state live in the
checkpoint; the Parquet file sink commits each micro-batch in ``out/<table>/_spark_metadata``,
so readers of ``out/<table>`` see every micro-batch exactly once even when the driver is
killed half-way through writing one (its files are left out of the log and ignored).

Append mode with a watermark on the minute: a minute's row is written once the watermark
(latest event time seen minus ``watermark``) has passed it, and then never changes. After a
stop, SIGKILL or restart, the finalized minutes equal the batch job's rows.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from .. import transforms as T

__all__ = ["run_stream", "start_stream"]


def _events(spark: Any, journals: list[str], max_records: int | None) -> Any:
    from .rollup import ROLLUP_COLUMNS

    reader = (
        spark.readStream.format("taproom")
        .option("journals", ",".join(journals))
        .option("columns", ROLLUP_COLUMNS)
    )
    if max_records:
        reader = reader.option("maxRecordsPerTrigger", str(max_records))
    return reader.load()


def start_stream(
    spark: Any,
    journals: list[str],
    out: str,
    checkpoint: str,
    *,
    watermark: str = "10 minutes",
    trigger_seconds: float = 10.0,
    available_now: bool = False,
    max_records: int | None = None,
    tables: tuple[str, ...] = ("requests", "exceptions", "logs"),
) -> list[Any]:
    """Start one query per table in ``tables`` and return them (running)."""
    builders = {
        "requests": lambda ev: ev.transform(T.logjam_requests).transform(
            T.request_rollup, watermark
        ),
        "exceptions": lambda ev: ev.transform(T.logjam_requests).transform(
            T.exception_rollup, watermark
        ),
        "logs": lambda ev: ev.transform(T.log_rollup, watermark),
    }
    queries = []
    unknown = set(tables) - set(builders)
    if unknown:
        raise ValueError(f"unknown tables {sorted(unknown)}; known: {sorted(builders)}")
    for name in tables:
        build = builders[name]
        writer = (
            build(_events(spark, journals, max_records))
            .writeStream.format("parquet")
            .outputMode("append")
            .partitionBy("date")
            .option("path", os.path.join(out, name))
            .option("checkpointLocation", os.path.join(checkpoint, name))
            .queryName(f"taproom_{name}")
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{trigger_seconds} seconds")
        queries.append(writer.start())
    return queries


def run_stream(spark: Any, journals: list[str], out: str, checkpoint: str, **kwargs: Any) -> int:
    """Run until stopped (SIGTERM/SIGINT stop cleanly), or until caught up with
    ``available_now``. Returns 0, or 1 when a query failed."""
    queries = start_stream(spark, journals, out, checkpoint, **kwargs)
    stopping = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        stopping.set()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        while any(q.isActive for q in queries) and not stopping.is_set():
            for q in queries:
                if q.isActive:
                    q.awaitTermination(0.5)
        for q in queries:
            if q.isActive:
                q.stop()
            if q.exception() is not None:
                failed = True
                print(f"stream {q.name}: {q.exception()}", flush=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 1 if failed else 0
