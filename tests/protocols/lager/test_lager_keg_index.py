"""protocols/lager/keg.py: the vectorised record walk for kegs with mixed row sizes finds exactly
the records (and the stop point and problem) that a plain record-by-record walk finds, and the
vectorised ``table`` gives the same columns as decoding each row."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.protocols.lager.formats import parse_format_xml
from taproom.protocols.lager.keg import HEADER_SIZE, KegFileWriter, _index, read_keg
from tests.support import fuzz_examples

# Three taps: two share their first two uuid bytes (the prefix table's false hits), sizes differ.
UA = bytes.fromhex("abcd") + bytes(range(14))
UB = bytes.fromhex("abcd") + bytes(range(100, 114))
UC = bytes(range(200, 216))
UNKNOWN = bytes.fromhex("abcd") + bytes(14)  # shares the prefix, is no tap
SIZES = {UA: 1, UB: 7, UC: 24}
# Five more taps: more distinct prefixes than the compare scan takes (the table scan runs).
MANY = {**SIZES, **{bytes([i, 7]) + bytes(14): i for i in range(1, 6)}}


def reference_walk(
    blob: bytes, begin: int, end: int, sizes: dict[bytes, int]
) -> tuple[list[bytes], list[int], list[int], int, str]:
    """The obvious walk: read a uuid, look up its size, step over the record."""
    pos, uuids, timestamps, starts, problem = begin, [], [], [], ""
    while pos + 24 <= end:
        u = blob[pos : pos + 16]
        size = sizes.get(u)
        if size is None:
            problem = "record with an unknown tap uuid"
            break
        if pos + 24 + size > end:
            break
        uuids.append(u)
        timestamps.append(struct.unpack_from(">Q", blob, pos + 16)[0])
        starts.append(pos + 24)
        pos += 24 + size
    return uuids, timestamps, starts, pos, problem


def check(blob: bytes, end: int, sizes: dict[bytes, int]) -> None:
    uuids, ts, starts, stop, problem = _index(blob, HEADER_SIZE, end, sizes)
    want = reference_walk(blob, HEADER_SIZE, end, sizes)
    assert [u.tobytes() for u in uuids] == want[0]
    assert ts.dtype == np.uint64 and ts.tolist() == want[1]
    assert starts.dtype == np.int64 and starts.tolist() == want[2]
    assert (stop, problem) == want[3:]


record = st.tuples(
    st.sampled_from([UA, UB, UC, UNKNOWN]),
    st.integers(0, 2**64 - 1),
    # payload bytes: random, or made of uuid bytes so candidates appear inside payloads
    st.one_of(st.binary(min_size=24, max_size=24), st.sampled_from([UA * 2, UB + UA, UC + UB])),
)


@settings(max_examples=fuzz_examples(300, 100_000), deadline=None)
@given(
    records=st.lists(record, max_size=40),
    unknown_weight=st.integers(0, 9),
    cut=st.integers(0, 40),
)
def test_mixed_walk_matches_the_reference(
    records: list[tuple[bytes, int, bytes]], unknown_weight: int, cut: int
) -> None:
    body = bytearray(b"\x00" * HEADER_SIZE)
    for u, ts, payload in records:
        if u == UNKNOWN and unknown_weight:  # mostly known taps; sometimes a stray uuid
            u = UA
        body += u + struct.pack(">Q", ts) + payload[: SIZES.get(u, 5)]
    blob = bytes(body) + b"<xml/>"
    end = max(HEADER_SIZE, len(body) - cut)
    check(blob, end, SIZES)  # the compare scan
    check(blob, end, MANY)  # the table scan


def test_edge_cases() -> None:
    head = b"\x00" * HEADER_SIZE
    check(head, HEADER_SIZE, SIZES)  # no records
    check(head + UA[:10], HEADER_SIZE + 10, SIZES)  # shorter than a record head
    check(head + UNKNOWN + bytes(9), HEADER_SIZE + 25, SIZES)  # only an unknown uuid
    check(head + UA + bytes(9), HEADER_SIZE + 25, {})  # no formats at all
    one = head + UA + struct.pack(">Q", 7) + b"\x05"
    check(one, len(one), SIZES)
    check(one, len(one) - 1, SIZES)  # torn
    # A long interleaved keg (the chain has no breaks) and one with uuids inside payloads.
    rng = np.random.default_rng(3)
    body = bytearray(head)
    for i in range(5000):
        u = (UA, UB, UC)[int(rng.integers(3))]
        body += u + struct.pack(">Q", i) + (UA * 2)[: SIZES[u]]
    check(bytes(body), len(body), SIZES)


F8 = parse_format_xml(
    '<format version="BEERR01"><item name="x" type="double" size="8" offset="0"/>'
    '<item name="s" type="string" size="3" offset="8"/></format>'
)
F5 = parse_format_xml(
    '<format version="BEERR01"><item name="n" type="uint32_t" size="4" offset="1"/>'
    '<item name="ok" type="bool" size="1" offset="0"/></format>'
)


def test_read_keg_and_table_mixed_sizes(tmp_path: Path) -> None:
    u1, u2 = uuid.UUID(int=11), uuid.UUID(int=12)
    path = tmp_path / "mixed.lgr"
    with KegFileWriter(path, {str(u1): F8, str(u2): F5}, fsync=False) as w:
        for i in range(3000):
            if i % 3:
                w.write(u1.bytes, 10 + i, F8.encode_row({"x": i / 4, "s": str(i % 100)}))
            else:
                w.write(u2.bytes, 20 + i, F5.encode_row({"n": i * 7, "ok": i % 2 == 0}))
    keg = read_keg(path)
    assert keg.record_count == 3000 and keg.dropped_bytes == 0
    for text, fmt in ((str(u1), F8), (str(u2), F5)):
        table = keg.table(text)
        rows = [(ts, fmt.decode_row(p)) for t, ts, p in keg.iter_records() if t == text]
        assert table["timestamp_ns"].tolist() == [ts for ts, _ in rows]
        for name in fmt.names:
            assert table[name].tolist() == [row[name] for _, row in rows]
    assert keg.table(str(u2))["n"].dtype == np.uint32
