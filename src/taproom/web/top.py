"""``taproom top``: the console's Overview in a terminal, refreshed every second (like ``vector top``).

It reads ``/api/overview`` of a running hub (``--url``), so it shows exactly what the Overview
page shows: readiness, events/s per protocol, open connections per listener, the journal,
commit latency, each output's queue and lag, and rejects by reason. ``--once`` prints one
frame and exits (scripts, tests); ``--token`` (or ``TAPROOM_WEB_TOKEN``) is sent as a bearer
token for hubs whose console needs one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import orjson

__all__ = ["register_commands", "render"]

_CLEAR = "\x1b[H\x1b[2J"


def _fetch(url: str, token: str, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(f"{url.rstrip('/')}/api/overview")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return orjson.loads(response.read())


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _size(value: Any) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:,.1f} {unit}" if unit != "B" else f"{size:,.0f} B"
        size /= 1024
    return "-"


def _group(latest: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    return sorted((k[len(prefix) :], v) for k, v in latest.items() if k.startswith(prefix))


def render(overview: dict[str, Any], url: str) -> str:
    """One frame of text from an ``/api/overview`` answer."""
    latest = overview.get("latest", {})
    ready = overview.get("ready", {})
    journal = overview.get("journal", {})
    state = "READY" if ready.get("ready") else "NOT READY: " + "; ".join(ready.get("reasons", []))
    lines = [
        f"taproom top - {overview.get('name', '?')} at {url} - "
        f"{time.strftime('%H:%M:%S', time.localtime(overview.get('time', time.time())))}",
        f"state      {state}",
        f"journal    offsets {_num(journal.get('first_offset'))}..{_num(journal.get('end_offset'))}"
        f"  size {_size(latest.get('journal_size_bytes'))}"
        f"  segments {_num(latest.get('journal_segments'))}"
        f"  pending {_size(latest.get('pending_bytes'))}",
        f"commit     p50 {_num(latest.get('commit_p50_ms'), 2)} ms"
        f"  p99 {_num(latest.get('commit_p99_ms'), 2)} ms"
        f"  in {_size(latest.get('journal_bytes_in'))}/s",
        "",
        f"{'PROTOCOL':<16}{'EVENTS/S':>14}{'BYTES/S':>12}",
    ]
    rates = _group(latest, "events_in/")
    lines += [
        f"{name:<16}{_num(rate, 1):>14}{_size(latest.get('bytes_in/' + name)):>12}"
        for name, rate in rates
    ] or ["(no events yet)"]
    lines += ["", f"{'LISTENER':<28}{'CONNECTIONS':>12}"]
    lines += [f"{name:<28}{_num(n):>12}" for name, n in _group(latest, "connections/")]
    lines += ["", f"{'OUTPUT':<20}{'QUEUE':>10}{'LAG':>12}{'DROPPED/S':>12}"]
    outputs = sorted({k.split("/", 1)[1] for k in latest if k.startswith(("queue/", "lag/"))})
    lines += [
        f"{name:<20}{_num(latest.get('queue/' + name)):>10}{_num(latest.get('lag/' + name)):>12}"
        f"{_num(latest.get('dropped/' + name), 1):>12}"
        for name in outputs
    ] or ["(no outputs)"]
    rejects = [(k, v) for k, v in _group(latest, "rejects/") if v]
    lines += ["", f"{'REJECTS (PROTOCOL/REASON)':<40}{'PER S':>10}"]
    lines += [f"{name:<40}{_num(v, 1):>10}" for name, v in rejects] or ["(none in the last second)"]
    return "\n".join(lines)


def _top(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("TAPROOM_WEB_TOKEN", "")
    try:
        while True:
            try:
                frame = render(_fetch(args.url, token, timeout=5), args.url)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                if args.once:
                    print(f"taproom top: {args.url}: {exc}", file=sys.stderr)
                    return 1
                frame = f"taproom top: {args.url}: {exc} (retrying)"
            if args.once:
                print(frame)
                return 0
            sys.stdout.write((_CLEAR if sys.stdout.isatty() else "") + frame + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def register_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("top", help="the console's Overview in a terminal, every second")
    p.add_argument("--url", default="http://127.0.0.1:8686", help="the hub's web listener")
    p.add_argument("--token", default="", help="bearer token (or TAPROOM_WEB_TOKEN)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=_top)
