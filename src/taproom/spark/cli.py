"""``taproom spark rollup | stream | kegs | report``: the command-line face of the jobs.

This module is imported by ``taproom`` for every command, so it must not import pyspark: the
hub runs without the Spark extra. Everything Spark happens inside the command functions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from typing import Any

__all__ = ["register_commands"]

# The jobs' TABLES (spelled out here: importing the jobs would import pyspark).
ALL_TABLES = "requests,exceptions,logs,request_samples,request_ids"


def _when(text: str) -> dt.datetime:
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO date/time: {text!r}") from None
    return value


def _session(args: argparse.Namespace, name: str, shuffle_partitions: int = 0) -> Any:
    try:
        from .jobs.session import get_session
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
        raise SystemExit(
            f"taproom spark needs the Spark extra (pip install 'taproom[spark]'): {exc}"
        ) from None
    return get_session(f"taproom-{name}", args.master, shuffle_partitions)


def _journals(args: argparse.Namespace, required: bool = True) -> Any:
    """The --journal directories and --hub addresses (token: TAPROOM_HUB_TOKEN) as a spec."""
    from .sources import SourceSpec

    if required and not (args.journal or args.hub):
        raise SystemExit("taproom spark: give --journal DIR or --hub ADDR (or several)")
    return SourceSpec(tuple(args.journal or ()), tuple(args.hub or ()))


def _settings(args: argparse.Namespace) -> Any:
    """The ``[spark]`` section of ``--config`` (defaults without one)."""
    from ..config import load_config
    from ..errors import ConfigError

    try:
        return load_config(args.config).section("spark")
    except ConfigError as exc:
        raise SystemExit(f"taproom spark: config error: {exc}") from None


def _tables(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    tables = tuple(t for t in text.split(",") if t)
    unknown = sorted(set(tables) - set(known))
    if unknown:
        raise SystemExit(f"taproom spark: unknown tables {unknown}; known: {', '.join(known)}")
    return tables


def cmd_rollup(args: argparse.Namespace) -> int:
    from .jobs.rollup import TABLES, run_rollup

    journals = _journals(args)
    settings = _settings(args)
    tables = _tables(args.tables, TABLES)
    spark = _session(args, "rollup")
    started = time.monotonic()
    cache: str | bool = False if args.no_cache else (args.cache or True)
    stats = run_rollup(
        spark,
        journals,
        args.out,
        args.since,
        args.until,
        progress=not args.quiet,
        cache=cache,
        tables=tables,
        settings=settings,
    )
    print(
        f"rollup: wrote {args.out} in {time.monotonic() - started:.1f}s "
        f"(sealed segments: {stats.cached} from the cache, {stats.built} parsed and cached; "
        f"{stats.live} read live)",
        file=sys.stderr,
    )
    if stats.parts_written:
        written = ", ".join(f"{t} {n}" for t, n in sorted(stats.parts_written.items()))
        print(f"rollup: drill-down parts written (live and new sealed): {written}", file=sys.stderr)
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    from .jobs.stream import TABLES, run_stream

    journals = _journals(args)
    settings = _settings(args)
    tables = _tables(args.tables, TABLES)
    spark = _session(args, "stream", args.shuffle_partitions)
    return run_stream(
        spark,
        journals,
        args.out,
        args.checkpoint,
        watermark=args.watermark,
        trigger_seconds=args.trigger_seconds,
        available_now=args.available_now,
        max_records=args.max_records_per_trigger,
        tables=tables,
        cursor=args.cursor or None,
        retry_seconds=args.retry_seconds,
        settings=settings,
    )


def cmd_kegs(args: argparse.Namespace) -> int:
    from .jobs.kegs import run_kegs

    spark = _session(args, "kegs")
    uuids = run_kegs(spark, args.source, args.out, args.window)
    print(f"kegs: {len(uuids)} formats written to {args.out}", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .jobs.report import report_text

    journals = _journals(args, required=False)
    if bool(args.source) == bool(journals.journals or journals.hubs):
        raise SystemExit("taproom spark report: give --in DIR, or --journal/--hub to read events")
    spark = _session(args, "report")
    print(report_text(spark, args.source or journals, args.top))
    return 0


def register_commands(subparsers: Any) -> None:
    spark = subparsers.add_parser("spark", help="Spark jobs over journals and kegs")
    sub = spark.add_subparsers(dest="spark_command", required=True, metavar="JOB")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--master", metavar="URL", help="Spark master (default local[2]; spark-submit's)"
        )

    def config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            "-c",
            metavar="PATH",
            default=os.environ.get("TAPROOM_CONFIG"),
            help="TOML configuration for the [spark] section (default: embedded defaults; env "
            "TAPROOM_CONFIG)",
        )

    def journals(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--journal", action="append", metavar="DIR", help="journal directory (repeatable)"
        )
        p.add_argument(
            "--hub",
            action="append",
            metavar="ADDR",
            help="hub web listener host:port, read over the network (repeatable; its [web] "
            "token from $TAPROOM_HUB_TOKEN)",
        )

    p = sub.add_parser("rollup", help="batch rollups of journals to Parquet (by date)")
    journals(p)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--since", type=_when, metavar="T", help="ISO time; widened to the UTC day")
    p.add_argument("--until", type=_when, metavar="T", help="ISO time; widened to the UTC day")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--cache",
        metavar="DIR",
        help="parsed-segment cache (default OUT/_cache; none when OUT is a URL)",
    )
    p.add_argument("--no-cache", action="store_true", help="parse every segment, keep nothing")
    p.add_argument(
        "--tables",
        default=ALL_TABLES,
        help="comma-separated tables to write (default: all)",
    )
    config(p)
    common(p)
    p.set_defaults(func=cmd_rollup)

    p = sub.add_parser("stream", help="the rollups as an exactly-once streaming query")
    journals(p)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--checkpoint", required=True, metavar="DIR")
    p.add_argument("--watermark", default="10 minutes", help="event-time lateness allowed")
    p.add_argument("--trigger-seconds", type=float, default=10.0, metavar="S")
    p.add_argument("--available-now", action="store_true", help="process what is there, then exit")
    p.add_argument("--max-records-per-trigger", type=int, metavar="N")
    p.add_argument(
        "--tables",
        default=ALL_TABLES,
        help="comma-separated tables to maintain (one query and checkpoint each; default: all)",
    )
    config(p)
    p.add_argument(
        "--shuffle-partitions",
        type=int,
        default=0,
        metavar="N",
        help="state partitions, fixed by the first run of a checkpoint (default: Spark's)",
    )
    p.add_argument(
        "--cursor",
        default="taproom-stream",
        metavar="NAME",
        help="report committed offsets to each journal's cursor NAME-<table> ('' for none)",
    )
    p.add_argument(
        "--retry-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="restart a query that failed because a hub was down after this long",
    )
    common(p)
    p.set_defaults(func=cmd_stream)

    p = sub.add_parser("kegs", help="Lager kegs to Parquet per format, plus telemetry rollup")
    p.add_argument("--in", dest="source", required=True, metavar="DIR")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--window", default="1 minute", help="telemetry rollup window")
    common(p)
    p.set_defaults(func=cmd_kegs)

    p = sub.add_parser("report", help="top slow actions, error rates and apdex per app")
    p.add_argument("--in", dest="source", metavar="DIR", help="rollup tables (rollup --out)")
    journals(p)
    p.add_argument("--top", type=int, default=10)
    common(p)
    p.set_defaults(func=cmd_report)
