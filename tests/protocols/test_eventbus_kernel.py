"""The Event BUS collector's compiled kernel (zmqburst/eventbus.c) against its Python twin.

eb_scan may take a PUB command only when parse_pub accepts it, and must then give parse_pub's
own event time and (lowercased) UUID; everything else it leaves to Python, which refuses it
with parse_pub's reason. eb_emit must write state.seed_record's bytes and the BROADCAST's
frames. Fuzzed commands (mutated frames, random MessagePack, awkward timestamps, UTF-8 and
UUIDs) go through both in bursts laid out as tb_recv lays them out, with no socket; the
collector on both burst paths is tests/servers/test_eventbus.py (TestCollector).
"""

from __future__ import annotations

import itertools
import random
import struct
import uuid
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from taproom import zmqburst
from taproom.eventtime import EventTimes
from taproom.protocols.eventbus import EventBusError, Limits, parse_pub
from taproom.servers.eventbus.kernel import SeedKernel
from taproom.servers.eventbus.state import seed_record
from tests.support import fuzz_examples

LIMITS = Limits()


@pytest.fixture
def kernel() -> SeedKernel:
    """The compiled kernel; fails (never skips) when the compiled module is not built."""
    zmqburst.select("ext")
    made = SeedKernel.create(LIMITS, 4096, 4 << 20)
    assert made is not None
    return made


def _burst(kernel: Any, messages: list[list[bytes]]) -> Any:
    """Messages laid out as tb_recv lays out a burst (16 frames kept), for either kernel (the
    seed's routing id first; the CHP test uses it too)."""
    ffi = kernel.ffi
    frames = [f for m in messages for f in m[:16]]
    ends, pos = [], 0
    for f in frames:
        pos += len(f)
        ends.append(pos)
    data = b"".join(frames)
    return SimpleNamespace(
        buf=ffi.new("char[]", data or b"\0"),
        frame_end=ffi.new("size_t[]", ends or [0]),
        counts_c=ffi.new("int[]", [len(m) for m in messages]),
        _max_frames=16,
        n=len(messages),
        size=len(data),
        messages=messages,
    )


def _python(frames: list[bytes]) -> tuple[str, Any]:
    times = EventTimes()
    try:
        event = parse_pub(frames, LIMITS, times)
    except EventBusError as exc:
        return "refused", exc.reason
    return "accepted", (event, times.take())


def _check(kernel: SeedKernel, messages: list[list[bytes]]) -> int:
    """Scan a burst as the collector does; every message the kernel takes must be one parse_pub
    accepts with the same time and UUID, and its record and BROADCAST must be Python's.
    Returns how many the kernel took."""
    burst = _burst(kernel, messages)
    starts = [0]
    for m in messages:
        starts.append(starts[-1] + min(len(m), 16))
    taken = 0
    start, seq = 0, 1000
    kernel.start_batch()
    while start < burst.n:
        res = kernel.scan(burst, start, starts[start])
        scanned, nxt, slow = res.scanned, res.next, res.slow
        assert nxt == start + scanned
        uuids = kernel.ffi.buffer(kernel.uuids, 36 * scanned)[:]
        expected_records, expected_broadcasts = [], []
        for k in range(scanned):
            frames = messages[start + k][1:]
            verdict, detail = _python(frames)
            assert verdict == "accepted", (frames, detail)
            event, out_of_range = detail
            assert out_of_range == 0
            assert kernel.ts_ns[k] == event.ts_ns, frames
            assert uuids[36 * k : 36 * k + 36] == event.uuid.encode(), frames
            seq += 1
            uuid_b = event.uuid.encode()
            parts = seed_record(
                frames[0], frames[2], frames[3], uuid_b, event.data, seq, event.ts_ns, 123
            )
            expected_records.append(b"".join(parts))
            expected_broadcasts += [
                frames[0], struct.pack(">Q", seq), frames[2], frames[3],
                event.uuid.encode(), event.data,
            ]  # fmt: skip
        if scanned:
            firsts = [starts[start + k] for k in range(scanned)]
            seqs = list(range(seq - scanned + 1, seq + 1))
            records = kernel.emit(burst, firsts, seqs, list(range(scanned)), 123, 2 * burst.size)
            assert records == b"".join(expected_records)
            taken += scanned
        wire = kernel.broadcasts()
        if expected_broadcasts:
            assert wire is not None
            buf, ends, _counts, n = wire
            ends_list = [0, *kernel.ffi.unpack(ends, 6 * n)]
            data = kernel.ffi.buffer(buf, ends_list[-1])[:]
            got = [data[a:b] for a, b in itertools.pairwise(ends_list)]
            assert got[-len(expected_broadcasts) :] == expected_broadcasts
        if not slow:
            break
        start = nxt + 1  # Python handles message nxt
    return taken


