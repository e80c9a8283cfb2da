"""The journal's network read API: committed data for readers on other machines (Spark).

Served on the web listener (one port to open, and the ``[web] token`` rule already applies:
required off loopback). Routes:

* ``GET /api/journal``: identity, first retained and end offsets, the segments (``end`` null
  for the one still written; the others are sealed: they never change), the read limits.
* ``GET /api/journal/read?from=N[&to=M][&budget=B]``: committed frames exactly as stored
  (``u32 length, u32 CRC32C, u64 base, u32 count, body``; the CRC is the journal's, so the
  reader verifies what it got), from the frame holding ``N`` up to ``M`` (default: the end
  when asked), whole frames while they fit in ``B`` bytes (at least one frame; a budget over
  ``[journal] max_read_bytes`` is served up to that, one over 1 GiB is refused). The stream
  ends with an end marker: a frame header with length 0, count 0, the CRC of an empty body and
  as base the offset to ask for next, so a reader can tell a complete answer from a cut one.
  Quarantined damage is skipped as the local reader skips it (its offsets are a gap).
* ``PUT /api/journal/cursors/{name}?offset=N``: a reader reports what it has committed; with
  ``[journal] retain_unread`` retention keeps what a registered cursor has not passed.
  ``DELETE`` forgets one; ``GET /api/journal/cursors`` lists them with their lag.

Errors are JSON ``{"error": ..., "reason": ...}``, counted in
``taproom_ingest_rejected_items_total{protocol="journal_read", reason}``: 400 for an offset or
budget that is not a number or absurd, 410 ``offsets_deleted`` below the first retained
offset (the reader lost data and is told so), 416 ``beyond_end``, 429 ``too_many_readers``.

Bounds: at most ``[journal] max_remote_readers`` reads at once; each read walks the journal
in a thread of its own pool (never on the event loop, never in the commit thread), about
1 MiB at a time, and awaits each write: a slow reader holds TCP back instead of making the
hub buffer; one that takes nothing for ``remote_write_timeout_s`` is cut off.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..errors import OffsetsDeleted
from ..journal.segments import FRAME, FrameInfo, crc_of

if TYPE_CHECKING:
    from .server import WebServer

__all__ = ["CHUNK_BYTES", "DEFAULT_BUDGET", "MAX_BUDGET", "add_routes", "end_marker"]

log = logging.getLogger("taproom.web")

# Frames are handed from the reading thread to the loop in pieces of about this size: big
# enough that the thread hop is rare, small enough to keep the hub's memory per reader low.
CHUNK_BYTES = 1 << 20
DEFAULT_BUDGET = 16 << 20  # a read without a budget: a few chunks
MAX_BUDGET = 1 << 30  # above this a budget is a mistake (max_read_bytes cannot be set higher)
_PROTOCOL = "journal_read"
_INTEGER = re.compile(r"^\d{1,19}$")
_CURSOR = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def end_marker(next_offset: int) -> bytes:
    """The frame header that ends a read: no body, count 0, the offset to ask for next."""
    return FRAME.pack(0, crc_of(next_offset, 0, b""), next_offset, 0)


class _Refusal(Exception):
    def __init__(self, status: int, error: str, reason: str, **extra: Any) -> None:
        super().__init__(reason)
        self.status = status
        self.error = error
        self.reason = reason
        self.extra = extra

    def response(self) -> web.Response:
        body = {"error": self.error, "reason": self.reason, **self.extra}
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return web.json_response(body, status=self.status, headers=headers)


class _FrameStream:
    """One read's walk over the journal, advanced in the pool a chunk at a time."""

    def __init__(self, frames: Iterator[FrameInfo], budget: int, end: int) -> None:
        self.frames = frames
        self.budget = budget
        self.end = end  # where the walk ends when it runs out of frames
        self.next_offset = 0
        self.sent = 0
        self.done = False
        self._held: FrameInfo | None = None
        self._lock = threading.Lock()  # closing must wait for a chunk being read

    def chunk(self) -> bytes:
        """The next frames (about CHUNK_BYTES, within the budget); sets ``done`` at the end."""
        parts: list[bytes] = []
        size = 0
        with self._lock:
            while size < CHUNK_BYTES:
                frame = self._held or next(self.frames, None)
                self._held = None
                if frame is None:
                    self.next_offset = max(self.next_offset, self.end)
                    self.done = True
                    break
                frame_bytes = FRAME.size + frame.body_length
                if self.sent and self.sent + frame_bytes > self.budget:
                    self._held = frame  # the budget is spent: the reader asks again from here
                    self.done = True
                    break
                assert frame.body is not None
                parts += (frame.header, frame.body)
                size += frame_bytes
                self.sent += frame_bytes
                self.next_offset = frame.end_offset
        return b"".join(parts)

    def close(self) -> None:
        with self._lock:
            close = getattr(self.frames, "close", None)
            if close is not None:
                close()


