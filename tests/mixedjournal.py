"""A journal of mixed protocols written straight through the journal API (no sockets), fast
enough to make 10M events in well under a minute: the restart bench's input, and the
journal the crash-loop test starts from.

Each protocol's records are made as taproom's servers make them (the same fields, content
types and attrs, so every start-up rebuild reads them as its own), from one template record
per kind repeated with numpy, whose fixed-size fields (sequence, times, topic digits, uuid
digits, idempotency tokens) are written in place. Batches of each protocol are interleaved,
so every segment holds every protocol, as a busy hub's journal does.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgpack
import numpy as np

from taproom.journal import Journal
from taproom.records import RECORD_HEAD, BatchBuilder, EncodedBatch

__all__ = ["MIX", "MixedEvents", "MixedJournal", "build_mixed_journal"]

# Share of events per protocol (lager_registration: a few taps registering now and then).
MIX = {
    "lumberjack": 0.35,
    "logjam": 0.25,
    "logtk": 0.15,
    "eventbus": 0.10,
    "lager": 0.15,
}
# Records per batch, as each server makes them under load (a Lumberjack window, a drained
# ZeroMQ burst, a LogTK data run, ...): drawn uniformly from these.
BATCH_SIZES = {
    "lumberjack": (128, 512, 1024),
    "logjam": (64, 256, 512),
    "logtk": (1, 8, 32, 64),
    "eventbus": (1, 16, 128),
    "lager": (64, 256),
}
BUS_TOPICS = 10_000
LOGTK_CLIENTS = 200
LAGER_TAPS = 50
FORMAT_XML = (
    '<format version="BEERR01"><item name="a" type="uint32_t" size="4" offset="0"/>'
    '<item name="b" type="double" size="8" offset="4"/></format>'
)
_SEQ_AT = 20  # RECORD_HEAD: u32 length, i64 received_ns, i64 ts_ns, u64 seq
_RECEIVED_AT = 4


@dataclass
class MixedJournal:
    """What was written: per protocol, the events (and what a rebuild should find)."""

    path: str
    events: int = 0
    by_protocol: dict[str, int] = field(default_factory=dict)
    registrations: int = 0
    bus_sequence: int = 0
    segments: int = 0
    bytes: int = 0


def _template(protocol: str, payload: bytes, **fields: object) -> bytes:
    builder = BatchBuilder(received_ns=0)
    builder.add(protocol, payload, **fields)  # type: ignore[arg-type]
    return builder.build().body


def _digits(values: np.ndarray, width: int, base: int = 10) -> np.ndarray:
    """``values`` as fixed-width ASCII digit rows (lowercase hex for base 16)."""
    out = np.empty((len(values), width), dtype=np.uint8)
    v = values.astype(np.uint64)
    for i in range(width - 1, -1, -1):
        d = (v % np.uint64(base)).astype(np.uint8)
        out[:, i] = np.where(d < 10, d + 48, d + 87)
        v //= np.uint64(base)
    return out


def _put_u64(rows: np.ndarray, at: int, values: np.ndarray) -> None:
    rows[:, at : at + 8] = values.astype("<u8").view(np.uint8).reshape(-1, 8)


class _Maker:
    def __init__(self, start_ns: int, spacing_ns: int) -> None:
        self.now_ns = start_ns
        self.spacing_ns = spacing_ns
        self.bus_seq = 0
        self.idem = [0] * LOGTK_CLIENTS
        self.lumberjack = _template(
            "lumberjack",
            b'{"message":"GET /api/v1/items/12345 HTTP/1.1 200 512 0.004","host":"web-3",'
            b'"level":"info","service":"shop"}',
            stream="shop",
            topic="log",
            producer="10.0.0.7:51234",
            content_type="json",
            attrs={"beat": "filebeat"},
        )
        self.logjam = _template(
            "logjam",
            b'{"action":"Items#show","code":200,"total_time":4.2,"db_time":1.1,'
            b'"view_time":2.0,"request_id":"5c2a9d0e4b1f4e2a9c3d","host":"app-2"}',
            stream="shop-production",
            topic="logs.shop.production",
            producer="device-1",
            content_type="json",
        )
        self.bus = _template(
            "eventbus",
            msgpack.packb({"host": "web-1", "metric": "latency", "value": 12.5}),
            stream="bench",
            topic="/bench/k/000000",
            producer="producer-1",
            event_id="00000000-0000-4000-8000-000000000000",
            content_type="msgpack",
            attrs=b'{"timestamp":"2025-01-01T00:00:00Z"}',
        )
        self.bus_topic_at = self.bus.index(b"/bench/k/") + len(b"/bench/k/")
        self.bus_uuid_at = self.bus.index(b"00000000-0000-4000-8000-") + 24
        self.logtk = [
            _template(
                "logtk",
                b"\x1d\x00\x00\x00\x02msg\x00\x0c\x00\x00\x00user login\x00\x00",
                stream=f"app{client % 10}",
                producer=f"{client:08x}",
                content_type="bson",
            )
            for client in range(LOGTK_CLIENTS)
        ]
        self.lager_uuids = [f"{tap:08x}-0000-4000-8000-{tap:012x}" for tap in range(LAGER_TAPS)]
        self.lager = [
            _template(
                "lager",
                bytes(12),
                stream=f"/bench/tap{tap}/",
                producer=self.lager_uuids[tap],
                content_type="lager",
                attrs={"version": "BEERR01"},
            )
            for tap in range(LAGER_TAPS)
        ]

    def _rows(self, template: bytes, n: int) -> np.ndarray:
        rows = np.frombuffer(template * n, dtype=np.uint8).reshape(n, len(template)).copy()
        received = self.now_ns + np.arange(n, dtype=np.int64) * self.spacing_ns
        self.now_ns += n * self.spacing_ns
        _put_u64(rows, _RECEIVED_AT, received)
        return rows

    def batch(self, protocol: str, n: int, rng: random.Random) -> EncodedBatch:
        if protocol == "lumberjack":
            rows = self._rows(self.lumberjack, n)
        elif protocol == "logjam":
            rows = self._rows(self.logjam, n)
        elif protocol == "eventbus":
            rows = self._rows(self.bus, n)
            seqs = np.arange(self.bus_seq + 1, self.bus_seq + n + 1, dtype=np.uint64)
            self.bus_seq += n
            _put_u64(rows, _SEQ_AT, seqs)
            topics = (seqs * np.uint64(7919)) % np.uint64(BUS_TOPICS)
            rows[:, self.bus_topic_at : self.bus_topic_at + 6] = _digits(topics, 6)
            rows[:, self.bus_uuid_at : self.bus_uuid_at + 12] = _digits(seqs, 12, 16)
        elif protocol == "logtk":
            client = rng.randrange(LOGTK_CLIENTS)
            rows = self._rows(self.logtk[client], n)
            first = self.idem[client] + 1
            self.idem[client] += n
            _put_u64(rows, _SEQ_AT, np.arange(first, first + n, dtype=np.uint64))
        else:
            rows = self._rows(self.lager[rng.randrange(LAGER_TAPS)], n)
        return EncodedBatch(n, rows.tobytes())

    def registration(self, tap: int) -> EncodedBatch:
        builder = BatchBuilder(received_ns=self.now_ns)
        builder.add(
            "lager",
            FORMAT_XML.encode(),
            stream=f"/bench/tap{tap}/",
            topic="registration",
            producer=self.lager_uuids[tap],
            event_id=self.lager_uuids[tap],
            content_type="lager-registration",
            attrs={"version": "BEERR01"},
        )
        return builder.build()


class MixedEvents:
    """Batches of every protocol, interleaved; each call of :meth:`batches` continues where
    the last one stopped (bus sequence, idempotency tokens, receive times)."""

    def __init__(self, events: int, *, seed: int = 1, span_s: float = 1800.0) -> None:
        self._rng = random.Random(seed)
        spacing = max(1, int(span_s * 1e9 / max(events, 1)))
        self._maker = _Maker(time.time_ns() - int(span_s * 1e9), spacing)
        self._registered = 0
        self._next_registration = 0
        self._written = 0

    @property
    def bus_sequence(self) -> int:
        return self._maker.bus_seq

    def batches(self, events: int) -> Iterator[tuple[str, EncodedBatch]]:
        rng = self._rng
        maker = self._maker
        names = list(MIX)
        weights = [MIX[n] / (sum(BATCH_SIZES[n]) / len(BATCH_SIZES[n])) for n in names]
        end = self._written + events
        while self._written < end:
            if self._written >= self._next_registration:
                # Every tap registers early; a few register again later (a restarted tap).
                tap = self._registered
                if tap >= LAGER_TAPS:
                    tap = rng.randrange(LAGER_TAPS)
                self._registered += 1
                yield "lager-registration", maker.registration(tap)
                self._written += 1
                gap = 10 if self._registered < LAGER_TAPS else 500_000
                self._next_registration = self._written + gap
                continue
            protocol = rng.choices(names, weights)[0]
            n = min(rng.choice(BATCH_SIZES[protocol]), end - self._written)
            yield protocol, maker.batch(protocol, n, rng)
            self._written += n

    def write(self, path: str, events: int, *, segment_bytes: int = 128 << 20) -> MixedJournal:
        """Append ``events`` events to the journal at ``path`` (fsync off, one fsync at the
        end); the journal must not be open elsewhere."""
        journal = Journal(path, fsync="off", segment_bytes=segment_bytes)
        out = MixedJournal(path)
        group: list[EncodedBatch] = []
        group_bytes = 0
        try:
            for protocol, batch in self.batches(events):
                out.events += batch.count
                out.by_protocol[protocol] = out.by_protocol.get(protocol, 0) + batch.count
                group.append(batch)
                group_bytes += len(batch.body)
                if group_bytes >= 8 << 20:
                    journal.commit(group)
                    group, group_bytes = [], 0
            if group:
                journal.commit(group)
            journal.sync()
            out.registrations = out.by_protocol.get("lager-registration", 0)
            out.bus_sequence = self.bus_sequence
            out.segments = len(journal.segments())
            out.bytes = journal.total_bytes
        finally:
            journal.close()
        return out


def build_mixed_journal(path: str, events: int, *, seed: int = 1) -> MixedJournal:
    """A new journal at ``path`` holding ``events`` events received over the last 30 min."""
    return MixedEvents(events, seed=seed).write(path, events)


assert RECORD_HEAD.size == 46  # the offsets above follow records.RECORD_HEAD
