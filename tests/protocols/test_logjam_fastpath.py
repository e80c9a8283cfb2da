"""IngestParser.push, the ingest fast path that writes journal records with RECORD_HEAD itself:
it must give byte-identical batches to the BatchBuilder path (and so to parse_message), and the
same errors, reason for reason."""

from __future__ import annotations

import struct

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.errors import ProtocolError
from taproom.protocols import logjam as lj
from taproom.protocols.logjam import Compression
from taproom.records import BatchBuilder, EncodedBatch, decode_batch
from tests.support import fuzz_examples

MAX = 1 << 16
RECEIVED_NS = 1_763_800_000_123_456_789


def both(
    messages, *, grammar="device", max_body=MAX, max_decompressed=MAX, received_ns=RECEIVED_NS
):
    """Feed ``messages`` (lists of frames) to a fresh parser through both paths.

    Returns the two batches and the reasons of the messages each path refused, in order; both
    paths count the same bodies as not JSON."""
    slow_parser = lj.IngestParser(
        max_body=max_body, max_decompressed=max_decompressed, grammar=grammar
    )
    fast_parser = lj.IngestParser(
        max_body=max_body, max_decompressed=max_decompressed, grammar=grammar
    )
    builder = BatchBuilder(received_ns=received_ns)
    fast_parser.start_batch(received_ns)
    slow_reasons, fast_reasons = [], []
    for frames in messages:
        try:
            slow_parser.add(builder, frames)
        except ProtocolError as exc:  # LogjamError, or the builder's LimitExceeded
            slow_reasons.append(exc.reason)
        try:
            fast_parser.push(*frames)
        except ProtocolError as exc:
            fast_reasons.append(exc.reason)
    assert fast_parser.pending() == len(builder)
    assert fast_parser.not_json == slow_parser.not_json
    return builder.build(), fast_parser.take_batch(), slow_reasons, fast_reasons


def test_a_burst_of_varied_messages_is_byte_identical():
    messages = []
    app_envs = [b"shop-production", b"a-b", b"web_app-staging_eu", b"x-y"]
    topics = [b"logs", b"logs.shop.production", b"events.order", b"frontend.page"]
    for i in range(400):
        body = orjson.dumps({"i": i, "text": "é" * (i % 7), "list": list(range(i % 5))})
        method = Compression(i % 4)
        device = [0, 1, 65535, (1 << 32) - 1][i % 4]
        created = [0, 1_700_000_000_000 + i, ((1 << 63) - 1) // 1_000_000 + 1, (1 << 64) - 1][
            (i // 4) % 4
        ]
        seq = [1, i, (1 << 64) - 1][i % 3]
        frames = lj.encode_message(
            app_envs[i % 4],
            topics[(i // 3) % 4],
            body,
            compression=method,
            device=device if i % 8 else device & 0xFFFF,
            created_ms=created,
            sequence=seq,
            meta_size=22 if i % 8 == 0 else 24,
        )
        messages.append(frames)
    # the byte-swapped meta some senders write
    messages.append(
        [b"app-prod", b"logs", b"{}", struct.pack("<HBBIQQ", lj.META_TAG, 0, 1, 9, 123, 4)]
    )
    slow, fast, slow_reasons, fast_reasons = both(messages)
    assert slow_reasons == fast_reasons == []
    assert fast.count == slow.count == len(messages)
    assert type(fast.body) is lj.IngestedBody
    assert bytes(fast.body) == slow.body
    assert fast == slow
    records = decode_batch(fast.body, 0)
    assert {r.received_ns for r in records} == {RECEIVED_NS}
    assert records[-1].producer == "9" and records[-1].seq == 4


def test_errors_and_pings_agree_and_store_nothing():
    good = lj.encode_meta(0, 1, 2, 3)
    messages = [
        [b"app", b"logs", b"{}", good],
        [b"app-prod", b"logs x", b"{}", good],
        [b"app-prod", b"logs", b"{}", b"\0" * 24],
        [b"app-prod", b"logs", b"{}", good[:23]],
        [b"app-prod", b"logs", b"x" * 100, good],
        [
            b"app-prod",
            b"logs",
            lj.compress(1, b"[" + b"0," * 100 + b"0]"),
            lj.encode_meta(1, 0, 0, 0),
        ],
        [b"app-prod", b"logs", b"xx", lj.encode_meta(1, 0, 0, 0)],
        [lj.PING, b"app-prod", b"", good],
        [b"app-prod", b"logs", b"[1]", good],  # the one good message
        [b"app2-prod", b"logs.app2", b"{}", good],  # digits: refused by the seed grammar only
    ]
    slow, fast, slow_reasons, fast_reasons = both(
        messages, grammar="seed", max_body=64, max_decompressed=64
    )
    assert fast_reasons == slow_reasons
    assert slow_reasons == [
        "bad_app_env",
        "bad_topic",
        "bad_meta_tag",
        "bad_meta_size",
        "body_too_large",
        "decompressed_too_large",
        "bad_body",
        "bad_app_env",
    ]
    assert fast == slow and fast.count == 1
    device_slow, device_fast, _, _ = both(messages[-2:])
    assert device_fast == device_slow and device_fast.count == 2

    parser = lj.IngestParser(max_body=MAX, max_decompressed=MAX)
    parser.start_batch(1)
    ping = parser.push(lj.PING, b"app-prod", b"", good)
    assert isinstance(ping, lj.PingMessage) and ping.app_env == "app-prod"
    assert parser.pending() == 0


def test_fields_over_the_record_bound_take_the_builder_path_and_its_error():
    long_env = b"a-" + b"b" * 70_000
    messages = [
        [long_env, b"logs", b"{}", lj.encode_meta(0, 0, 0, 1)],
        [long_env, b"logs", b"x" * 100, lj.encode_meta(0, 0, 0, 1)],  # the body is checked first
        [b"app-prod", b"logs", b"{}", lj.encode_meta(0, 0, 0, 2)],
    ]
    slow, fast, slow_reasons, fast_reasons = both(messages, max_body=64, max_decompressed=MAX)
    assert slow_reasons == fast_reasons == ["field_too_long", "body_too_large"]
    assert fast == slow and fast.count == 1


def test_batches_restart_cleanly():
    parser = lj.IngestParser(max_body=MAX, max_decompressed=MAX)
    frames = [b"app-prod", b"logs", b"{}", lj.encode_meta(0, 0, 5, 1)]
    parser.start_batch(10)
    parser.push(*frames)
    first = parser.take_batch()
    assert parser.pending() == 0
    assert parser.take_batch() == EncodedBatch(0, b"")
    parser.start_batch(20)
    parser.push(*frames)
    parser.push(*frames)
    second = parser.take_batch()
    assert [r.received_ns for r in decode_batch(first.body, 0)] == [10]
    assert [r.received_ns for r in decode_batch(second.body, 0)] == [20, 20]


_APP_ENVS = [b"app-prod", b"a_b-c", b"x", b"app2-prod", lj.PING, b"", b"my app-", b"\xc3\xa4-x"]
_TOPICS = [
    b"logs",
    b"logs.a.b",
    b"events",
    b"frontend.ajax",
    b"metrics",
    b"logs x",
    b"",
    b"logs\xff",
]


@settings(max_examples=fuzz_examples(300, 100_000), database=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_APP_ENVS),
            st.sampled_from(_TOPICS),
            st.one_of(
                st.binary(max_size=40),
                st.builds(
                    orjson.dumps,
                    st.dictionaries(st.text(max_size=5), st.integers(-(1 << 63), (1 << 63) - 1)),
                ),
            ),
            st.sampled_from([0, 1, 2, 3]),
            st.integers(0, 0xFFFF),
            st.integers(0, (1 << 64) - 1),
            st.integers(0, (1 << 64) - 1),
            st.sampled_from([22, 24]),
            st.booleans(),
        ),
        max_size=12,
    ),
    st.sampled_from(lj.GRAMMARS),
)
def test_fuzz_push_equals_the_builder_path(messages, grammar):
    frame_lists = []
    for app_env, topic, body, method, device, created, seq, size, raw_body in messages:
        meta = lj.encode_meta(method, device, created, seq, size=size)
        wire_body = body if raw_body else lj.compress(method, body)
        frame_lists.append([app_env, topic, wire_body, meta])
    slow, fast, slow_reasons, fast_reasons = both(
        frame_lists, grammar=grammar, max_body=200, max_decompressed=200
    )
    assert fast_reasons == slow_reasons
    assert fast == slow


