"""The ``[spark]`` section: bounds of the drill-down tables the rollup and stream jobs write,
and how often the stream job starts a query again whose source's planner missed Spark's
connect-back timeout.

Declared here, without pyspark, so that ``taproom validate`` and ``taproom config defaults``
know the section on a hub that has no Spark extra. ``taproom spark rollup|stream --config``
read it (docs/spark.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import config_section, setting

__all__ = ["SparkSettings"]


@config_section("spark")
@dataclass(frozen=True)
class SparkSettings:
    slow_requests_per_action: int = setting(
        10,
        "the N slowest requests kept per minute and action (logjam's request list shows the "
        "slowest few; the day's slowest of an action are among its minutes' slowest)",
        min=1,
        max=1000,
    )
    failed_requests_per_action: int = setting(
        50,
        "failed requests (status >= 500, severity >= error, an exception) kept per minute and "
        "action; the rest are counted: an outage of one action cannot make the table as big as "
        "the traffic (50 a minute is 72,000 a day per action, more than anyone reads)",
        min=1,
        max=100_000,
    )
    exception_samples: int = setting(
        5,
        "requests kept per exception class, minute and action as examples to open (0: none, "
        "the exceptions table without its samples column)",
        min=0,
        max=1000,
    )
    index_row_group_bytes: int = setting(
        1 << 20,
        "Parquet row groups of the batch job's request-id index: a lookup reads one group per "
        "file (min/max of the sorted ids), so smaller groups read less (1 MiB: ~25,000 ids)",
        min=64 << 10,
        max=128 << 20,
    )
    planner_start_retries: int = setting(
        3,
        "times in a row ``taproom spark stream`` starts a query again from its checkpoint when "
        "the Python process planning its source missed Spark's fixed 10 s to connect back to "
        "the JVM (PythonWorkerFactory, not configurable; a loaded machine misses it now and "
        "then): each retry is logged and counted; more misses in a row are a machine too busy "
        "to run the job, and end it with exit 1 (0: never retried)",
        min=0,
        max=100,
    )
