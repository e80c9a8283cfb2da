"""servers/lager/forwarder.py hot path (issue 7): records written from per-tap constant parts are
byte-identical to ``BatchBuilder``'s, and the per-tap cache follows format changes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.protocols.lager.chp import registration_frames
from taproom.protocols.lager.formats import parse_format_xml
from taproom.records import BatchBuilder
from taproom.servers.lager import MARK_PREFIX, DataRecords
from tests.servers.test_lager import XML, Peer, register, rejected
from tests.support import fuzz_examples, running_app

# Every test on taproom.zmqburst's compiled path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("zmq_path")


def builder_record(
    key: str, uuid_text: str, attrs: bytes, received_ns: int, ts_ns: int, payload: bytes
) -> bytes:
    builder = BatchBuilder(received_ns=received_ns)
    builder.add(
        "lager",
        payload,
        stream=key,
        producer=uuid_text,
        ts_ns=ts_ns,
        content_type="lager",
        attrs=attrs,
    )
    return builder.build().body


@settings(max_examples=fuzz_examples(500, 200_000), deadline=None)
@given(
    key=st.text(min_size=1, max_size=40),
    raw_uuid=st.binary(min_size=16, max_size=16),
    version=st.binary(max_size=8),
    flags=st.integers(0, 0xFFFF),
    rows=st.lists(
        st.tuples(st.integers(0, 2**63 - 1), st.integers(-(2**63), 2**63 - 1)),
        min_size=1,
        max_size=5,
    ),
    row_size=st.integers(0, 64),
)
def test_data_records_match_batch_builder(
    key: str,
    raw_uuid: bytes,
    version: bytes,
    flags: int,
    rows: list[tuple[int, int]],
    row_size: int,
) -> None:
    uuid_text = str(uuid.UUID(bytes=raw_uuid))
    attrs = orjson.dumps({"version": version.hex(), "flags": str(flags)})
    tap = DataRecords(key, uuid_text, attrs, row_size, [row_size])
    for i, (ts_ns, received_ns) in enumerate(rows):
        payload = bytes([i % 256]) * row_size
        fast = b"".join(tap.parts(received_ns, ts_ns.to_bytes(8, "big"), payload))
        assert fast == builder_record(key, uuid_text, attrs, received_ns, ts_ns, payload)


def test_data_records_refuse_what_a_record_cannot_hold() -> None:
    with pytest.raises(ValueError):
        DataRecords("k" * 70_000, str(uuid.uuid4()), b"", 8, [8])


@pytest.fixture
async def bartender(tmp_path: Path) -> AsyncIterator[tuple[Any, Peer]]:
    async with running_app(tmp_path, enable=["lager"], lager={"hugz_interval_s": 0.2}) as app:
        peer = Peer(app.addresses)
        await peer.settle()
        try:
            yield app, peer
        finally:
            peer.close()


async def test_journal_records_and_forwards_through_the_fast_path(
    bartender: tuple[Any, Peer],
) -> None:
    app, peer = bartender
    u = uuid.uuid4().bytes
    row12 = parse_format_xml(XML).encode_row({"a": 7, "b": 0.5})
    await register(peer, "/Fast/Tap/", u)
    await peer.subscribe_data(u)
    sent = [
        [u, b"\x01\x00", b"\x00\x00", (1).to_bytes(8, "big"), row12],
        [u, b"\x01\x02", b"\x00\x05", (2).to_bytes(8, "big"), row12],  # other version, flags
        [u, b"BEERR01", b"\x03", (3).to_bytes(8, "big"), row12[:4], row12[4:]],  # nasa framing
    ]
    for frames in sent:
        await peer.data_in.send_multipart(frames)
    got = [await asyncio.wait_for(peer.data_out.recv_multipart(), 5) for _ in range(3)]
    assert got == sent  # forwarded as received, both framings
    # The tap re-registers with a 4-byte row: the cached record parts must not outlive it.
    xml4 = '<format version="BEERR01"><item name="n" type="uint32_t" size="4" offset="0"/></format>'
    await register(peer, "/Fast/Tap/", u, xml4)
    await peer.data_in.send_multipart([u, b"\x01\x00", b"\x00\x00", (4).to_bytes(8, "big"), row12])
    await peer.data_in.send_multipart(
        [u, b"\x01\x00", b"\x00\x00", (5).to_bytes(8, "big"), b"abcd"]
    )
    last = await asyncio.wait_for(peer.data_out.recv_multipart(), 5)
    assert last[3:] == [(5).to_bytes(8, "big"), b"abcd"]
    assert rejected(app, "payload_size") == 1
    data = [r for r in app.hub.journal.read(0) if r.content_type == "lager"]
    assert [(r.ts_ns, r.payload, r.attrs) for r in data] == [
        (1, row12, {"version": "0100", "flags": "0"}),
        (2, row12, {"version": "0102", "flags": "5"}),
        (3, row12, {"version": b"BEERR01".hex(), "flags": "3"}),
        (5, b"abcd", {"version": "0100", "flags": "0"}),
    ]
    assert {(r.protocol, r.stream, r.producer, r.topic, r.event_id, r.seq) for r in data} == {
        ("lager", "/Fast/Tap/", str(uuid.UUID(bytes=u)), "", "", 0)
    }
    # Each journal record re-encoded by BatchBuilder gives the same bytes the fast path wrote.
    for base, _count, body in app.hub.journal.read_batches(0):
        records = [r for r in app.hub.journal.read(base) if r.offset >= base][:_count]
        if records[0].content_type != "lager":
            continue
        builder = BatchBuilder()
        for r in records:
            builder.add_record(r)
        assert builder.build().body == bytes(body)


async def test_marks_count_forwarded_rows(bartender: tuple[Any, Peer]) -> None:
    _app, peer = bartender
    u = uuid.uuid4().bytes
    row12 = parse_format_xml(XML).encode_row({"a": 1, "b": 2.0})
    await register(peer, "/Fast/Marks/", u)
    await peer.subscribe_data(u)
    await peer.subscribe_data(MARK_PREFIX + u)
    for i in range(50):
        await peer.data_in.send_multipart(
            [u, b"\x01\x00", b"\x00\x00", i.to_bytes(8, "big"), row12]
        )
    rows = 0
    count = 0
    while count < 50:
        frames = await asyncio.wait_for(peer.data_out.recv_multipart(), 5)
        if frames[0] == MARK_PREFIX + u:
            assert len(frames) == 3 and len(frames[2]) == 8
            count = int.from_bytes(frames[1], "big")
            assert count == rows  # a mark follows the rows it counts, in the same pipe
        else:
            rows += 1
    assert rows == 50


async def test_every_tap_of_a_wide_burst_gets_its_mark(
    bartender: tuple[Any, Peer],
) -> None:
    _app, peer = bartender
    row12 = parse_format_xml(XML).encode_row({"a": 1, "b": 2.0})
    # More taps than a batch marks at once (those marks wait for the HUGZ round).
    taps = [uuid.uuid4().bytes for _ in range(300)]
    for i, u in enumerate(taps):
        await peer.collector.send_multipart(registration_frames(f"/Fleet/T{i}/", u, XML))
    seen = 0
    while seen < len(taps):
        frames = await peer.next_update()
        seen += frames[0].startswith(b"/Fleet/")
    await peer.subscribe_data(MARK_PREFIX)
    for u in taps:
        await peer.data_in.send_multipart([u, b"\x01\x00", b"\x00\x00", bytes(8), row12])
    marked: dict[bytes, int] = {}
    while len(marked) < len(taps):
        frames = await asyncio.wait_for(peer.data_out.recv_multipart(), 5)
        if frames[0].startswith(MARK_PREFIX):
            marked[frames[0][len(MARK_PREFIX) :]] = int.from_bytes(frames[1], "big")
    assert marked == {u: 1 for u in taps}
