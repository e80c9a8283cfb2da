"""The SparkSession the ``taproom spark`` commands use, and what every job expects of it."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["configure", "get_session"]

# UTC everywhere: minutes and dates in the rollups must not depend on the machine's zone.
SESSION_CONF = {
    "spark.sql.session.timeZone": "UTC",
    # Re-running a date range replaces exactly the date partitions it writes.
    "spark.sql.sources.partitionOverwriteMode": "dynamic",
    "spark.ui.showConsoleProgress": "false",
    # Partitioned writes (rollup tables by date, the parsed-segment cache by segment) keep a
    # writer open per partition value instead of sorting every task's rows by it first: a
    # task's rows fall in few dates and in one segment (~15% less time to build the cache).
    "spark.sql.maxConcurrentOutputFileWriters": "16",
    # Timestamps as Parquet's INT64 microseconds, not the legacy INT96: those have min/max
    # statistics, which the console's request-id lookup prunes row groups with (by minute).
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}


def configure(spark: Any) -> Any:
    """Register taproom's data sources and set the session options the jobs rely on."""
    from ..datasource import register

    for key, value in SESSION_CONF.items():
        if key.startswith("spark.sql."):
            spark.conf.set(key, value)
    register(spark)
    return spark


def get_session(app_name: str, master: str | None = None, shuffle_partitions: int = 0) -> Any:
    """A session for the CLI: ``local[2]`` unless ``--master`` or ``spark-submit`` say otherwise.

    Executors run this interpreter (``PYSPARK_PYTHON``) so they can import taproom.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    elif not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Not under spark-submit (which sets the gateway port and its own master).
        builder = builder.master("local[2]")
        shuffle_partitions = shuffle_partitions or 2
    builder = builder.config("spark.ui.enabled", "false")
    for key, value in SESSION_CONF.items():
        builder = builder.config(key, value)
    if shuffle_partitions:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return configure(spark)