@pytest.mark.parametrize("size", [22, 24])
def test_every_meta_cut_is_refused_the_same_way(size):
    full = lj.encode_meta(0, 1, 2, 3, size=size)
    cuts = [[b"app-prod", b"logs", b"{}", full[:cut]] for cut in range(len(full) + 1)]
    slow, fast, slow_reasons, fast_reasons = both(cuts)
    assert fast_reasons == slow_reasons
    assert fast == slow and fast.count == (2 if size == 24 else 1)


def test_bodies_that_are_not_json_are_stored_raw_and_counted():
    """logjam-device forwards any body: a non-JSON one is stored as it came, content type
    "raw", beside JSON ones of the same app-env and topic, byte-identical on both paths."""
    meta = lj.encode_meta(0, 3, 1_700_000_000_000, 1)
    messages = [
        [b"app-prod", b"logs", b"{}", meta],
        [b"app-prod", b"logs", b"not json", meta],
        [b"app-prod", b"logs", lj.compress(1, b"zlib text"), lj.encode_meta(1, 3, 0, 2)],
        [b"app-prod", b"logs", b"[1]", meta],
        [b"app-prod", b"logs", b"", meta],
    ]
    slow, fast, slow_reasons, fast_reasons = both(messages)
    assert slow_reasons == fast_reasons == []
    assert fast == slow
    records = decode_batch(fast.body, 0)
    assert [(r.payload, r.content_type) for r in records] == [
        (b"{}", "json"),
        (b"not json", "raw"),
        (b"zlib text", "raw"),
        (b"[1]", "json"),
        (b"", "raw"),
    ]
    assert {(r.stream, r.topic, r.producer) for r in records} == {("app-prod", "logs", "3")}
    parser = lj.IngestParser(max_body=MAX, max_decompressed=MAX)
    parser.start_batch(1)
    for frames in messages:
        parser.push(*frames)
    assert parser.not_json == 3


def test_the_burst_budget_counts_decompressed_bytes():
    """push answers BURST_FULL once the batch's payloads reach the budget given to start_batch
    (the message that reaches it is stored); small compressed bodies count as inflated."""
    parser = lj.IngestParser(max_body=MAX, max_decompressed=MAX)
    body = b"[" + b" " * 998 + b"]"  # 1000 bytes, compresses to a few
    frames = [b"app-prod", b"logs", lj.compress(1, body), lj.encode_meta(1, 0, 0, 1)]
    assert len(frames[2]) < 50
    parser.start_batch(1, max_bytes=3500)
    answers = [parser.push(*frames) for _ in range(4)]
    assert answers == [None, None, None, lj.BURST_FULL]
    assert parser.pending() == 4
    parser.start_batch(2, max_bytes=1000)  # a new batch gets a new budget
    assert parser.push(*frames) is lj.BURST_FULL
    parser.start_batch(3)  # no budget given: never full
    assert all(parser.push(*frames) is None for _ in range(100))
