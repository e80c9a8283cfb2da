"""A hub's journal read over the network: the client of :mod:`taproom.web.journalapi`.

:class:`HubJournal` gives what :class:`~taproom.journal.JournalReader` gives for a local
directory, with the same semantics: verified batches ``(base, count, body)`` in offset order,
quarantined damage skipped as a gap (the hub walks its journal with the journal's own walker
and sends the frames that verify, exactly as stored). What the network adds is checked here:

* every frame's CRC32C (the journal's own, computed when the batch was committed) is checked
  again, so a batch damaged on the way raises :class:`~taproom.errors.CorruptTransfer` naming
  the journal and the offset; it is never turned into rows, and reading again fetches it again;
* an answer must end with the hub's end marker, so a cut connection is an error
  (:class:`~taproom.errors.HubUnavailable`, naming the hub), never a short read taken as the end;
* offsets below what the hub still holds are :class:`~taproom.errors.OffsetsDeleted` (HTTP
  410): a loss is reported, never skipped;
* the hub must still serve the journal the reader planned for (its identity is checked; a
  different one is a :class:`~taproom.errors.JournalError`).

Plain ``http.client``: Spark executors need nothing beyond what taproom already requires.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from ..errors import CorruptTransfer, HubUnavailable, JournalError, OffsetsDeleted
from .segments import FRAME, MAX_BATCH_BODY, crc_of

__all__ = ["DEFAULT_BUDGET", "HubJournal", "JournalInfo", "RemoteSegment", "hub_address"]

# Bytes asked for per request: big enough that a request's round trip is noise, small enough
# that a retried request repeats little.
DEFAULT_BUDGET = 16 << 20
DEFAULT_PORT = 8686


def hub_address(spec: str) -> tuple[str, int]:
    """``host:port``, ``host`` or ``http://host:port`` -> (host, port)."""
    text = spec.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"hub address {spec!r}: use host:port (the hub's [web] listener)")
    return parts.hostname, parts.port or DEFAULT_PORT


@dataclass(frozen=True)
class RemoteSegment:
    """One segment of a hub's journal: offsets ``[base, end)``, ``end`` None while written."""

    base: int
    end: int | None
    bytes: int

    @property
    def sealed(self) -> bool:
        return self.end is not None


@dataclass(frozen=True)
class JournalInfo:
    id: str
    first_offset: int
    end_offset: int
    segments: tuple[RemoteSegment, ...]
    max_read_bytes: int


