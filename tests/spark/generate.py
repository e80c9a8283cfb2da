"""Generated journals of logjam requests (and other protocols), and a pure-Python reference.

The generator writes real journals with :class:`taproom.journal.Journal` and
:class:`taproom.records.BatchBuilder`. Payloads are logjam request documents as logjam_agent
sends them (action, started_at, total_time in ms, code, severity, lines of
``[severity, timestamp, message]``, exceptions), with fields left out or mangled now and then
so the importer's defaults matter. ``reference_*`` recompute the rollups with plain Python
(json, datetime, sorted lists), independently of Spark, for the transform tests.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taproom.journal import Journal
from taproom.journal.segments import FRAME, scan_segment
from taproom.records import BatchBuilder
from tests.support import flip_byte

__all__ = [
    "BASE_NS",
    "GeneratedEvent",
    "generate_events",
    "reference_exception_samples",
    "reference_exceptions",
    "reference_logs",
    "reference_requests",
    "reference_samples",
    "request_rows",
    "write_damaged_journal",
    "write_journal",
]

BASE = dt.datetime(2026, 11, 21, 23, 50, tzinfo=dt.UTC)  # crosses midnight: two dates
BASE_NS = int(BASE.timestamp()) * 1_000_000_000
STREAMS = ("shop-production", "shop-preview", "api-gw-production")
ACTIONS = (
    "Users::SessionsController#create",
    "ProductsController#index",
    "Admin::ReportsController#show",
    "Admin::UsersController#index",
    "CheckoutController#pay",
)
EXCEPTIONS = ("ActiveRecord::RecordNotFound", "Timeout::Error", "NoMethodError")


@dataclass
class GeneratedEvent:
    protocol: str
    stream: str
    topic: str
    payload: bytes
    content_type: str
    received_ns: int
    ts_ns: int
    producer: str = "10.0.0.7:5000"
    seq: int = 0
    event_id: str = ""
    attrs: dict[str, str] | None = None


def _request(rng: random.Random, minute_span: int, received_ns: int | None) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if rng.random() > 0.03:
        doc["action"] = rng.choice(ACTIONS)
    elif rng.random() < 0.5:
        doc["action"] = ""
    if received_ns is None:
        second = rng.uniform(0, minute_span * 60)
        started = BASE + dt.timedelta(seconds=second)
    else:  # arrival order: started shortly before it was received
        started = dt.datetime.fromtimestamp(received_ns / 1e9, dt.UTC) - dt.timedelta(
            seconds=rng.uniform(0, 20)
        )
    r = rng.random()
    if r < 0.6:
        doc["started_at"] = started.isoformat(timespec="milliseconds")
    elif r < 0.9:
        zone = dt.timezone(dt.timedelta(hours=rng.choice((-5, 1, 2))))
        doc["started_at"] = started.astimezone(zone).isoformat()
    elif r < 0.95:
        doc["started_ms"] = int(started.timestamp() * 1000)
    # else: no start time (the event's ts or receive time is used)
    if rng.random() > 0.03:
        doc["total_time"] = round(rng.lognormvariate(4.5, 1.3), 3)
    if rng.random() > 0.03:
        doc["code"] = rng.choice((200, 200, 200, 200, 201, 302, 304, 404, 422, 500, 503, 101, 0))
    if rng.random() < 0.2:
        doc["severity"] = rng.randint(0, 5)
    if rng.random() < 0.8:
        doc["lines"] = [
            [rng.randint(0, 4), started.isoformat(), f"line {i}"] for i in range(rng.randint(0, 4))
        ]
    if rng.random() < 0.1:
        doc["exceptions"] = rng.sample(EXCEPTIONS, rng.randint(1, 2))
    doc["request_id"] = f"{rng.getrandbits(64):016x}"
    if rng.random() < 0.9:
        doc["host"] = f"web-{rng.randint(1, 3)}"
    return doc


def generate_events(
    n: int, *, seed: int = 7, minute_span: int = 20, others: float = 0.15, in_order: bool = False
) -> list[GeneratedEvent]:
    """``n`` events: logjam requests on logs.* and frontend.* topics, plus other protocols.

    Start times are spread over ``minute_span`` minutes at random, or with ``in_order`` follow
    the receive order within 20 s (what a streaming watermark expects).
    """
    rng = random.Random(seed)
    events = []
    for i in range(n):
        received_ns = BASE_NS + int(i * (minute_span * 60e9) / max(1, n))
        ts_ns = received_ns - rng.randint(0, 2_000_000_000) if rng.random() < 0.7 else 0
        if rng.random() < others:
            kind = rng.random()
            if kind < 0.4:
                level = rng.choice(("INFO", "warn", "error", None))
                body = {"message": f"hello {i}"} | ({"level": level} if level else {})
                events.append(
                    GeneratedEvent(
                        "lumberjack",
                        "filebeat",
                        "log",
                        json.dumps(body).encode(),
                        "json",
                        received_ns,
                        ts_ns,
                        seq=i,
                    )
                )
            elif kind < 0.7:
                events.append(
                    GeneratedEvent(
                        "logtk",
                        "myapp",
                        "logging",
                        f"raw line {i}".encode(),
                        "raw",
                        received_ns,
                        ts_ns,
                        seq=i,
                        attrs={"level": rng.choice(("debug", "Info"))},
                    )
                )
            else:
                stream = rng.choice(STREAMS)
                events.append(
                    GeneratedEvent(
                        "logjam",
                        stream,
                        "javascript.errors",
                        b'{"description":"x is undefined","severity":3}',
                        "json",
                        received_ns,
                        ts_ns,
                        seq=i,
                    )
                )
            continue
        stream = rng.choice(STREAMS)
        app = stream.rsplit("-", 1)[0]
        topic = (
            f"logs.{app}.production"
            if rng.random() < 0.8
            else rng.choice(("frontend.page", "frontend.ajax"))
        )
        doc = _request(rng, minute_span, received_ns if in_order else None)
        payload = json.dumps(doc).encode()
        if rng.random() < 0.01:
            payload = b"{not json"
        events.append(
            GeneratedEvent(
                "logjam",
                stream,
                topic,
                payload,
                "json",
                received_ns,
                ts_ns,
                seq=i,
                event_id=doc.get("request_id", ""),
            )
        )
    return events


def write_journal(
    path: Path, events: list[GeneratedEvent], *, batch: int = 97, segment_bytes: int = 256 * 1024
) -> Path:
    """Commit ``events`` in batches of ``batch`` (small segments: reads cross segment files)."""
    journal = Journal(path, fsync="off", segment_bytes=segment_bytes)
    try:
        for start in range(0, len(events), batch):
            builder = BatchBuilder()
            for e in events[start : start + batch]:
                builder.add(
                    e.protocol,
                    e.payload,
                    stream=e.stream,
                    topic=e.topic,
                    producer=e.producer,
                    seq=e.seq,
                    event_id=e.event_id,
                    ts_ns=e.ts_ns,
                    content_type=e.content_type,
                    attrs=e.attrs,
                    received_ns=e.received_ns,
                )
            journal.commit([builder.build()])
    finally:
        journal.close()
    return path


# --- the reference: what logjam's importer would compute, in plain Python ------------------


def _utc_minute(value: dt.datetime) -> dt.datetime:
    return value.astimezone(dt.UTC).replace(second=0, microsecond=0, tzinfo=None)


def _from_ns(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns // 1000 / 1e6, dt.UTC)


def _parsed(e: GeneratedEvent) -> dict[str, Any]:
    try:
        doc = json.loads(e.payload)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _is_request(e: GeneratedEvent) -> bool:
    return e.protocol == "logjam" and e.topic.startswith(("logs.", "frontend."))


def request_rows(events: list[GeneratedEvent]) -> Iterator[dict[str, Any]]:
    """One dict per request; ``offset`` is the event's index (``events`` written in order to a
    new journal: the journal's offsets)."""
    for offset, e in enumerate(events):
        if not _is_request(e):
            continue
        doc = _parsed(e)
        started: dt.datetime | None = None
        if isinstance(doc.get("started_at"), str):
            started = dt.datetime.fromisoformat(doc["started_at"])
            if started.tzinfo is None:
                started = started.replace(tzinfo=dt.UTC)
        elif isinstance(doc.get("started_ms"), int):
            started = dt.datetime.fromtimestamp(doc["started_ms"] / 1000, dt.UTC)
        elif e.ts_ns:
            started = _from_ns(e.ts_ns)
        else:
            started = _from_ns(e.received_ns)
        action = doc.get("action") or "Unknown#unknown_method"
        module = "::" + action.split("::", 1)[0] if "::" in action.split("#", 1)[0] else "Others"
        severity = doc.get("severity")
        if severity is None:
            levels = [line[0] for line in doc.get("lines") or [] if isinstance(line[0], int)]
            severity = max(levels) if levels else 1
        app, env = e.stream.rsplit("-", 1)
        yield {
            "minute": _utc_minute(started),
            "app": app,
            "env": env,
            "action": action,
            "module": module,
            "frontend": e.topic.startswith("frontend."),
            "total_time": float(doc.get("total_time", 1.0)),
            "code": int(doc.get("code", 500)),
            "severity": int(severity),
            "exceptions": list(doc.get("exceptions") or []),
            "started": started.astimezone(dt.UTC).replace(tzinfo=None),
            "request_id": doc.get("request_id"),
            "host": doc.get("host"),
            "offset": offset,
        }


