"""The CHP collector's compiled kernel (zmqburst/eventbus.c: eb_kv_scan, eb_kv_emit) against
its Python twin (kvmsg.parse_update, state.chp_event, state.journal_event, state.kv_frames).

eb_kv_scan may take a kvmsg update only when parse_update accepts it, and must then give its
event time, uuid text and hashmap charge; everything else it leaves to Python, which refuses
it with parse_update's reason. eb_kv_emit must write journal_event's record, the seed's
BROADCAST frames and the kvmsg the CHP publisher sends. Fuzzed updates (mutated frames,
awkward properties, timestamps incl. ones the journal cannot hold, uuids, deletions, bodies
at the bounds) go through both in bursts laid out as the reader lays them out, with no
socket; the collector on both burst paths is tests/servers/test_eventbus_chp.py.
"""

from __future__ import annotations

import itertools
import random
import struct
import uuid
from typing import Any

import pytest

from taproom import zmqburst
from taproom.eventtime import EventTimes
from taproom.protocols.eventbus import EventBusError, Limits, kvmsg
from taproom.records import BatchBuilder
from taproom.servers.eventbus.kernel import ChpKernel
from taproom.servers.eventbus.state import chp_event, entry_bytes, journal_event, kv_frames
from tests.protocols.test_eventbus_kernel import _burst
from tests.support import fuzz_examples

# small bounds, so the fuzz reaches every one of them
LIMITS = Limits(
    max_topic_bytes=48, max_producer_bytes=12, max_data_bytes=300, max_properties_bytes=160
)
RECEIVED = "2026-11-26T23:59:59.123456+00:00"
RECEIVED_NS = 1_795_737_599_123_456_000
SEQUENCE = struct.Struct(">Q")


@pytest.fixture
def kernel() -> ChpKernel:
    """The compiled kernel; fails (never skips) when the compiled module is not built."""
    zmqburst.select("ext")
    made = ChpKernel.create(LIMITS, 4096, 1 << 20)
    assert made is not None
    return made


def _python(frames: list[bytes]) -> tuple[str, Any]:
    times = EventTimes()
    try:
        update = kvmsg.parse_update(frames, LIMITS, times)
    except EventBusError as exc:
        return "refused", exc.reason
    return "accepted", (update, times.take())


def _expected(frames: list[bytes], seq: int) -> tuple[Any, bytes, tuple[bytes, ...], Any, int]:
    """What the Python path makes of an update it accepts: the event, its record, its
    BROADCAST frames, its kvmsg frames and its hashmap charge."""
    verdict, detail = _python(frames)
    assert verdict == "accepted", (frames, detail)
    update, out_of_range = detail
    assert update.uuid and not out_of_range and _kernel_properties(update.properties)
    event = chp_event(update, update.uuid, RECEIVED, RECEIVED_NS)
    builder = BatchBuilder(RECEIVED_NS)
    timestamp = event.timestamp.encode()
    journal_event(builder, event, seq, timestamp)
    broadcast = (
        event.topic.encode(), SEQUENCE.pack(seq), event.producer.encode(), timestamp,
        event.uuid.encode(), event.data,
    )  # fmt: skip
    charge = entry_bytes(broadcast, event.chp) if event.data else 0
    return event, builder.build().body, broadcast, kv_frames(broadcast, event.chp), charge


def _kernel_properties(properties: bytes) -> bool:
    """Whether the properties Python keeps (all but producer and timestamp) are some the
    kernel takes: none, or one ttl in whole seconds."""
    if not properties:
        return True
    name, _, value = properties.partition(b"=")
    return name == b"ttl" and value[:-1].isdigit() and value.count(b"\n") == 1