def _integer(request: web.Request, name: str, default: int | None = None) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        if default is None:
            raise _Refusal(400, "bad_request", f"{name} is required", param=name)
        return default
    if not _INTEGER.match(raw):
        raise _Refusal(400, "bad_request", f"{name} must be a non-negative integer", param=name)
    return int(raw)


class JournalAPI:
    def __init__(self, server: WebServer) -> None:
        self.server = server
        self.hub = server.hub
        self.config = server.hub.config.journal
        self.active = 0
        self.pool = ThreadPoolExecutor(
            self.config.max_remote_readers, thread_name_prefix="taproom-journal-read"
        )
        m = self.hub.metrics
        self._m_bytes = m.counter(
            "journal", "remote_read", "bytes", "Frame bytes sent to network readers"
        )
        self._m_reads = m.counter("journal", "remote_reads", "calls", "Network reads answered")
        m.gauge_fn(
            "journal", "remote_readers", "count", "Network reads in progress", lambda: self.active
        )

    async def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _refused(self, refusal: _Refusal) -> web.Response:
        self.hub.metrics.rejected(_PROTOCOL, refusal.error)
        return refusal.response()

    def _offsets(self) -> dict[str, Any]:
        journal = self.hub.journal
        return {
            "id": journal.id,
            "first_offset": journal.first_offset,
            "end_offset": journal.end_offset,
        }

    async def info(self, request: web.Request) -> web.Response:
        journal = self.hub.journal
        segments = journal.segments()
        body = {
            **self._offsets(),
            "segments": [
                {
                    "base": seg.base_offset,
                    "end": seg.end_offset if i + 1 < len(segments) else None,
                    "bytes": seg.size,
                }
                for i, seg in enumerate(segments)
            ],
            "max_read_bytes": self.config.max_read_bytes,
        }
        return web.json_response(body)

    def _check_offset(self, offset: int, first: int, end: int) -> None:
        if offset < first:
            raise _Refusal(
                410,
                "offsets_deleted",
                f"offsets {offset}-{first - 1} were deleted by retention",
                requested=offset,
                first_offset=first,
            )
        if offset > end:
            raise _Refusal(
                416, "beyond_end", f"offset {offset} is past the end {end}", end_offset=end
            )

    async def read(self, request: web.Request) -> web.StreamResponse:
        journal = self.hub.journal
        first, end = journal.first_offset, journal.end_offset
        try:
            start = _integer(request, "from")
            to = min(_integer(request, "to", end), end)
            budget = _integer(request, "budget", DEFAULT_BUDGET)
            if not 1 <= budget <= MAX_BUDGET:
                raise _Refusal(
                    400, "bad_request", f"budget must be 1 to {MAX_BUDGET} bytes", param="budget"
                )
            # A sane budget over this hub's max_read_bytes is served up to it (readers need
            # not know each hub's setting; a reader's next request goes on from where it ends).
            budget = min(budget, self.config.max_read_bytes)
            self._check_offset(start, first, end)
            if to < start:
                raise _Refusal(400, "bad_request", "to is below from", param="to")
            if self.active >= self.config.max_remote_readers:
                raise _Refusal(
                    429,
                    "too_many_readers",
                    f"{self.active} reads in progress (max_remote_readers)",
                )
        except _Refusal as refusal:
            return self._refused(refusal)
        self.active += 1
        stream = _FrameStream(journal.read_frames(start, to, skip_deleted=False), budget, to)
        stream.next_offset = start
        loop = asyncio.get_running_loop()
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/x-taproom-frames",
                "X-Taproom-Journal-Id": journal.id,
                "X-Taproom-First-Offset": str(first),
                "X-Taproom-End-Offset": str(end),
            }
        )
        try:
            await response.prepare(request)
            while not stream.done:
                try:
                    chunk = await loop.run_in_executor(self.pool, stream.chunk)
                except OffsetsDeleted as exc:
                    # The status is already sent: cut the stream (no end marker), the reader
                    # fails and asks again, and then hears 410.
                    log.warning("journal read from %d cut: %s", start, exc)
                    self.hub.metrics.rejected(_PROTOCOL, "offsets_deleted")
                    _abort(request)
                    return response
                if chunk and not await self._send(request, response, chunk):
                    return response
            if await self._send(request, response, end_marker(stream.next_offset)):
                await response.write_eof()
                self._m_reads.inc()
        finally:
            self.active -= 1
            self.pool.submit(stream.close)
        return response

    async def _send(self, request: web.Request, response: web.StreamResponse, data: bytes) -> bool:
        """Write and wait for the peer to take it (TCP backpressure); False if cut off."""
        try:
            async with asyncio.timeout(self.config.remote_write_timeout_s):
                await response.write(data)
        except TimeoutError:
            self.hub.metrics.rejected(_PROTOCOL, "slow_reader")
            _abort(request)
            return False
        except ConnectionError:
            return False
        self._m_bytes.inc(len(data))
        return True

    # --- cursors ---------------------------------------------------------------------------

    def _cursor_name(self, request: web.Request) -> str:
        name = request.match_info["name"]
        if not _CURSOR.match(name):
            raise _Refusal(400, "bad_request", "cursor names are 1-128 of A-Z a-z 0-9 _ . -")
        return name

    def _cursor_view(self, name: str, offset: int) -> dict[str, Any]:
        journal = self.hub.journal
        return {
            "name": name,
            "offset": offset,
            "lag": max(0, journal.end_offset - offset),
            # Offsets this reader had not read when retention deleted them.
            "lost": max(0, journal.first_offset - offset),
        }

    async def put_cursor(self, request: web.Request) -> web.Response:
        journal = self.hub.journal
        try:
            name = self._cursor_name(request)
            offset = _integer(request, "offset")
            if offset > journal.end_offset:
                raise _Refusal(
                    416,
                    "beyond_end",
                    f"offset {offset} is past the end {journal.end_offset}",
                    end_offset=journal.end_offset,
                )
        except _Refusal as refusal:
            return self._refused(refusal)
        await asyncio.to_thread(self.hub.cursors.save, name, offset)
        view = self._cursor_view(name, offset)
        if view["lost"]:
            # Saved all the same (the reader goes on from what is left), but it must hear of
            # the loss: an explicit error, never a silent skip.
            return self._refused(
                _Refusal(
                    410,
                    "offsets_deleted",
                    f"offsets {offset}-{journal.first_offset - 1} were deleted by retention "
                    "before this reader read them",
                    requested=offset,
                    first_offset=journal.first_offset,
                )
            )
        return web.json_response(view)

    async def delete_cursor(self, request: web.Request) -> web.Response:
        try:
            name = self._cursor_name(request)
        except _Refusal as refusal:
            return self._refused(refusal)
        if not await asyncio.to_thread(self.hub.cursors.delete, name):
            return web.json_response(
                {"error": "not_found", "reason": f"no cursor {name}"}, status=404
            )
        return web.json_response({"name": name, "deleted": True})

    async def cursors(self, request: web.Request) -> web.Response:
        offsets = await asyncio.to_thread(self.hub.cursors.offsets)
        return web.json_response(
            {
                **self._offsets(),
                "retain_unread": self.config.retain_unread,
                "cursors": [self._cursor_view(n, o) for n, o in sorted(offsets.items())],
            }
        )


def _abort(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


def add_routes(app: web.Application, server: WebServer) -> None:
    api = JournalAPI(server)
    server.on_stop(api.stop)
    app.router.add_get("/api/journal", api.info)
    app.router.add_get("/api/journal/read", api.read)
    app.router.add_get("/api/journal/cursors", api.cursors)
    app.router.add_put("/api/journal/cursors/{name}", api.put_cursor)
    app.router.add_delete("/api/journal/cursors/{name}", api.delete_cursor)