def request_groups(events: list[GeneratedEvent]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Request rows by (minute, app, env, action, module, frontend): the rollups' groups."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in request_rows(events):
        key = tuple(row[k] for k in ("minute", "app", "env", "action", "module", "frontend"))
        groups[key].append(row)
    return groups


def reference_requests(events: list[GeneratedEvent]) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for key, rows in request_groups(events).items():
        frontend = key[-1]
        happy, satisfied, tolerating = (500, 2000, 8000) if frontend else (100, 500, 2000)
        times = sorted(r["total_time"] for r in rows)
        n = len(rows)
        sat = sum(t < satisfied for t in times)
        tol = sum(satisfied <= t < tolerating for t in times)
        classes = defaultdict(int)
        for r in rows:
            c = r["code"] // 100
            classes[f"status_{c}xx" if 1 <= c <= 5 else "status_other"] += 1
        severities = defaultdict(int)
        names = ("debug", "info", "warn", "error", "fatal")
        for r in rows:
            s = r["severity"]
            severities[f"severity_{names[s]}" if 0 <= s <= 4 else "severity_unknown"] += 1
        out[key] = {
            "count": n,
            "times": times,
            "total_time_sum": math.fsum(times),
            "total_time_max": times[-1],
            "apdex_happy": sum(t < happy for t in times),
            "apdex_satisfied": sat,
            "apdex_tolerating": tol,
            "apdex_frustrated": sum(t >= tolerating for t in times),
            "apdex": (sat + tol / 2) / n,
            **{f"status_{c}xx": classes[f"status_{c}xx"] for c in range(1, 6)},
            "status_other": classes["status_other"],
            **{f"severity_{k}": severities[f"severity_{k}"] for k in (*names, "unknown")},
            "exceptions": sum(len(r["exceptions"]) for r in rows),
            "requests_with_exceptions": sum(bool(r["exceptions"]) for r in rows),
        }
    return out


def reference_exceptions(events: list[GeneratedEvent]) -> dict[tuple[Any, ...], int]:
    counts: dict[tuple[Any, ...], int] = defaultdict(int)
    for row in request_rows(events):
        key = tuple(row[k] for k in ("minute", "app", "env", "action", "module", "frontend"))
        for name in row["exceptions"]:
            counts[(*key, name)] += 1
    return dict(counts)


def reference_exception_samples(
    events: list[GeneratedEvent], samples: int
) -> dict[tuple[Any, ...], list[int]]:
    """Per exception row key: the offsets of the first ``samples`` requests that raised it."""
    out: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for row in request_rows(events):
        key = tuple(row[k] for k in ("minute", "app", "env", "action", "module", "frontend"))
        for name in dict.fromkeys(row["exceptions"]):
            if len(out[(*key, name)]) < samples:
                out[(*key, name)].append(row["offset"])
    return dict(out)


def reference_samples(
    events: list[GeneratedEvent], slow: int, failed: int
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Per (minute, app, env, action, module, frontend): the offsets of the ``slow`` slowest
    requests (ties: the later offset), of the first ``failed`` failed ones by start time (ties:
    the earlier offset), and how many failed."""
    out = {}
    for key, rows in request_groups(events).items():
        by_time = sorted(rows, key=lambda r: (r["total_time"], r["offset"]), reverse=True)
        bad = [r for r in rows if r["code"] >= 500 or r["severity"] >= 3 or bool(r["exceptions"])]
        first = sorted(bad, key=lambda r: (r["started"], r["offset"]))
        out[key] = {
            "slow": {r["offset"] for r in by_time[:slow]},
            "failed": {r["offset"] for r in first[:failed]},
            "failed_count": len(bad),
            "rows": {r["offset"]: r for r in rows},
        }
    return out


_LEVELS = {"0": "debug", "1": "info", "2": "warn", "3": "error", "4": "fatal", "5": "unknown"}


def reference_logs(events: list[GeneratedEvent]) -> dict[tuple[Any, ...], tuple[int, int]]:
    out: dict[tuple[Any, ...], list[int]] = defaultdict(lambda: [0, 0])
    for e in events:
        level = (e.attrs or {}).get("level")
        if level is None and e.content_type in ("json", "kv"):
            doc = _parsed(e)
            for field in ("level", "severity"):
                if doc.get(field) is not None:
                    level = str(doc[field])
                    break
        level = (level or "unknown").lower()
        level = _LEVELS.get(level, level)
        minute = _utc_minute(_from_ns(e.ts_ns or e.received_ns))
        acc = out[(minute, e.protocol, e.stream, level)]
        acc[0] += 1
        acc[1] += len(e.payload)
    return {k: (v[0], v[1]) for k, v in out.items()}


def write_damaged_journal(path: Path) -> set[int]:
    """Four 1 MiB segments of 200-event batches with quarantined damage: a corrupt frame in the
    first and in the last segment (valid frames after each) and a damaged sealed segment
    header. Returns the offsets of the events that are still intact."""
    journal = Journal(path, segment_bytes=1 << 20)
    for k in range(16):
        b = BatchBuilder()
        for i in range(200):
            b.add("test", f'{{"k":{k},"i":{i}}}'.encode().ljust(1500, b" "), content_type="json")
        journal.commit([b.build()])
    journal.close()
    segments = sorted(path.glob("*.seg"))
    assert len(segments) >= 3
    lost: set[int] = set()
    for seg, pick in ((segments[0], 1), (segments[-1], 1)):
        index = scan_segment(str(seg)).index
        base, position = index[pick]
        assert pick + 1 < len(index)  # a valid frame follows the damaged one
        flip_byte(seg, position + FRAME.size + 700)
        lost |= set(range(base, index[pick + 1][0]))
    flip_byte(segments[1], 4)  # a sealed segment's header: no frame lost
    return set(range(3200)) - lost