def _frames(ffi: Any, buf: Any, ends: Any, count: int) -> list[bytes]:
    bounds = [0, *ffi.unpack(ends, count)]
    data = ffi.buffer(buf, bounds[-1])[:]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def _check(kernel: ChpKernel, messages: list[list[bytes]]) -> int:
    """Scan a burst as the collector does (every update admitted); every update the kernel
    takes must be one parse_update accepts, with the Python path's time, uuid, charge,
    record, BROADCAST and kvmsg. Returns how many the kernel took."""
    burst = _burst(kernel, messages)
    starts = [0, *itertools.accumulate(min(len(m), 16) for m in messages)]
    taken, start, seq = 0, 0, 1000
    kernel.start_batch(RECEIVED.encode(), RECEIVED_NS)
    broadcasts: list[bytes] = []
    kvs: list[bytes] = []
    while start < burst.n:
        res = kernel.scan(burst, start, starts[start])
        scanned, nxt, slow = res.scanned, res.next, res.slow
        assert nxt == start + scanned
        uuids = kernel.ffi.buffer(kernel.uuids, 36 * scanned)[:]
        records = []
        for k in range(scanned):
            seq += 1
            event, record, broadcast, kv, charge = _expected(messages[start + k], seq)
            assert kernel.ts_ns[k] == event.ts_ns, messages[start + k]
            assert uuids[36 * k : 36 * k + 36] == event.uuid.encode()
            assert kernel.items[k].entry == charge, messages[start + k]
            assert kernel.items[k].expires_ms == event.expires_ms, messages[start + k]
            records.append(record)
            broadcasts += broadcast
            kvs += kv
        if scanned:
            firsts = [starts[start + k] for k in range(scanned)]
            seqs = list(range(seq - scanned + 1, seq + 1))
            out, bc, bc_ends, kv_bytes, kv_ends = kernel.emit(
                burst, firsts, seqs, list(range(scanned)), 2 * burst.size
            )
            assert out == b"".join(records)
            # the entries' slices: the frames just laid out
            assert [bc[a:b] for a, b in itertools.pairwise([0, *bc_ends])] == broadcasts[
                -6 * scanned :
            ]
            assert [kv_bytes[a:b] for a, b in itertools.pairwise([0, *kv_ends])] == kvs[
                -5 * scanned :
            ]
            taken += scanned
        if not slow:
            break
        start = nxt + 1
    wire, kv_wire = kernel.wires()
    if broadcasts:
        assert wire is not None and kv_wire is not None
        ffi = kernel.ffi
        assert wire[3] == kv_wire[3] == taken
        assert _frames(ffi, wire[0], wire[1], 6 * taken) == broadcasts
        assert _frames(ffi, kv_wire[0], kv_wire[1], 5 * taken) == kvs
    else:
        assert wire is None and kv_wire is None
    return taken


TIMESTAMPS = [
    "2026-11-22T08:00:00Z", "2026-11-22t08:00:00z", "2026-11-22 08:00:00+00:00",
    "2024-02-29T23:59:59.999999999Z", "2026-02-29T08:00:00Z", "2026-11-22T24:00:00Z",
    "1970-01-01T00:00:00Z", "1969-12-31T23:59:59Z", "2261-12-31T23:59:59.999999999Z",
    "2262-04-11T23:47:16Z", "2262-04-12T00:00:00Z", "9999-12-31T23:59:59Z",
    "0001-01-01T00:00:00Z", "2026-11-22T08:00:00.Z", "2026-11-22T08:00:00.1234567890Z",
    "2026-11-22T08:00:00+01:00", "2026-11-22T08:00:00", "2026-11-22", "last tuesday", "",
    "2026-11-22T08:00:00.5+00:00",
]  # fmt: skip


