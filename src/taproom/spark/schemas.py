"""Explicit Spark schemas: the event record, logjam request payloads, and the rollup tables.

Every DataFrame the pipeline reads or writes has its schema spelled out here, so a change in
a producer's JSON shows up as a reviewed diff rather than as silently inferred columns.
"""

from __future__ import annotations

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from .logjamdoc import (
    LOGJAM_CALL_RESOURCES,
    LOGJAM_FRONTEND_RESOURCES,
    LOGJAM_MEMORY_RESOURCES,
    LOGJAM_RESOURCES,
    LOGJAM_TIME_RESOURCES,
)

__all__ = [
    "EVENT_PAYLOAD_SCHEMA",
    "EVENT_SCHEMA",
    "EXCEPTION_ROLLUP_SCHEMA",
    "HISTOGRAM_TYPE",
    "KEG_LONG_SCHEMA",
    "LOGJAM_CALL_RESOURCES",
    "LOGJAM_FRONTEND_RESOURCES",
    "LOGJAM_MEMORY_RESOURCES",
    "LOGJAM_REQUEST_SCHEMA",
    "LOGJAM_RESOURCES",
    "LOGJAM_TIME_RESOURCES",
    "LOG_ROLLUP_SCHEMA",
    "PARSED_EVENT_SCHEMA",
    "REQUEST_ID_SCHEMA",
    "REQUEST_ROLLUP_SCHEMA",
    "REQUEST_SAMPLE_SCHEMA",
    "RESOURCES_SCHEMA",
    "SAMPLE_REF_TYPE",
    "TELEMETRY_ROLLUP_SCHEMA",
    "TIMES_SCHEMA",
]

# One row per journal record (records.Record), plus the journal it came from: offsets are
# unique per journal, so (journal, offset) identifies an event across many hubs.
EVENT_SCHEMA = StructType(
    [
        StructField("journal", StringType(), False),
        StructField("offset", LongType(), False),
        StructField("received", TimestampType(), False),
        StructField("protocol", StringType(), False),
        StructField("stream", StringType(), False),
        StructField("topic", StringType(), False),
        StructField("producer", StringType(), False),
        StructField("seq", LongType(), False),
        StructField("event_id", StringType(), False),
        StructField("ts", TimestampType(), True),
        StructField("content_type", StringType(), False),
        StructField("payload", BinaryType(), False),
        StructField("attrs", MapType(StringType(), StringType(), True), False),
    ]
)

RESOURCES_SCHEMA = StructType([StructField(name, DoubleType()) for name in LOGJAM_RESOURCES])
# The time resources alone (ms): a drill-down row's "time by resource".
TIMES_SCHEMA = StructType([StructField(name, DoubleType()) for name in LOGJAM_TIME_RESOURCES])

# The fields of a logjam request payload the rollups use (logjam_agent's request JSON).
# Anything else in the payload is ignored; a field of another type becomes null and then
# takes the importer's default (a resource: nothing added).
LOGJAM_REQUEST_SCHEMA = StructType(
    [
        StructField("action", StringType()),
        StructField("started_at", StringType()),
        StructField("started_ms", LongType()),
        StructField("total_time", DoubleType()),
        StructField("code", LongType()),
        StructField("severity", LongType()),
        StructField("lines", ArrayType(ArrayType(StringType()))),
        StructField("exceptions", ArrayType(StringType())),
        # Where the request can be found again: logjam_agent sends a version 1 UUID as 32 hex
        # digits (its time is the request's start), and the host it ran on.
        StructField("request_id", StringType()),
        StructField("host", StringType()),
        *RESOURCES_SCHEMA.fields,
    ]
)

# What one parse of any JSON payload reads: the request fields, plus the level fields the log
# rollup wants. severity is read as text (a JSON number comes back as its digits) so that one
# parse serves both the request's numeric severity and the log level ("3" -> "error").
EVENT_PAYLOAD_SCHEMA = StructType(
    [
        *(f for f in LOGJAM_REQUEST_SCHEMA.fields if f.name != "severity"),
        StructField("severity", StringType()),
        StructField("level", StringType()),
    ]
)

# One parsed row per event (transforms.parse_events), as the rollups and the parsed-segment
# cache (spark/segcache.py) use it. Request columns are null for events that are not requests.
PARSED_EVENT_SCHEMA = StructType(
    [
        # Where the event is stored: the drill-down tables point back into the journal.
        StructField("journal", StringType(), True),
        StructField("offset", LongType(), True),
        StructField("protocol", StringType(), False),
        StructField("stream", StringType(), False),
        StructField("topic", StringType(), False),
        StructField("log_minute", TimestampType(), False),
        StructField("level", StringType(), False),
        StructField("bytes", LongType(), False),
        StructField("is_request", BooleanType(), False),
        StructField("app", StringType(), True),
        StructField("env", StringType(), True),
        StructField("frontend", BooleanType(), True),
        StructField("started", TimestampType(), True),
        StructField("minute", TimestampType(), True),
        StructField("action", StringType(), True),
        StructField("module", StringType(), True),
        StructField("code", LongType(), True),
        StructField("total_time", DoubleType(), True),
        StructField("severity", LongType(), True),
        StructField("exceptions", ArrayType(StringType()), True),
        StructField("resources", RESOURCES_SCHEMA, True),
        StructField("request_id", StringType(), True),
        StructField("host", StringType(), True),
    ]
)