class HubJournal:
    """The journal of the hub whose web listener is at ``address``."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.address = address
        self.host, self.port = hub_address(address)
        self.token = token
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def __repr__(self) -> str:
        return f"HubJournal({self.address!r})"

    # --- HTTP -------------------------------------------------------------------------------

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _request(self, method: str, path: str) -> http.client.HTTPResponse:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in (1, 2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(
                    self.host, self.port, timeout=self.timeout_s
                )
            try:
                self._conn.request(method, path, headers=headers)
                return self._conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                # A kept-alive connection the hub closed meanwhile: one fresh try.
                stale = isinstance(
                    exc, http.client.RemoteDisconnected | BrokenPipeError | ConnectionResetError
                )
                if attempt == 2 or not stale:
                    raise self._unavailable(f"{method} {path.split('?')[0]}: {exc}") from None
        raise AssertionError("unreachable")

    def _unavailable(self, what: str) -> HubUnavailable:
        return HubUnavailable(f"hub unavailable: {self.address}: {what}")

    def _json(self, response: http.client.HTTPResponse) -> dict[str, Any]:
        raw = response.read(1 << 20)
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise self._unavailable(f"HTTP {response.status}: not a JSON answer")
        return value

    def _refused(self, response: http.client.HTTPResponse) -> Exception:
        body = self._json(response)
        self.close()  # the hub closes after an error
        reason = str(body.get("reason", body.get("error", "")))
        if response.status == 410:
            return OffsetsDeleted(
                f"hub {self.address}: {reason}",
                requested=int(body.get("requested", 0)),
                first_offset=int(body.get("first_offset", 0)),
            )
        return self._unavailable(f"HTTP {response.status}: {reason}")

    def _call(self, method: str, path: str) -> dict[str, Any]:
        response = self._request(method, path)
        if response.status != 200:
            raise self._refused(response)
        return self._json(response)

    # --- the API ----------------------------------------------------------------------------

    def info(self) -> JournalInfo:
        body = self._call("GET", "/api/journal")
        return JournalInfo(
            id=str(body["id"]),
            first_offset=int(body["first_offset"]),
            end_offset=int(body["end_offset"]),
            segments=tuple(
                RemoteSegment(
                    int(s["base"]), None if s["end"] is None else int(s["end"]), s["bytes"]
                )
                for s in body["segments"]
            ),
            max_read_bytes=int(body["max_read_bytes"]),
        )

    def report_cursor(self, name: str, offset: int) -> dict[str, Any]:
        """Tell the hub that reader ``name`` has committed everything below ``offset``."""
        return self._call("PUT", f"/api/journal/cursors/{quote(name)}?offset={offset}")

    def cursors(self) -> dict[str, Any]:
        """The hub's registered cursors, with their lag and what they lost."""
        return self._call("GET", "/api/journal/cursors")

    def delete_cursor(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/api/journal/cursors/{quote(name)}")

    def read_batches(
        self,
        from_offset: int,
        end_offset: int,
        *,
        journal_id: str | None = None,
        budget: int = DEFAULT_BUDGET,
    ) -> Iterator[tuple[int, int, bytes]]:
        """Verified batches overlapping ``[from_offset, end_offset)``, as
        :meth:`JournalReader.read_batches` gives them (the first may start before
        ``from_offset``). ``journal_id``: the journal the caller planned for."""
        offset = from_offset
        while offset < end_offset:
            progressed = False
            for item in self._read_once(offset, end_offset, journal_id, budget):
                if isinstance(item, int):
                    progressed = item > offset
                    offset = item
                else:
                    yield item
            if not progressed:
                return  # the hub holds nothing more below end_offset (it ends earlier)

    def _read_once(
        self, offset: int, end_offset: int, journal_id: str | None, budget: int
    ) -> Iterator[tuple[int, int, bytes] | int]:
        """One request: its batches, then the offset to ask for next."""
        response = self._request(
            "GET", f"/api/journal/read?from={offset}&to={end_offset}&budget={budget}"
        )
        if response.status != 200:
            raise self._refused(response)
        served = response.getheader("X-Taproom-Journal-Id", "")
        if journal_id is not None and served != journal_id:
            self.close()
            raise JournalError(f"hub {self.address} serves journal {served}, not {journal_id}")
        expected = offset
        try:
            while True:
                header = _read_exactly(response, FRAME.size)
                length, crc, base, count = FRAME.unpack(header)
                if count == 0:
                    if length or crc != crc_of(base, 0, b"") or base < expected:
                        raise CorruptTransfer(
                            f"journal {served} from hub {self.address}: damaged end marker "
                            f"after offset {expected}",
                            journal_id=served,
                            offset=expected,
                        )
                    response.read()  # the chunked terminator: the connection is reused
                    yield base
                    return
                # The first frame is the one holding `offset`: it may start before it.
                starts_ok = base >= expected or (expected == offset and base + count > offset)
                if length > MAX_BATCH_BODY or not starts_ok:
                    raise CorruptTransfer(
                        f"journal {served} from hub {self.address}: damaged frame header "
                        f"after offset {expected} (base {base}, {length} bytes)",
                        journal_id=served,
                        offset=expected,
                    )
                body = _read_exactly(response, length)
                if crc_of(base, count, body) != crc:
                    raise CorruptTransfer(
                        f"journal {served} from hub {self.address}: the batch at offset {base} "
                        "failed its CRC on the way (read it again)",
                        journal_id=served,
                        offset=base,
                    )
                expected = base + count
                yield base, count, body
        except (OSError, http.client.HTTPException, _Truncated) as exc:
            self.close()
            raise self._unavailable(f"the read from offset {offset} was cut off: {exc}") from None
        except BaseException:
            self.close()  # a half-read answer cannot be reused
            raise


class _Truncated(Exception):
    pass


def _read_exactly(response: http.client.HTTPResponse, size: int) -> bytes:
    data = response.read(size)
    if len(data) != size:
        raise _Truncated(f"{len(data)} of {size} bytes before the connection ended")
    return data
