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


def both(messages, *, relaxed=False, max_body=MAX, max_decompressed=MAX, received_ns=RECEIVED_NS):
    """Feed ``messages`` (lists of frames) to a fresh parser through both paths.

    Returns the two batches and the reasons of the messages each path refused, in order."""
    slow_parser = lj.IngestParser(
        max_body=max_body, max_decompressed=max_decompressed, relaxed=relaxed
    )
    fast_parser = lj.IngestParser(
        max_body=max_body, max_decompressed=max_decompressed, relaxed=relaxed
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
        [b"app-prod", b"metrics", b"{}", good],
        [b"app-prod", b"logs", b"{oops", good],
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
        [b"app2-prod", b"logs", b"{}", good],  # digits: refused by the seed grammar only
    ]
    slow, fast, slow_reasons, fast_reasons = both(messages, max_body=64, max_decompressed=64)
    assert fast_reasons == slow_reasons
    assert slow_reasons == [
        "bad_app_env",
        "bad_topic",
        "bad_json",
        "bad_meta_tag",
        "bad_meta_size",
        "body_too_large",
        "decompressed_too_large",
        "bad_body",
        "bad_app_env",
    ]
    assert fast == slow and fast.count == 1
    relaxed_slow, relaxed_fast, _, _ = both(messages[-2:], relaxed=True)
    assert relaxed_fast == relaxed_slow and relaxed_fast.count == 2

    parser = lj.IngestParser(max_body=MAX, max_decompressed=MAX)
    parser.start_batch(1)
    ping = parser.push(lj.PING, b"app-prod", b"", good)
    assert isinstance(ping, lj.PingMessage) and ping.app_env == "app-prod"
    assert parser.pending() == 0


def test_fields_over_the_record_bound_take_the_builder_path_and_its_error():
    long_env = b"a-" + b"b" * 70_000
    messages = [
        [long_env, b"logs", b"{}", lj.encode_meta(0, 0, 0, 1)],
        [long_env, b"logs", b"{bad", lj.encode_meta(0, 0, 0, 1)],  # JSON is checked first
        [b"app-prod", b"logs", b"{}", lj.encode_meta(0, 0, 0, 2)],
    ]
    slow, fast, slow_reasons, fast_reasons = both(messages, max_body=MAX, max_decompressed=MAX)
    assert slow_reasons == fast_reasons == ["field_too_long", "bad_json"]
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


_APP_ENVS = [b"app-prod", b"shop-production", b"a_b-c", b"x", b"app2-prod", lj.PING, b""]
_TOPICS = [b"logs", b"logs.a.b", b"events", b"frontend.ajax", b"metrics", b"logs-x", b""]


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
    st.booleans(),
)
def test_fuzz_push_equals_the_builder_path(messages, relaxed):
    frame_lists = []
    for app_env, topic, body, method, device, created, seq, size, raw_body in messages:
        meta = lj.encode_meta(method, device, created, seq, size=size)
        wire_body = body if raw_body else lj.compress(method, body)
        frame_lists.append([app_env, topic, wire_body, meta])
    slow, fast, slow_reasons, fast_reasons = both(
        frame_lists, relaxed=relaxed, max_body=200, max_decompressed=200
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