def _update(rng: random.Random, i: int) -> list[bytes]:
    """A plain update as the Guide's clients send one, with taproom's properties at times."""
    lines = []
    if rng.random() < 0.5:
        lines.append(b"producer=" + rng.choice([b"p1", b"", "é".encode(), b"a=b", b"x" * 12]))
    if rng.random() < 0.5:
        lines.append(b"timestamp=2026-11-22T08:00:%02d.%06dZ" % (i % 60, i))
    if rng.random() < 0.3:  # the Guide's clonecli6 sends a ttl of 0-29 s with every update
        ttl = rng.choice([0, 1, 29, 315360000, 315360001, 10**11, 10**12, 7])
        lines.insert(rng.randrange(len(lines) + 1), b"ttl=%d" % ttl)
    properties = b"\n".join(lines) + (b"\n" if lines and rng.random() < 0.7 else b"")
    body = (
        b""
        if rng.random() < 0.1
        else bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60)))
    )
    return [
        f"/fz/{i % 7}/x".encode() if i % 5 else f"/k{i % 11}".encode(),
        SEQUENCE.pack(rng.getrandbits(64)),
        uuid.UUID(int=rng.getrandbits(128), version=4).bytes,
        properties,
        body,
    ]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    kind = rng.randrange(14)
    j = rng.randrange(5)
    if kind == 0:
        del frames[j]
    elif kind == 1:
        frames.insert(j, frames[rng.randrange(5)])
    elif kind == 2:
        frames[j] = frames[j][: rng.randrange(len(frames[j]) + 1)]
    elif kind == 3 and frames[j]:
        flipped = bytearray(frames[j])
        for _ in range(rng.randrange(1, 3)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        frames[j] = bytes(flipped)
    elif kind == 4:
        frames[2] = rng.choice([b"", uuid.uuid1().bytes, b"\x00" * 16, uuid.uuid4().bytes[:15]])
    elif kind == 5:
        stamp = rng.choice(TIMESTAMPS).encode()
        frames[3] = rng.choice([b"", b"producer=p\n"]) + b"timestamp=" + stamp + b"\n"
    elif kind == 6:
        frames[3] = rng.choice([
            b"ttl=5\n", b"ttl=0.5", b"ttl=x", b"other=1\n", b"ttl=5\nttl=6\n", b"ttl=\n",
            b"ttl=007", b"ttl=-1", b"ttl=5\nother=1", b"producer\n", b"=x\n", b"\n\n",
            b"pro\x00ducer=x\n", b"producer=" + b"x" * 13 + b"\n", b"producer=\xff\n",
            b"\xc3(=1", b"timestamp=1\ntimestamp=2026-11-22T08:00:00Z",
            b"timestamp=2026-11-22T08:00:00Z\ntimestamp=1", b"producer=a\nproducer=bb\n",
            b"x" * 161, b"producer=a\r\n", b"timestamp=2026-11-22T08:00:00Z\r\n",
        ])  # fmt: skip
    elif kind == 7:
        frames[4] = b"b" * rng.choice([0, 255, 256, 299, 300, 301])
    elif kind == 8:
        frames[0] = rng.choice([
            b"/", b"a/b", b"", b"/\x00", "/é".encode(), b"/\xed\xa0\x80", b"/" + b"x" * 47,
            b"/" + b"x" * 48, b"HUGZ", b"/a/b/c",
        ])  # fmt: skip
    elif kind == 9:
        frames[1] = rng.choice([b"", b"\x00" * 7, b"\x00" * 9])
    elif kind == 10:
        frames += [b"x"] * rng.randrange(1, 14)
    return frames


def test_fuzzed_bursts_match_parse_update_and_journal_event(kernel: ChpKernel) -> None:
    rng = random.Random(32)
    taken = plain = 0
    for b in range(fuzz_examples(40, 2000)):
        messages = []
        for i in range(rng.randrange(1, 120)):
            frames = _update(rng, b * 1000 + i)
            if rng.random() < 0.5:
                frames = _mutate(rng, frames)
            messages.append(frames)
            verdict, detail = _python(frames)
            if verdict == "accepted":
                update, out_of_range = detail
                plain += bool(
                    update.uuid and not out_of_range and _kernel_properties(update.properties)
                )
        taken += _check(kernel, messages)
    # the kernel is the fast path, not a pass-through: it takes the plain forms itself
    assert taken >= 0.9 * plain


def test_edges_of_every_field(kernel: ChpKernel) -> None:
    """Each timestamp, and each mutation of each field, once, beside a plain update."""
    rng = random.Random(7)
    messages = []
    for stamp in TIMESTAMPS:
        messages.append([*_update(rng, 1)[:3], b"timestamp=" + stamp.encode() + b"\n", b"v"])
    for kind in range(14):
        for _ in range(8):
            messages.append(_mutate(rng, _update(rng, kind)))
    messages.append([b"/a", bytes(8), uuid.uuid4().bytes, b"", b""])  # a deletion
    messages.append([b"/a", bytes(8), uuid.uuid4().bytes, b"", b"x" * 300])  # at max_data
    taken = _check(kernel, messages)
    assert taken >= 20  # the plain forms among them are taken
