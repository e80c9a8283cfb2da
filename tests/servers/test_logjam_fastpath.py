"""The logjam server's fast paths over real ZeroMQ, on both taproom.zmqburst paths: every frame
count on both ingest loops, and the PUB output's numbering of ingested batches when nobody
subscribes."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
import zmq

from taproom.clients.logjam import LogjamAgent, LogjamConsumer
from taproom.protocols import logjam as lj
from taproom.records import BatchBuilder
from tests.servers.test_logjam import (
    QUIET,
    rejected,
    sample,
    url,
    wait_committed,
    wait_published,
    wait_subscriptions,
)

# Every test on taproom.zmqburst's compiled path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("zmq_path")


async def test_every_frame_count_on_both_loops(tmp_path):
    """Messages of 1..7 frames, good ones between them: the four-frame ones are stored, and on
    the PULL the three-frame one too (an old agent's message without meta, as logjam-device
    takes it); the others are counted as bad_frame_count and never shift the framing of the
    next."""
    async with running(tmp_path) as app:

        def work():
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(url(app, "logjam_pull"))
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(url(app, "logjam_router"))
            replies = []
            stored = 0
            for n in range(1, 8):
                meta = lj.encode_meta(0, 0, 1, n)
                frames = [b"app-prod", b"logs", b"[%d]" % n, meta, b"x", b"y", b"z"][:n]
                push.send_multipart(frames)
                push.send_multipart([b"app-prod", b"logs", b"{}", meta])
                dealer.send_multipart([b"", *frames])
                assert dealer.poll(5000)
                replies.append(dealer.recv_multipart()[-1])
                stored += 1 + (n == 4) * 2 + (n == 3)
            # ROUTER shapes off the unrolled path: no delimiter (no reply), a lone delimiter
            meta = lj.encode_meta(0, 0, 1, 99)
            dealer.send_multipart([b"app-prod", b"logs", b"[99]", meta])  # stored, no reply
            dealer.send_multipart([b"app-prod", b"logs", b"[98]"])  # refused, no reply
            dealer.send_multipart([b""])  # asks for a reply, has no message: 400
            assert dealer.poll(5000)
            replies.append(dealer.recv_multipart()[-1])
            stored += 1
            wait_committed(app, stored)
            push.close(linger=1000)
            dealer.close(linger=0)
            ctx.term()
            return stored, replies

        stored, replies = await asyncio.to_thread(work)
        assert replies == [b"400 Bad Request"] * 3 + [b"202 Accepted"] + [b"400 Bad Request"] * 4
        records = list(app.hub.journal.read(0))
        assert len(records) == stored == 11
        assert sorted(r.payload for r in records) == [b"[3]", b"[4]", b"[4]", b"[99]"] + [b"{}"] * 7
        (legacy,) = [r for r in records if r.payload == b"[3]"]
        assert (legacy.producer, legacy.seq, legacy.ts_ns) == ("0", 0, 0)  # META_INFO_EMPTY
        assert rejected(app, "bad_frame_count") == 13


def running(tmp_path, **extra):
    from tests.support import running_app

    return running_app(tmp_path, enable=["logjam"], logjam=dict(QUIET, **extra))


async def test_numbering_goes_on_while_nobody_subscribes(tmp_path):
    """With no subscriber, ingested batches are numbered and indexed but not handed to libzmq:
    a consumer that subscribes later sees the numbers continue, and can replay the ones
    nobody received by sequence number."""
    async with running(tmp_path) as app:
        service = app.services["logjam"]

        def work():
            with LogjamAgent(url(app, "logjam_pull"), mode="push", topic="logs") as agent:
                for i in range(50):
                    agent.send({"i": i}, app_env="early-prod")
            wait_committed(app, 50)
            wait_published(app)
            assert service.pub.published == 50
            consumer = LogjamConsumer(
                url(app, "logjam_pub"), [""], replay_endpoint=url(app, "logjam_replay")
            )
            wait_subscriptions(app, 1)
            with LogjamAgent(url(app, "logjam_router"), topic="logs") as agent:
                for i in range(50, 60):
                    agent.send({"i": i}, app_env="late-prod")
            wait_published(app)
            live = [consumer.recv(5) for _ in range(10)]
            early = consumer.replay_seq(1, 50)
            consumer.close()
            return live, early

        live, early = await asyncio.to_thread(work)
        assert [m.meta.sequence for m in live] == list(range(51, 61))
        assert [m.json()["i"] for m in live] == list(range(50, 60))
        assert [(m.meta.sequence, m.json()["i"]) for m in early] == [(i + 1, i) for i in range(50)]
        assert sample(app, "taproom_logjam_published_messages_total", kind="data") == 60


async def test_index_ring_wraps_for_runs_numbered_without_subscribers(tmp_path):
    """The replay index is a ring: runs numbered in one go (no subscriber) wrap around it like
    messages numbered one by one, and only the newest ``replay_index_size`` stay."""
    async with running(tmp_path, replay_index_size=16) as app:
        service = app.services["logjam"]

        def work():
            with LogjamAgent(url(app, "logjam_pull"), mode="push", topic="logs") as agent:
                for i in range(37):
                    agent.send({"i": i}, app_env="ring-prod")
                    if i % 10 == 9:  # several batches, so runs start at several ring places
                        wait_committed(app, i + 1)
            wait_committed(app, 37)
            wait_published(app)

        await asyncio.to_thread(work)
        assert service.pub.published == 37
        # message k (numbered from 1) sits at k % 16 with its journal offset k - 1
        assert service.pub.seq_offsets(22, 37) == {k - 1: k for k in range(22, 38)}
        assert service.pub.seq_offsets(21, 37) is None  # number 21 has left the ring
        service.pub._index_run(1, 100, 40)  # a run longer than the ring keeps its newest 16
        assert [service.pub._index[k % 16] for k in range(25, 41)] == list(range(124, 140))


def test_ingested_batches_are_marked():
    parser = lj.IngestParser(max_body=1024, max_decompressed=1024)
    parser.start_batch(time.time_ns())
    parser.push(b"app-prod", b"logs", b"{}", lj.encode_meta(0, 0, 0, 1))
    assert type(parser.take_batch().body) is lj.IngestedBody


async def test_numbers_wrap_alike_on_mixed_plain_and_ingested_batches(tmp_path):
    """Plain batches (any protocol: the checked path) and ingested ones (the logjam-only path)
    share one numbering, wrapping at ``sequence_wrap`` on both, and seq replay finds them."""
    async with running(tmp_path, sequence_wrap=4, device_number=9) as app:
        consumer = LogjamConsumer(
            url(app, "logjam_pub"), [""], timeout=5, replay_endpoint=url(app, "logjam_replay")
        )
        await asyncio.to_thread(wait_subscriptions, app, 1)
        builder = BatchBuilder()
        for i, protocol in enumerate(["logjam", "lumberjack", "logjam", "logjam", "eventbus"]):
            builder.add(
                protocol, b'{"i":%d}' % i, stream="mix-prod", topic="logs", content_type="json"
            )
        await app.hub.ingest(builder.build())
        parser = lj.IngestParser(max_body=1024, max_decompressed=1024)
        parser.start_batch(time.time_ns())
        for i in range(5, 11):
            parser.push(b"mix-prod", b"logs", b'{"i":%d}' % i, lj.encode_meta(0, 0, 0, i))
        await app.hub.ingest(parser.take_batch())

        def work():
            msgs = [consumer.recv(5) for _ in range(11)]
            replayed = consumer.replay_seq(1, 4)
            return msgs, replayed

        msgs, replayed = await asyncio.to_thread(work)
        consumer.close()
        assert [m.meta.sequence for m in msgs] == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
        assert all(m.meta.device == 9 for m in msgs)
        order = [m.json()["i"] if m.topic == "logs" else m.json()["payload"]["i"] for m in msgs]
        assert order == list(range(11))
        # "seq 1..4" is the latest round of numbers: 1, 2, 3 are offsets 8, 9, 10; its 4 is
        # not handed out yet
        assert [(m.meta.sequence, m.offset) for m in replayed] == [(1, 8), (2, 9), (3, 10)]


async def test_other_protocols_are_numbered_unmapped_while_nobody_subscribes(tmp_path):
    """Batches of other protocols' records (and mixed ones) are numbered and indexed without
    being mapped while nobody subscribes (issue 32: a LogTK entry's commit spent a third of
    its Python mapping it for no one): the numbers continue when a consumer comes, in journal
    order, and the replay maps the early ones as the live path would have."""
    async with running(tmp_path, routes=["logjam", "logtk"]) as app:
        service = app.services["logjam"]

        def build(items):
            builder = BatchBuilder()
            for protocol, i in items:
                stream = "early-prod" if protocol == "logjam" else "app"
                builder.add(
                    protocol, b'{"i": %d}' % i, stream=stream, topic="logs", content_type="json"
                )
            return builder.build()

        # logtk alone; lumberjack (not routed) alone; logtk, logjam and lumberjack mixed
        batches = [
            build([("logtk", 0), ("logtk", 1)]),
            build([("lumberjack", 90)]),
            build([("logtk", 2), ("logjam", 3), ("lumberjack", 91), ("logtk", 4)]),
        ]
        for batch in batches:
            await app.hub.ingest(batch)

        def work():
            wait_published(app)
            assert service.pub.published == 5
            consumer = LogjamConsumer(
                url(app, "logjam_pub"), [""], replay_endpoint=url(app, "logjam_replay")
            )
            wait_subscriptions(app, 1)
            return consumer

        consumer = await asyncio.to_thread(work)
        await app.hub.ingest(build([("logtk", 5)]))

        def read():
            live = consumer.recv(5)
            early = consumer.replay_seq(1, 5)
            consumer.close()
            return live, early

        def value(message):  # another protocol's record comes wrapped (OutputMapper.body)
            body = message.json()
            return body["i"] if "i" in body else body["payload"]["i"]

        live, early = await asyncio.to_thread(read)
        assert (live.meta.sequence, value(live)) == (6, 5)
        assert [(m.meta.sequence, value(m)) for m in early] == [
            (1, 0), (2, 1), (3, 2), (4, 3), (5, 4)
        ]  # fmt: skip
        assert service.pub.seq_offsets(1, 5) == {0: 1, 1: 2, 3: 3, 4: 4, 6: 5}  # offset: number
        assert sample(app, "taproom_logjam_published_messages_total", kind="data") == 6


class _Captured:
    """What PubOutput needs of its publisher: bursts kept for comparison."""

    has_subscribers = True

    def __init__(self) -> None:
        self.bursts = []

    def publish(self, burst):
        self.bursts.append(burst)

    def send(self, messages):
        from taproom.protocols.zmtp.pubsub import Burst

        self.publish(Burst.encode(messages))

    def prefixes(self):
        return 1


def test_both_paths_build_the_wire_of_the_frames_the_records_map_to(zmq_path):
    """lj_pubwire (compiled) and the Python loops build the same ZMTP bytes: each record's
    app-env, topic, body and a meta numbered in journal order, other protocols' records
    mapped in their place; on plain batches (protocols checked) and ingested ones."""
    from taproom.config import load_config
    from taproom.hub import CommittedBatch
    from taproom.metrics import Metrics
    from taproom.payloads import decode_payload
    from taproom.protocols.zmtp.pubsub import Burst
    from taproom.servers.logjam.pub import PubOutput, _CompiledWire

    class FakeHub:
        metrics = Metrics()

    config = load_config(text="[logjam]\ndevice_number = 7\n").section("logjam")
    mapper = lj.OutputMapper(
        routes=config.routes,
        default_app_env=config.default_app_env,
        event_protocols=config.event_protocols,
        payload_decoder=decode_payload,
    )
    output = PubOutput(FakeHub(), config, b"hub", mapper)
    output._pub = _Captured()
    output._compiled = _CompiledWire.create(config)
    assert (output._compiled is not None) == (zmq_path == "ext")
    builder = BatchBuilder()
    for i, protocol in enumerate(["logjam"] * 3 + ["logtk", "logjam", "lumberjack", "logjam"]):
        body = b'{"i":%d,"pad":"%s"}' % (i, b"x" * (i * 90))
        builder.add(protocol, body, stream="mix-prod", topic="logs.x", ts_ns=(i + 1) * 10**15)
    plain = builder.build()
    parser = lj.IngestParser(max_body=1 << 16, max_decompressed=1 << 16)
    parser.start_batch(time.time_ns())
    for i in range(5):
        parser.push(b"in-prod", b"logs", b"[%d]" % i * (i * 70), lj.encode_meta(0, 0, 5, i))
    ingested = parser.take_batch()
    output._publish_batch(CommittedBatch(0, plain.count, plain.body))
    output._publish_batch(CommittedBatch(plain.count, ingested.count, ingested.body))
    wire = b"".join(bytes(burst.wire) for burst in output._pub.bursts)
    expected = []
    for k, record in enumerate(
        [
            *CommittedBatch(0, plain.count, plain.body).records(),
            *CommittedBatch(plain.count, ingested.count, ingested.body).records(),
        ],
        start=1,
    ):
        app_env, topic, body, created = mapper.map(record, 0)
        meta = struct.pack("!HBBIQQ", lj.META_TAG, 0, lj.META_VERSION, 7, created, k)
        expected.append([app_env, topic, body, meta])
    assert wire == Burst.encode(expected).wire
    assert output.published == len(expected) == 12