def _pub(rng: random.Random, i: int) -> list[bytes]:
    return [
        b"id%d" % (i % 3),
        f"/fz/{i % 7}/x".encode(),
        struct.pack(">Q", i),
        b"producer",
        b"2026-11-22T08:00:%02d.%06dZ" % (i % 60, i),
        str(uuid.UUID(int=rng.getrandbits(128), version=4)).encode(),
        msgpack.packb({"i": i, "pad": "x" * rng.randrange(50)}),
    ]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 127, 128, -33, 1 << 40, -(1 << 63), (1 << 64) - 1])
    if kind == 3:
        return rng.random() * 1e6
    if kind == 4:
        return "é" * rng.randrange(40)
    if kind == 5:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(300)))
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(20))]
    if kind == 7:
        return {rng.randrange(100): _random_value(rng, depth + 1) for _ in range(rng.randrange(20))}
    if kind == 8:
        return msgpack.ExtType(rng.randrange(10), b"x" * rng.randrange(20))
    return {"k": [_random_value(rng, depth + 1)]}


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    kind = rng.randrange(10)
    j = rng.randrange(1, 7)
    if kind == 1:
        del frames[j]
    elif kind == 2:
        frames.insert(j, frames[rng.randrange(1, 7)])
    elif kind == 3:
        frames[j] = frames[j][: rng.randrange(len(frames[j]) + 1)]
    elif kind == 4 and frames[j]:
        flipped = bytearray(frames[j])
        for _ in range(rng.randrange(1, 3)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        frames[j] = bytes(flipped)
    elif kind == 5:
        frames[6] = msgpack.packb(_random_value(rng), use_bin_type=rng.random() < 0.5)
    elif kind == 6:
        frames[6] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 12)))
    elif kind == 7:
        frames += [b"x"] * rng.randrange(1, 12)
    elif kind == 8:
        frames[5] = frames[5].upper() if rng.random() < 0.5 else str(uuid.uuid1()).encode()
    elif kind == 9:
        frames[6] = frames[6] + b"\x00"  # extra data after the value
    return frames


def test_fuzzed_bursts_match_parse_pub_and_seed_record(kernel: SeedKernel) -> None:
    rng = random.Random(32)
    taken = total_valid = 0
    for b in range(fuzz_examples(40, 2000)):
        messages = []
        for i in range(rng.randrange(1, 120)):
            frames = _pub(rng, b * 1000 + i)
            if rng.random() < 0.5:
                frames = _mutate(rng, frames)
            messages.append(frames)
            total_valid += _python(frames[1:])[0] == "accepted"
        taken += _check(kernel, messages)
    # the kernel is the fast path, not a pass-through: it takes the usual forms itself
    assert taken >= 0.8 * total_valid


TIMESTAMPS = [
    b"2026-11-22T08:00:00Z", b"2026-11-22t08:00:00z", b"2026-11-22 08:00:00+00:00",
    b"2024-02-29T23:59:59.999999999Z", b"2026-02-29T08:00:00Z", b"2026-11-22T24:00:00Z",
    b"2026-11-22T08:60:00Z", b"2026-11-22T08:00:60Z", b"2026-13-01T00:00:00Z",
    b"2026-00-10T00:00:00Z", b"2026-04-31T00:00:00Z", b"1970-01-01T00:00:00Z",
    b"1969-12-31T23:59:59Z", b"2261-12-31T23:59:59.999999999Z", b"2262-04-11T23:47:16Z",
    b"2262-04-12T00:00:00Z", b"9999-12-31T23:59:59Z", b"0001-01-01T00:00:00Z",
    b"2026-11-22T08:00:00.Z", b"2026-11-22T08:00:00.1234567890Z", b"2026-11-22T08:00:00.1Z",
    b"2026-11-22T08:00:00+01:00", b"2026-11-22T08:00:00-00:00", b"2026-11-22T08:00:00",
    b"2026-11-22", b"2026-11-22T08:00Z", b"2026-11-22T08:00:00.5+00:00", b"last tuesday",
    b"2026-11-22T08:00:0xZ", b"\xff026-11-22T08:00:00Z", b"2026-11-22X08:00:00Z",
    b"+2026-11-22T08:00:00Z", b"2026-W47-1T08:00:00Z",
]  # fmt: skip
TOPICS = [
    b"/a", b"/", b"a/b", b"", b"/\x00ctl", "/é".encode(), b"/\xed\xa0\x80", b"/\xc0\xaf",
    "/😀".encode(), b"/\xf4\x90\x80\x80", b"/" + b"x" * 1023, b"/" + b"x" * 1024,
]  # fmt: skip
DATA = [
    b"\xc0", b"\x90", b"\x80", b"\x81\x01\x02", b"\x81\x91\x01\x02", b"\x81\x80\x02",
    b"\xd4\x01\x02", b"\xc7\x00\x05", b"\xd6\xff\x00\x00\x00\x01", b"\xc1", b"\x92\x01",
    b"\xa3abc", b"\xa3ab", b"\xdc\x00\x02\x01\x02", b"\xc4\x02\xff\xfe", b"\xd9\x01\xff",
    b"\x91" * 40 + b"\xc0", b"\x91" * 33 + b"\xc0", b"\x91" * 32 + b"\xc0", b"\xcb" + bytes(8),
    b"\xde\x00\x01\xa1k\x90", b"\xc0\xc0", b"",
]  # fmt: skip


def test_edges_of_every_field(kernel: SeedKernel) -> None:
    rng = random.Random(7)
    messages = []
    for ts in TIMESTAMPS:
        messages.append([*_pub(rng, 1)[:4], ts, *_pub(rng, 1)[5:]])
    for topic in TOPICS:
        messages.append([b"id", topic, *_pub(rng, 2)[2:]])
    for data in DATA:
        messages.append([*_pub(rng, 3)[:6], data])
    for seq in (b"", b"12345678", b"\x00" * 7, b"00000001", b"1"):
        messages.append([b"id", b"/s", seq, *_pub(rng, 4)[3:]])
    for producer in (b"", "é".encode(), b"\xff", b"p" * 256, b"p" * 257):
        messages.append([b"id", b"/p", bytes(8), producer, *_pub(rng, 5)[4:]])
    taken = _check(kernel, messages)
    assert taken >= 20  # the plain forms among them are taken
