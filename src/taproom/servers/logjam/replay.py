"""The replay side channel: a ROUTER that answers ``offset``/``seq`` requests from the journal
(read in a thread), so a consumer that saw a gap can fill it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import zmq
import zmq.asyncio

from ...errors import ProtocolError
from ...hub import Hub
from ...protocols import logjam as lj
from ...records import Record
from ...zmqframes import recv_counted
from .config import LogjamConfig
from .ingest import RejectLog
from .pub import PubOutput
from .zmqio import MAX_FRAMES, readable

__all__ = ["ReplayChannel"]

log = logging.getLogger("taproom.logjam")


class ReplayChannel:
    """Reads the journal back for consumers, mapped as the PUB output maps it."""

    def __init__(self, hub: Hub, config: LogjamConfig, pub: PubOutput, reject: RejectLog) -> None:
        self.hub = hub
        self.config = config
        self.pub = pub
        self.mapper = pub.mapper
        self._reject = reject
        self._guard = hub.supervisor.guard("logjam.replay", protocol="logjam", logger=log)
        self._m_replay = hub.metrics.counter(
            "logjam", "replay_requests", "requests", "Replay requests by outcome", ("kind",)
        )

    def _replay_read(
        self, start: int, end: int, prefixes: Sequence[bytes], seqs: dict[int, int] | None
    ) -> list[bytes]:
        """Runs in a thread: the matching events of ``[start, end)`` as reply frames."""
        frames: list[bytes] = []
        count = 0
        now_ms = int(time.time() * 1000)
        mapper = self.mapper
        device = self.config.device_number
        compression = int(self.pub.compression)
        record: Record
        for record in self.hub.journal.read(start, end):
            if seqs is not None:
                seq = seqs.get(record.offset)
                if seq is None:
                    continue
            else:
                seq = 0  # replayed by offset: not part of the live numbering
                if not mapper.routed(record.protocol):
                    continue
            app_env, topic, body, created = mapper.map(record, now_ms)
            if not lj.matches_prefixes(app_env, prefixes):
                continue
            frames += (
                str(record.offset).encode(),
                app_env,
                topic,
                lj.compress(compression, body) if compression else body,
                self.pub.meta_struct.pack(
                    lj.META_TAG, compression, lj.META_VERSION, device, created, seq
                ),
            )
            count += 1
        return frames

    async def _answer_replay(self, content: Sequence[bytes]) -> list[bytes]:
        req = lj.parse_replay_request(content, max_count=self.config.replay_max_count)
        journal = self.hub.journal
        if req.mode == lj.ReplayMode.OFFSET:
            start = req.start
            if start < journal.first_offset:
                self._m_replay.labels(kind="gone").inc()
                return lj.replay_error(b"410 Gone", f"journal starts at {journal.first_offset}")
            end = min(start + req.limit, self.pub.subscription.next_offset)
            end = max(end, start)
            frames = await asyncio.to_thread(self._replay_read, start, end, req.prefixes, None)
            self._m_replay.labels(kind="offset").inc()
            return [b"200 OK", str(end).encode(), str(len(frames) // 5).encode(), *frames]
        seqs = self.pub.seq_offsets(req.start, req.limit)
        if seqs is None:
            self._m_replay.labels(kind="gone").inc()
            return lj.replay_error(b"410 Gone", "sequence numbers not in the replay index")
        nxt = str(req.limit + 1).encode()
        if not seqs:
            self._m_replay.labels(kind="seq").inc()
            return [b"200 OK", nxt, b"0"]
        lo, hi = min(seqs), max(seqs) + 1
        if lo < journal.first_offset:
            self._m_replay.labels(kind="gone").inc()
            return lj.replay_error(b"410 Gone", f"journal starts at {journal.first_offset}")
        frames = await asyncio.to_thread(self._replay_read, lo, hi, req.prefixes, seqs)
        self._m_replay.labels(kind="seq").inc()
        return [b"200 OK", nxt, str(len(frames) // 5).encode(), *frames]

    async def replay_loop(self, asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        while True:
            await readable(asock, sock)
            try:
                count, frames = recv_counted(sock, MAX_FRAMES)
            except zmq.Again:
                continue
            overflow = count > MAX_FRAMES
            if len(frames) < 2:
                continue
            routing_id = frames[0]
            # REQ clients put an empty delimiter first; DEALER clients may leave it out.
            has_delim = frames[1] == b""
            content = frames[2:] if has_delim else frames[1:]
            try:
                if overflow:
                    raise lj.LogjamError("too many frames", reason="bad_replay_request")
                reply = await self._answer_replay(content)
            except ProtocolError as exc:
                self._reject(exc.reason, str(exc))
                self._m_replay.labels(kind="bad").inc()
                reply = lj.replay_error(lj.BAD_REQUEST, str(exc))
            except Exception as exc:  # a bug: this request gets a 500, the loop goes on
                self._guard.failed(exc, "replay request")
                reply = lj.replay_error(b"500 Internal Server Error", "replay failed")
            envelope = [routing_id, b""] if has_delim else [routing_id]
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(envelope + reply, zmq.NOBLOCK)
