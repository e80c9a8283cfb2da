"""``taproom spark report``: what a person reads first, from the rollup tables.

Per app and env: requests, error rate (5xx share), 4xx share and apdex over everything in the
tables; then the slowest actions by total time consumed (logjam's default ordering: the
actions that cost the most server time), with mean and the worst minute's p95.
"""

from __future__ import annotations

import os
from typing import Any

from ..sources import SourceSpec

__all__ = ["report_text"]


def report_text(spark: Any, source: str | SourceSpec, top: int = 10) -> str:
    """The report from the rollup tables in directory ``source``, or computed on the fly from
    the events of the journals of a :class:`~taproom.spark.sources.SourceSpec` (nothing is
    written)."""
    from pyspark.sql import functions as F

    if isinstance(source, SourceSpec):
        from .rollup import ROLLUP_COLUMNS, read_events, rollup_tables

        events = read_events(spark, source, columns=ROLLUP_COLUMNS)
        requests = rollup_tables(events)["requests"]
    else:
        requests = spark.read.parquet(os.path.join(source, "requests"))
    per_app = (
        requests.groupBy("app", "env")
        .agg(
            F.sum("count").alias("requests"),
            F.sum("status_5xx").alias("errors"),
            F.sum("status_4xx").alias("client_errors"),
            F.sum("apdex_satisfied").alias("satisfied"),
            F.sum("apdex_tolerating").alias("tolerating"),
        )
        .orderBy(F.desc("requests"))
        .collect()
    )
    slow = (
        requests.groupBy("app", "env", "action")
        .agg(
            F.sum("count").alias("requests"),
            F.sum("total_time_sum").alias("time"),
            F.max("total_time_p95").alias("p95"),
        )
        .orderBy(F.desc("time"))
        .limit(top)
        .collect()
    )
    lines = ["Apps", f"  {'app-env':<32} {'requests':>10} {'5xx':>7} {'4xx':>7} {'apdex':>6}"]
    for row in per_app:
        n = row["requests"] or 0
        apdex = (row["satisfied"] + row["tolerating"] / 2) / n if n else 0.0
        lines.append(
            f"  {row['app'] + '-' + row['env']:<32} {n:>10,} "
            f"{100 * row['errors'] / n if n else 0:>6.2f}% "
            f"{100 * row['client_errors'] / n if n else 0:>6.2f}% {apdex:>6.3f}"
        )
    lines += [
        "",
        f"Top {top} slow actions (by total time)",
        f"  {'app-env':<20} {'action':<40} {'requests':>9} {'total s':>9} {'mean ms':>8} "
        f"{'p95 ms':>8}",
    ]
    for row in slow:
        n = row["requests"] or 0
        lines.append(
            f"  {row['app'] + '-' + row['env']:<20} {row['action'][:40]:<40} {n:>9,} "
            f"{row['time'] / 1000:>9.1f} {row['time'] / n if n else 0:>8.1f} "
            f"{row['p95'] or 0:>8.1f}"
        )
    return "\n".join(lines)
