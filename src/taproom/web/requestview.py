"""One request whole: read from the journal that stores it, here or on another hub.

The drill-down tables and the request-id index say where a request lives: ``(journal,
offset)``. If the journal is this hub's, the record is read from it; if ``[console] hubs``
names a hub for that journal id, the record is read from that hub's read API
(:class:`~taproom.journal.remote.HubJournal`: frames as stored, CRC-checked again, the journal
identity checked), so a console shows a request stored anywhere in its fleet. Then the logjam
document is shaped for the Request page: its fields, time by resource, log lines with
severities and exception backtraces, every text bounded. Called in worker threads.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import orjson

from ..errors import HubUnavailable, JournalError, OffsetsDeleted
from ..journal.remote import HubJournal
from ..records import Record, iter_batch
from ..spark.logjamdoc import LOGJAM_TIME_RESOURCES, SEVERITY_NAMES

__all__ = ["LookupFailed", "RequestSource", "request_view"]

MAX_FIELD_CHARS = 4096  # a field shown as JSON text (request_info, params, ...)
MAX_LINE_CHARS = 65536  # one log line's message (a long backtrace fits)
# Shown beside the time bar, not stacked: gc_time is part of the other times (logjam's rule).
_NOT_STACKED = {"gc_time"}
_SHOWN_ELSEWHERE = {"lines", "exceptions"}


class LookupFailed(Exception):
    """The request could not be read: ``status`` and ``error`` for the API's answer."""

    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.error = error
        self.reason = reason


class RequestSource:
    """Reads one record by ``(journal id, offset)`` from this hub or from a fleet hub."""

    def __init__(
        self, local: Any, hubs: Mapping[str, str], token: str | None, timeout_s: float
    ) -> None:
        self.local = local  # the hub's Journal
        self.hubs = dict(hubs)
        self.token = token or None
        self.timeout_s = timeout_s

    def where(self, journal_id: str) -> str | None:
        """ "local", a hub address, or None when no hub of the fleet is known for it."""
        if journal_id == self.local.id:
            return "local"
        return self.hubs.get(journal_id)

    def read(self, journal_id: str, offset: int) -> tuple[Record, str]:
        """The record and where it was read ("local" or the hub's address)."""
        where = self.where(journal_id)
        if where is None:
            raise LookupFailed(
                404,
                "not_found",
                f"journal {journal_id} is not this hub's, and [console] hubs names no hub for it",
            )
        if where == "local":
            for record in self.local.read(offset, offset + 1):
                return record, where
            raise LookupFailed(404, "not_found", f"offset {offset} is not in this hub's journal")
        hub = HubJournal(where, self.token, timeout_s=self.timeout_s)
        try:
            for base, _count, body in hub.read_batches(offset, offset + 1, journal_id=journal_id):
                for record in iter_batch(body, base):
                    if record.offset == offset:
                        return record, where
        except OffsetsDeleted as exc:
            raise LookupFailed(410, "gone", f"hub {where}: {exc}") from None
        except (HubUnavailable, JournalError) as exc:
            raise LookupFailed(502, "hub_unavailable", f"hub {where}: {exc}") from None
        finally:
            hub.close()
        raise LookupFailed(404, "not_found", f"offset {offset} is not in journal {journal_id}")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit:,} more)"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _severity(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _level(severity: int | None) -> str:
    if severity is not None and 0 <= severity < len(SEVERITY_NAMES):
        return SEVERITY_NAMES[severity]
    return "unknown"


def request_view(record: Record, journal_id: str, where: str, max_lines: int) -> dict[str, Any]:
    """The Request page's view of a logjam request record (LookupFailed if it is none)."""
    try:
        doc = orjson.loads(record.payload)
    except orjson.JSONDecodeError:
        doc = None
    if record.protocol != "logjam" or not isinstance(doc, dict):
        raise LookupFailed(404, "not_found", "the record there is not a logjam request")
    found = doc.get("lines")
    raw_lines: list[Any] = found if isinstance(found, list) else []
    exceptions = [str(e) for e in doc.get("exceptions") or [] if isinstance(e, str)]
    lines: list[dict[str, Any]] = []
    backtraces: list[dict[str, Any]] = []
    highest: int | None = None
    for number, line in enumerate(raw_lines):
        if not isinstance(line, list) or not line:
            continue
        severity = _severity(line[0])
        if severity is not None:
            highest = severity if highest is None else max(highest, severity)
        if len(lines) >= max_lines:
            continue
        when = line[1] if len(line) > 1 and isinstance(line[1], str) else ""
        message = line[2] if len(line) > 2 else ""
        text = message if isinstance(message, str) else orjson.dumps(message).decode()
        entry = {
            "n": number,
            "severity": severity,
            "level": _level(severity),
            "time": _cut(when, 64),
            "message": _cut(text, MAX_LINE_CHARS),
        }
        lines.append(entry)
        # A logged exception: an error line of several lines (the Rails logger writes the
        # class, the message and the backtrace as one entry).
        if severity is not None and severity >= 3 and "\n" in text.strip():
            named = next((e for e in exceptions if e in text), None)
            backtraces.append({"n": number, "exception": named, "text": entry["message"]})
    severity = _severity(doc.get("severity"))
    if severity is None:
        severity = highest if highest is not None else 1
    total = _number(doc.get("total_time"))
    times = {
        name: value
        for name in LOGJAM_TIME_RESOURCES
        if (value := _number(doc.get(name))) is not None
    }
    stacked = sum(v for k, v in times.items() if k not in _NOT_STACKED)
    fields: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _SHOWN_ELSEWHERE:
            continue
        if isinstance(value, str):
            fields[str(key)] = _cut(value, MAX_FIELD_CHARS)
        elif value is None or isinstance(value, bool | int | float):
            fields[str(key)] = value
        else:
            fields[str(key)] = _cut(orjson.dumps(value).decode(), MAX_FIELD_CHARS)
    received = dt.datetime.fromtimestamp(record.received_ns / 1e9, dt.UTC)
    request_id = doc.get("request_id")
    return {
        "journal": journal_id,
        "offset": record.offset,
        "hub": where,
        "stream": record.stream,
        "topic": record.topic,
        "received": received.isoformat(timespec="milliseconds"),
        "request_id": request_id if isinstance(request_id, str) else None,
        "action": doc.get("action") if isinstance(doc.get("action"), str) else None,
        "code": _number(doc.get("code")),
        "total_time": total,
        "severity": severity,
        "level": _level(severity),
        "started_at": doc.get("started_at") if isinstance(doc.get("started_at"), str) else None,
        "host": doc.get("host") if isinstance(doc.get("host"), str) else None,
        "exceptions": exceptions,
        "times": times,
        # What the named times leave of the total (the page's last bar segment).
        "unaccounted_time": max(0.0, total - stacked) if total is not None else None,
        "fields": fields,
        "lines": lines,
        "lines_total": len(raw_lines),
        "backtraces": backtraces,
    }
