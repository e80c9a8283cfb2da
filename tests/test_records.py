"""The common record and its batch encoding: round trips and field bounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taproom.errors import LimitExceeded
from taproom.records import BatchBuilder, Record, decode_batch, encode_records

text = st.text(max_size=40)
records = st.builds(
    Record,
    protocol=st.text(min_size=1, max_size=20),
    stream=text,
    topic=text,
    producer=text,
    seq=st.integers(0, 2**64 - 1),
    event_id=text,
    ts_ns=st.integers(-(2**63), 2**63 - 1),
    content_type=st.sampled_from(["json", "kv", "raw", "msgpack", "lager"]),
    payload=st.binary(max_size=300),
    attrs=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    received_ns=st.integers(1, 2**63 - 1),
)


@given(st.lists(records, max_size=20), st.integers(0, 2**40))
def test_round_trip(items, base):
    batch = encode_records(items)
    assert batch.count == len(items)
    decoded = decode_batch(batch.body, base)
    assert decoded == [
        Record(**{**{f: getattr(r, f) for f in Record.__dataclass_fields__}, "offset": base + i})
        for i, r in enumerate(items)
    ]


def test_builder_resets_after_build_and_shares_receive_time():
    b = BatchBuilder(received_ns=5)
    b.add("p", b"1", stream="s")
    first = b.build()
    assert len(b) == 0 and b.nbytes == 0
    b.add("p", b"2", stream="s")
    second = b.build()
    assert [r.payload for r in decode_batch(first.body + second.body, 0)] == [b"1", b"2"]
    assert {r.received_ns for r in decode_batch(first.body, 0)} == {5}


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"stream": "s" * 65536}, "field_too_long"),
        ({"event_id": "e" * 65536}, "field_too_long"),
        ({"content_type": "c" * 256}, "field_too_long"),
        ({"seq": -1}, "bad_seq"),
        ({"seq": 2**64}, "bad_seq"),
    ],
)
def test_over_long_fields_are_refused(kwargs, reason):
    b = BatchBuilder()
    with pytest.raises(LimitExceeded) as err:
        b.add("p", b"x", **kwargs)
    assert err.value.reason == reason
    assert len(b) == 0  # nothing half-added


def test_cached_strings_still_checked_once_per_value():
    b = BatchBuilder()
    for _ in range(3):
        b.add("p", b"x", stream="same", topic="t")
    assert [r.stream for r in decode_batch(b.build().body, 0)] == ["same"] * 3


def test_malformed_body_is_a_value_error():
    body = encode_records([Record("p", payload=b"abc")]).body
    with pytest.raises(ValueError):
        decode_batch(body[:-1], 0)
    with pytest.raises(ValueError):
        decode_batch(body[:10], 0)
