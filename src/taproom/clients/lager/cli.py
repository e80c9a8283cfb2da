"""``taproom keg``: dump, verify, convert and record Lager kegs (``*.lgr``)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...protocols.lager.formats import DataFormat
from ...protocols.lager.keg import KegError, read_keg
from ...zmqaccess import add_curve_arguments, curve_from_args
from .keg import KegWriter

__all__ = ["register_commands"]


def _flat_columns(fmt: DataFormat, columns: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
    """Arrays become ``name[i]`` columns so CSV and Parquet get one scalar per cell."""
    out: dict[str, Any] = {}
    for name, column in columns.items():
        if column.ndim == 2:
            for i in range(column.shape[1]):
                out[f"{name}[{i}]"] = column[:, i]
        else:
            out[name] = column
    return out


def _cmd_dump(args: argparse.Namespace) -> int:
    keg = read_keg(args.file)
    print(f"# keg {args.file}: version {keg.version}, {keg.record_count} records, "
          f"{len(keg.formats)} taps" + (", recovered unfinished" if keg.recovered_unfinished else ""))  # fmt: skip
    for key, value in keg.metadata.items():
        print(f"# meta {key} = {value}")
    for text, fmt in keg.formats.items():
        print(f"# tap {text}: {', '.join(f'{i.name}:{i.type.name}' for i in fmt.items)}")
    for n, (text, ts, row) in enumerate(keg.rows()):
        if args.limit is not None and n >= args.limit:
            break
        print(text, ts, " ".join(f"{k}={v}" for k, v in row.items()))
    if keg.dropped_bytes:
        print(f"# dropped {keg.dropped_bytes} bytes at the end: {keg.problem}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        keg = read_keg(args.file)
    except (KegError, OSError) as exc:
        print(f"{args.file}: unreadable: {exc}")
        return 2
    status = "finished" if not keg.recovered_unfinished else "unfinished (recovered from sidecar)"
    print(f"{args.file}: {status}; {keg.record_count} records; {len(keg.formats)} taps")
    for text, count in sorted(keg.counts().items()):
        print(f"  {text}: {count}")
    if keg.dropped_bytes:
        print(f"  dropped {keg.dropped_bytes} bytes: {keg.problem}")
    return 0 if not keg.recovered_unfinished and not keg.dropped_bytes else 1


def _cmd_convert(args: argparse.Namespace) -> int:
    keg = read_keg(args.file)
    stem = args.output or os.path.splitext(args.file)[0]
    single = len(keg.formats) == 1
    written = []
    for text, fmt in keg.formats.items():
        columns = _flat_columns(fmt, keg.table(text))
        path = f"{stem}.{args.to}" if single else f"{stem}.{text}.{args.to}"
        if args.to == "csv":
            names = list(columns)
            with open(path, "w", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                writer.writerow(names)
                writer.writerows(zip(*(columns[n].tolist() for n in names), strict=True))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            arrow = pa.table({name: pa.array(col) for name, col in columns.items()})
            pq.write_table(
                arrow.replace_schema_metadata({"lager_uuid": text, "lager_xml": fmt.to_xml()}),
                path,
            )
        written.append(path)
    for path in written:
        print(path)
    return 0


def _cmd_record(args: argparse.Namespace) -> int:
    writer = KegWriter(
        args.file,
        registrar=args.registrar,
        forwarder=args.forwarder,
        subtree=args.subtree,
        taps=args.tap or None,
        metadata=dict(m.split("=", 1) for m in args.meta),
        flush_interval_s=args.flush_interval,
        curve=curve_from_args(args),
    )
    writer.start(args.timeout)
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, args.ready_file)
    stop = threading.Event()
    with contextlib.suppress(KeyboardInterrupt):
        import signal

        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while not stop.wait(0.2):
            if deadline is not None and time.monotonic() >= deadline:
                break
    writer.stop()
    print(f"{args.file}: {writer.records} records", file=sys.stderr)
    return 0


def register_commands(subparsers: Any) -> None:
    keg = subparsers.add_parser("keg", help="Lager kegs (*.lgr): dump, verify, convert, record")
    sub = keg.add_subparsers(dest="keg_command", required=True)
    p = sub.add_parser("dump", help="print formats, metadata and rows")
    p.add_argument("file")
    p.add_argument("--limit", type=int, default=None, help="at most N rows")
    p.set_defaults(func=_cmd_dump)
    p = sub.add_parser("verify", help="exit 0 finished and whole, 1 recovered/torn, 2 unreadable")
    p.add_argument("file")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("convert", help="write CSV or Parquet (one file per tap)")
    p.add_argument("file")
    p.add_argument("--to", choices=("csv", "parquet"), required=True)
    p.add_argument("--output", default=None, help="output path stem (default: FILE minus .lgr)")
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser("record", help="record taps from a bartender until SIGTERM")
    p.add_argument("file")
    p.add_argument("--registrar", default="127.0.0.1:12345", help="host:P (snapshot port)")
    p.add_argument(
        "--forwarder", default=None, help="host:F, the taps' side (default: registrar port + 10)"
    )
    p.add_argument("--subtree", default="")
    p.add_argument("--tap", action="append", default=[], help="tap key (default: all, follow)")
    p.add_argument("--meta", action="append", default=[], help="KEY=VALUE metadata")
    p.add_argument("--flush-interval", type=float, default=0.1, help="seconds")
    p.add_argument("--duration", type=float, default=None, help="seconds, then finish")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--ready-file", default=None, help="written once recording")
    add_curve_arguments(p)
    p.set_defaults(func=_cmd_record)