# The total_time histogram of a rollup row: (bucket, count) pairs sorted by bucket
# (spark/buckets.py); rows of many minutes or actions merge by adding counts per bucket.
HISTOGRAM_TYPE = ArrayType(
    StructType([StructField("b", IntegerType(), False), StructField("n", LongType(), False)]),
    False,
)

_DIMENSIONS = [
    StructField("minute", TimestampType(), False),
    StructField("app", StringType(), False),
    StructField("env", StringType(), False),
    StructField("action", StringType(), False),
    StructField("module", StringType(), False),
]

REQUEST_ROLLUP_SCHEMA = StructType(
    [
        *_DIMENSIONS,
        StructField("date", StringType(), False),
        StructField("frontend", LongType(), False),
        StructField("count", LongType(), False),
        StructField("total_time_sum", DoubleType(), False),
        StructField("total_time_max", DoubleType(), False),
        StructField("total_time_p50", DoubleType(), True),
        StructField("total_time_p90", DoubleType(), True),
        StructField("total_time_p95", DoubleType(), True),
        StructField("total_time_p99", DoubleType(), True),
        StructField("apdex_happy", LongType(), False),
        StructField("apdex_satisfied", LongType(), False),
        StructField("apdex_tolerating", LongType(), False),
        StructField("apdex_frustrated", LongType(), False),
        StructField("apdex", DoubleType(), False),
        StructField("status_1xx", LongType(), False),
        StructField("status_2xx", LongType(), False),
        StructField("status_3xx", LongType(), False),
        StructField("status_4xx", LongType(), False),
        StructField("status_5xx", LongType(), False),
        StructField("status_other", LongType(), False),
        StructField("severity_debug", LongType(), False),
        StructField("severity_info", LongType(), False),
        StructField("severity_warn", LongType(), False),
        StructField("severity_error", LongType(), False),
        StructField("severity_fatal", LongType(), False),
        StructField("severity_unknown", LongType(), False),
        StructField("exceptions", LongType(), False),
        StructField("requests_with_exceptions", LongType(), False),
        *[StructField(f"{name}_sum", DoubleType(), False) for name in LOGJAM_RESOURCES],
        StructField("total_time_histogram", HISTOGRAM_TYPE, False),
    ]
)

# A request the drill-down can open: its id and where it is stored.
SAMPLE_REF_TYPE = StructType(
    [
        StructField("request_id", StringType(), True),
        StructField("journal", StringType(), True),
        StructField("offset", LongType(), True),
    ]
)

EXCEPTION_ROLLUP_SCHEMA = StructType(
    [
        *_DIMENSIONS,
        StructField("date", StringType(), False),
        StructField("exception", StringType(), False),
        StructField("count", LongType(), False),
        # The first [spark] exception_samples requests (journal order) that raised it.
        StructField("samples", ArrayType(SAMPLE_REF_TYPE, True), False),
    ]
)

# The drill-down rows (transforms.request_samples): per minute and action the slowest
# requests and the failed ones (bounded; failed_count counts them all), one row per request.
REQUEST_SAMPLE_SCHEMA = StructType(
    [
        *_DIMENSIONS,
        StructField("frontend", BooleanType(), False),
        StructField("date", StringType(), False),
        StructField("failed_count", LongType(), False),
        StructField("slow", BooleanType(), False),
        StructField("failed", BooleanType(), False),
        StructField("request_id", StringType(), True),
        StructField("started", TimestampType(), False),
        StructField("code", LongType(), False),
        StructField("total_time", DoubleType(), False),
        StructField("severity", LongType(), False),
        StructField("exceptions", ArrayType(StringType()), False),
        StructField("host", StringType(), True),
        StructField("times", TIMES_SCHEMA, False),
        StructField("journal", StringType(), True),
        StructField("offset", LongType(), True),
    ]
)

# The request-id index (transforms.request_index): one row per request that has an id.
REQUEST_ID_SCHEMA = StructType(
    [
        StructField("request_id", StringType(), False),
        StructField("journal", StringType(), True),
        StructField("offset", LongType(), True),
        StructField("app", StringType(), False),
        StructField("env", StringType(), False),
        StructField("minute", TimestampType(), False),
        StructField("date", StringType(), False),
    ]
)

LOG_ROLLUP_SCHEMA = StructType(
    [
        StructField("minute", TimestampType(), False),
        StructField("date", StringType(), False),
        StructField("protocol", StringType(), False),
        StructField("stream", StringType(), False),
        StructField("level", StringType(), False),
        StructField("count", LongType(), False),
        StructField("bytes", LongType(), False),
    ]
)

# The long form of keg data: one row per (sample, item).
KEG_LONG_SCHEMA = StructType(
    [
        StructField("keg", StringType(), False),
        StructField("tap", StringType(), False),
        StructField("ts", TimestampType(), False),
        StructField("ts_ns", LongType(), False),
        StructField("item", StringType(), False),
        StructField("value", DoubleType(), True),
    ]
)

TELEMETRY_ROLLUP_SCHEMA = StructType(
    [
        StructField("window_start", TimestampType(), False),
        StructField("window_end", TimestampType(), False),
        StructField("tap", StringType(), False),
        StructField("item", StringType(), False),
        StructField("count", LongType(), False),
        StructField("min", DoubleType(), True),
        StructField("max", DoubleType(), True),
        StructField("mean", DoubleType(), True),
        StructField("last", DoubleType(), True),
    ]
)
