"""servers/logjam/ over real ZeroMQ sockets: ingest, acks after commit, PUB output, replay."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import orjson
import pytest
import zmq

from taproom.clients.logjam import LogjamAgent, LogjamConsumer
from taproom.config import load_config
from taproom.errors import ConfigError
from taproom.protocols import logjam as lj
from taproom.protocols.lumberjack import ClientSession
from taproom.records import BatchBuilder
from tests.support import HubProcess, lone_commit_probe, running_app, write_config

# Every test on taproom.zmqburst's compiled path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("zmq_path")


def url(app, name):
    return "tcp://" + app.addresses[name]


def sample(app, name, **labels):
    return app.hub.metrics.registry.get_sample_value(name, labels) or 0


def pub_dropped(app, *reasons):
    """Messages subscribers of the PUB output missed (taproom_output_dropped), by reason."""
    reasons = reasons or ("hwm", "subscriber_bytes", "output_budget", "disconnected")
    return sum(
        sample(app, "taproom_output_dropped_messages_total", output="logjam_pub", reason=r)
        for r in reasons
    )


def pub_accounted(app):
    """Every message offered to a subscriber is delivered, dropped (counted) or queued."""
    sent = sample(app, "taproom_output_sent_messages_total", output="logjam_pub")
    delivered = sample(app, "taproom_output_delivered_messages_total", output="logjam_pub")
    queued = sample(app, "taproom_output_queued_messages", output="logjam_pub")
    return sent == delivered + pub_dropped(app) + queued


def rejected(app, reason):
    return sample(app, "taproom_ingest_rejected_items_total", protocol="logjam", reason=reason)


def wait_subscriptions(app, n, timeout=5.0):
    service = app.services["logjam"]
    deadline = time.monotonic() + timeout
    while service.subscriber_count() < n:
        assert time.monotonic() < deadline, "subscriptions never reached the XPUB"
        time.sleep(0.01)


def subscribe_all(app):
    """A plain SUB socket on the PUB output, subscribed to everything, once the XPUB has it."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(url(app, "logjam_pub"))
    wait_subscriptions(app, 1)
    return sub


def wait_published(app, timeout=10.0):
    """Until the PUB output has handled everything committed so far."""
    service = app.services["logjam"]
    deadline = time.monotonic() + timeout
    while service.pub.subscription.next_offset < app.hub.journal.end_offset:
        assert time.monotonic() < deadline, "PUB output did not catch up"
        time.sleep(0.01)


def wait_committed(app, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while app.hub.journal.end_offset < n:
        assert time.monotonic() < deadline, f"only {app.hub.journal.end_offset} of {n} committed"
        time.sleep(0.01)


QUIET = {"heartbeat_interval_s": 3600.0, "hostname": "hub.example"}


class TestIngest:
    async def test_created_ms_the_journal_cannot_hold_is_absent_and_counted(self, tmp_path):
        """Issue 25 part 4, on both ingest paths (the compiled lj_build counts its own): a
        created-ms of 2^62 or 2^64-1 is stored without a time and counted, never refused."""
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:
            created = [1_700_000_000_000, 1 << 62, (1 << 64) - 1, 0]

            def work():
                push = zmq.Context.instance().socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 1000)
                push.connect(url(app, "logjam_pull"))
                for i, ms in enumerate(created):
                    push.send_multipart(
                        lj.encode_message(
                            b"app-production",
                            b"logs.t",
                            b"{}",
                            compression=0,
                            device=1,
                            created_ms=ms,
                            sequence=i + 1,
                        )
                    )
                push.close()

            await asyncio.to_thread(work)
            await asyncio.to_thread(wait_committed, app, 4)
            ts = [r.ts_ns for r in app.hub.journal.read(0)]
            assert ts == [1_700_000_000_000 * 1_000_000, 0, 0, 0]
            odd = sample(
                app,
                "taproom_ingest_odd_events_total",
                protocol="logjam",
                reason="time_out_of_range",
            )
            assert odd == 2  # created-ms 0 is the device's "unknown": absent, not odd

    async def test_dealer_reply_comes_after_the_commit(self, tmp_path):
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:

            def work():
                seen = []
                with LogjamAgent(
                    url(app, "logjam_router"), app_env="shop-prod", topic="logs.shop.prod"
                ) as agent:
                    for i, method in enumerate(lj.Compression):
                        agent.compression = method
                        frames = agent.frames({"i": i}, created_ms=1_000 + i)
                        agent.send_frames(frames, wait=False)
                        reply = agent.recv_reply()
                        # durable before the 202: the journal already holds it
                        seen.append((reply, app.hub.journal.end_offset))
                return seen

            seen = await asyncio.to_thread(work)
            assert seen == [([b"shop-prod", b"202 Accepted"], i + 1) for i in range(4)]
            records = list(app.hub.journal.read(0))
            assert [r.payload for r in records] == [b'{"i":%d}' % i for i in range(4)]
            r = records[2]
            assert (r.protocol, r.stream, r.topic, r.producer, r.content_type) == (
                "logjam",
                "shop-prod",
                "logs.shop.prod",
                "0",
                "json",
            )
            assert (r.seq, r.ts_ns) == (3, 1_002 * 1_000_000)
            assert sample(app, "taproom_ingest_accepted_events_total", protocol="logjam") == 4

    async def test_a_lone_requests_202_leaves_in_the_turn_that_read_it(self, tmp_path):
        """Issue 32: one request in flight is read, committed and answered in the read
        callback of its connection (the router task parked, ``wait_readable(direct=)``; then
        Hub.commit_now), not by a task woken a turn later nor by a commit scheduled a turn
        after that. A timer of the hub's other loops due in the same turn leaves that
        request's commit to the next turn, as before (it may batch): most, not all, must be
        answered in place; each 202 still after its commit (the journal holds it).
        (Inline commits stay on whatever a loaded machine's fsync averages.)"""
        hub_settings = {"inline_commit_max_ms": 1000}
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET, hub=hub_settings) as app:
            hub = app.hub

            def work():
                with LogjamAgent(
                    url(app, "logjam_router"), app_env="shop-prod", topic="logs.shop.prod"
                ) as agent:
                    return [agent.send({"i": i}) for i in range(20)]

            with lone_commit_probe(hub, "202") as (in_place, in_callback):
                assert await asyncio.to_thread(work) == [b"202 Accepted"] * 20
            assert len(in_place) == 20 and in_place.count(True) >= 15, in_place
            assert in_callback.count(True) >= 15, in_callback
            assert [r.payload for r in hub.journal.read(0)] == [b'{"i":%d}' % i for i in range(20)]

    async def test_push_and_async_dealer_store_without_replies(self, tmp_path):
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:

            def work():
                with (
                    LogjamAgent(url(app, "logjam_pull"), mode="push", app_env="a-b") as push,
                    LogjamAgent(url(app, "logjam_router"), reply=False, app_env="a-c") as dealer,
                ):
                    for i in range(50):
                        assert push.send({"p": i}, topic="logs.p") is None
                        assert dealer.send({"d": i}, topic="logs.d") is None
                    wait_committed(app, 100)
                    assert not dealer.socket.poll(200)  # nothing comes back without the ""

            await asyncio.to_thread(work)
            records = list(app.hub.journal.read(0))
            assert sorted(r.seq for r in records if r.stream == "a-b") == list(range(1, 51))
            assert sorted(r.seq for r in records if r.stream == "a-c") == list(range(1, 51))

    async def test_ping(self, tmp_path):
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:

            def work():
                with LogjamAgent(url(app, "logjam_router"), app_env="app-prod") as agent:
                    return agent.ping()

            assert await asyncio.to_thread(work) == [b"ping", b"200 OK", b"hub.example"]
            assert app.hub.journal.end_offset == 0
            assert sample(app, "taproom_logjam_pings_messages_total") == 1


class TestPubOutput:
    async def test_three_prefix_subscribers_get_every_matching_event_in_order(self, tmp_path):
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:

            def work():
                consumers = {
                    p: LogjamConsumer(url(app, "logjam_pub"), [p], timeout=5)
                    for p in ("", "alpha-", "beta-")
                }
                # "", "alpha-", "beta-" and "heartbeat"
                wait_subscriptions(app, 4)
                sync = LogjamAgent(url(app, "logjam_router"), compression="zlib")
                fire = LogjamAgent(url(app, "logjam_router"), reply=False, compression="snappy")
                push = LogjamAgent(url(app, "logjam_pull"), mode="push", compression="lz4")
                n = 0
                for i in range(200):
                    for app_env in ("alpha-prod", "beta-prod", "gamma-prod", "alpha-staging"):
                        agent = (sync, fire, push)[i % 3]
                        status = agent.send({"i": i, "a": app_env}, app_env=app_env, topic="logs")
                        assert status in (None, b"202 Accepted")
                        n += 1
                wait_committed(app, n)
                wait_published(app)
                for agent in (sync, fire, push):
                    agent.close()
                journal = list(app.hub.journal.read(0))
                got = {}
                for prefix, consumer in consumers.items():
                    expected = [r for r in journal if r.stream.startswith(prefix)]
                    msgs = []
                    while len(msgs) < len(expected):
                        msg = consumer.recv(5)
                        assert msg is not None, f"{prefix!r}: {len(msgs)} of {len(expected)}"
                        msgs.append(msg)
                    assert consumer.recv(0.2) is None
                    got[prefix] = (expected, msgs, consumer.gaps, consumer.duplicates)
                    consumer.close()
                return got

            got = await asyncio.to_thread(work)
            for prefix, (expected, msgs, _gaps, dups) in got.items():
                assert [(m.app_env, m.body) for m in msgs] == [
                    (r.stream, r.payload) for r in expected
                ], prefix
                seqs = [m.meta.sequence for m in msgs]
                assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
                assert all(m.meta.device == 1 for m in msgs)
                assert dups == 0
            everything = got[""]
            assert [m.meta.sequence for m in everything[1]] == list(range(1, 801))
            assert everything[2] == 0  # no gaps for the subscriber that sees everything
            assert len(got["alpha-"][1]) == 400  # alpha-prod and alpha-staging
            assert pub_dropped(app, "hwm", "subscriber_bytes", "output_budget") == 0
            assert pub_accounted(app)

    async def test_slow_subscriber_drops_are_counted_fast_one_loses_nothing(self, tmp_path):
        # the fast subscriber gets 300 messages: below its HWM of 1000 it cannot lose any, while
        # the slow one (24 MB, never read) must overflow its queue and the TCP buffers
        cfg = dict(QUIET, snd_hwm=1000)
        async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:

            def work():
                ctx = zmq.Context.instance()
                slow = ctx.socket(zmq.SUB)
                slow.setsockopt(zmq.RCVHWM, 10)
                slow.setsockopt(zmq.RCVBUF, 4096)
                slow.setsockopt(zmq.SUBSCRIBE, b"slow-")
                slow.connect(url(app, "logjam_pub"))
                fast = LogjamConsumer(url(app, "logjam_pub"), ["fast-"], timeout=5)
                wait_subscriptions(app, 3)  # slow-, fast-, heartbeat
                pad = "x" * 8000
                fast_msgs = []
                # the fast consumer reads while the burst goes out, as a live consumer does
                reader = threading.Thread(target=lambda: fast_msgs.extend(fast.messages(2.0)))
                reader.start()
                with LogjamAgent(url(app, "logjam_pull"), mode="push") as push:
                    for i in range(3000):
                        push.send({"i": i, "pad": pad}, app_env="slow-prod", topic="logs")
                        if i % 10 == 0:
                            push.send({"i": i}, app_env="fast-prod", topic="logs")
                    wait_committed(app, 3300)
                wait_published(app)
                reader.join(30)
                slow_msgs = []
                while slow.poll(500):
                    slow_msgs.append(slow.recv_multipart())
                slow.close()
                fast.close()
                return fast_msgs, slow_msgs

            fast_msgs, slow_msgs = await asyncio.to_thread(work)
            # the slow subscriber was found full: what it missed is counted, to the message
            assert pub_dropped(app, "hwm", "subscriber_bytes") > 0
            assert pub_accounted(app)
            assert [orjson.loads(m.body)["i"] for m in fast_msgs] == list(range(0, 3000, 10))
            assert len(slow_msgs) < 3000
            # a message a full subscriber missed still went out to everyone else
            assert sample(app, "taproom_logjam_published_messages_total", kind="data") == 3300
            # the slow consumer's sequence numbers show its gaps
            seqs = [lj.parse_meta(f[3]).sequence for f in slow_msgs]
            assert seqs == sorted(seqs) and seqs[-1] - seqs[0] + 1 > len(seqs)

    async def test_slow_subscriber_on_the_same_prefix_costs_the_fast_one_nothing(self, tmp_path):
        cfg = dict(QUIET, snd_hwm=1000)
        async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:

            def work():
                fast = LogjamConsumer(url(app, "logjam_pub"), ["shared-"], timeout=5)
                wait_subscriptions(app, 2)  # shared- and the heartbeat
                slow = zmq.Context.instance().socket(zmq.SUB)
                slow.setsockopt(zmq.RCVHWM, 10)
                slow.setsockopt(zmq.RCVBUF, 4096)
                slow.setsockopt(zmq.SUBSCRIBE, b"shared-")  # the same prefix as the fast one
                slow.connect(url(app, "logjam_pub"))
                # a repeated prefix is no new prefix: wait for the second subscriber itself
                publisher = app.services["logjam"].pub._pub
                deadline = time.monotonic() + 10
                while publisher.subscribed() < 2:
                    assert time.monotonic() < deadline, "the slow subscriber never subscribed"
                    time.sleep(0.01)
                fast_msgs = []
                with LogjamAgent(url(app, "logjam_pull"), mode="push") as push:
                    # Paced: the fast consumer reads each chunk before the next is sent, so it is
                    # never behind; the slow one reads nothing and must overflow.
                    for chunk in range(30):
                        for i in range(chunk * 100, chunk * 100 + 100):
                            push.send(
                                {"i": i, "pad": "x" * 8000}, app_env="shared-prod", topic="logs"
                            )
                        while len(fast_msgs) < chunk * 100 + 100:
                            msg = fast.recv(10)
                            assert msg is not None, f"fast consumer starved at {len(fast_msgs)}"
                            fast_msgs.append(msg)
                    slow_msgs = []
                    while slow.poll(500):
                        slow_msgs.append(slow.recv_multipart())
                    # drained, the slow subscriber gets new messages again, and sees its gap
                    push.send({"i": 3000}, app_env="shared-prod", topic="logs")
                    assert slow.poll(5000)
                    slow_msgs.append(slow.recv_multipart())
                    fast_msgs.append(fast.recv(10))
                slow.close()
                fast.close()
                return fast_msgs, slow_msgs

            fast_msgs, slow_msgs = await asyncio.to_thread(work)
            assert pub_dropped(app, "hwm", "subscriber_bytes") > 0
            assert pub_accounted(app)
            assert [orjson.loads(m.body)["i"] for m in fast_msgs] == list(range(3001))
            assert 0 < len(slow_msgs) < 3001
            seqs = [lj.parse_meta(f[3]).sequence for f in slow_msgs]
            assert seqs == sorted(seqs) and seqs[-1] - seqs[0] + 1 > len(seqs)  # its gap shows

    async def test_sequence_wraps_at_the_configured_point(self, tmp_path):
        cfg = dict(QUIET, sequence_wrap=5, device_number=77)
        async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:

            def work():
                consumer = LogjamConsumer(url(app, "logjam_pub"), [""], timeout=5)
                wait_subscriptions(app, 1)
                with LogjamAgent(url(app, "logjam_router"), app_env="w-x", topic="logs") as ag:
                    for i in range(12):
                        assert ag.send({"i": i}) == b"202 Accepted"
                msgs = [consumer.recv(5) for _ in range(12)]
                state = consumer.devices[77]
                consumer.close()
                return msgs, state

            msgs, state = await asyncio.to_thread(work)
            assert [m.meta.sequence for m in msgs] == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
            assert [m.json()["i"] for m in msgs] == list(range(12))
            assert (state.restarts, state.gaps, state.duplicates) == (2, 0, 0)

    async def test_heartbeat(self, tmp_path):
        cfg = dict(QUIET, heartbeat_interval_s=0.05)
        async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:

            def work():
                consumer = LogjamConsumer(
                    url(app, "logjam_pub"), ["nothing-"], return_heartbeats=True, timeout=5
                )
                beats = [consumer.recv(5) for _ in range(3)]
                consumer.close()
                return beats

            beats = await asyncio.to_thread(work)
            port = app.addresses["logjam_pub"].rsplit(":", 1)[1]
            for beat in beats:
                assert beat is not None
                assert (beat.app_env, beat.topic) == ("heartbeat", f"tcp://hub.example:{port}")
                assert beat.meta.device == 1 and beat.meta.created_ms > 0
                assert beat.json()["next_offset"] == 0
            seqs = [b.meta.sequence for b in beats]
            assert seqs == list(range(seqs[0], seqs[0] + 3))

    async def test_raw_bodies_go_out_as_they_came_beside_json_ones(self, tmp_path):
        """A body that is not JSON is stored "raw" (a shorter content type in the record): the
        PUB output reads each record's fields where they are and sends the body as it came, and
        replay returns it the same way."""
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:

            def work():
                sub = subscribe_all(app)
                with LogjamAgent(url(app, "logjam_router"), app_env="raw-prod") as agent:
                    for body in (b"plain text", b'{"j":1}', b"<xml/>"):
                        assert agent.send(body, topic="logs.x") == b"202 Accepted"
                got = []
                for _ in range(3):
                    assert sub.poll(5000)
                    got.append(sub.recv_multipart()[:3])
                sub.close()
                return got

            got = await asyncio.to_thread(work)
            assert got == [
                [b"raw-prod", b"logs.x", b"plain text"],
                [b"raw-prod", b"logs.x", b'{"j":1}'],
                [b"raw-prod", b"logs.x", b"<xml/>"],
            ]
            records = list(app.hub.journal.read(0))
            assert [r.content_type for r in records] == ["raw", "json", "raw"]
            service = app.services["logjam"]
            replayed = await asyncio.to_thread(service.replay._replay_read, 0, 3, [], None)
            assert replayed[3::5] == [b"plain text", b'{"j":1}', b"<xml/>"]

    async def test_output_compression_and_seed_meta(self, tmp_path):
        cfg = dict(QUIET, output_compression="lz4", meta_size=22)
        async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:

            def work():
                sub = subscribe_all(app)
                with LogjamAgent(url(app, "logjam_router"), app_env="c-d", topic="logs") as ag:
                    assert ag.send({"big": "y" * 1000}) == b"202 Accepted"
                assert sub.poll(5000)
                frames = sub.recv_multipart()
                sub.close()
                return frames

            frames = await asyncio.to_thread(work)
            assert len(frames) == 4 and len(frames[3]) == 22
            meta = lj.parse_meta(frames[3])
            assert meta.compression == lj.Compression.LZ4 and meta.sequence == 1
            assert len(frames[2]) < 1000
            assert lj.decompress(meta.compression, frames[2], 1 << 20) == orjson.dumps(
                {"big": "y" * 1000}
            )


class TestCrossProtocol:
    async def test_lumberjack_event_reaches_the_logjam_pub(self, tmp_path):
        async with running_app(tmp_path, enable=["logjam", "lumberjack"], logjam=QUIET) as app:
            consumer = LogjamConsumer(url(app, "logjam_pub"), ["taproom-"], timeout=5)
            await asyncio.to_thread(wait_subscriptions, app, 2)
            host, port = app.addresses["lumberjack"].rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            session = ClientSession()
            window = session.encode_window([{"message": "hello from filebeat", "n": 1}])
            writer.write(window.data)
            await writer.drain()
            while session.in_flight:
                data = await asyncio.wait_for(reader.read(64), 5)
                assert data, "lumberjack server closed"
                session.receive_data(data)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            msg = await asyncio.to_thread(consumer.recv, 5)
            consumer.close()
            assert msg is not None
            assert msg.app_env == "taproom-lumberjack"
            assert msg.topic.startswith("logs.lumberjack")
            assert lj.is_valid_topic(msg.topic.encode())
            assert (msg.meta.version, msg.meta.device, msg.meta.size) == (1, 1, 24)
            assert msg.meta.sequence == 1 and msg.meta.created_ms > 1_600_000_000_000
            doc = msg.json()
            assert doc["taproom"]["protocol"] == "lumberjack"
            assert doc["taproom"]["offset"] == 0
            payload = doc["payload"]
            assert "hello from filebeat" in orjson.dumps(payload).decode()

    async def test_routes_and_event_topics(self, tmp_path):
        cfg = dict(QUIET, routes=["logjam", "eventbus"])
        async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:
            consumer = LogjamConsumer(url(app, "logjam_pub"), [""], timeout=5)
            await asyncio.to_thread(wait_subscriptions, app, 1)
            builder = BatchBuilder()
            builder.add("lumberjack", b'{"skip":1}', stream="x", content_type="json")
            builder.add(
                "eventbus", b'{"ok":1}', stream="shop-prod", topic="orders", content_type="json"
            )
            await app.hub.ingest(builder.build())
            msg = await asyncio.to_thread(consumer.recv, 5)
            rest = await asyncio.to_thread(consumer.recv, 0.3)
            consumer.close()
            assert msg is not None and rest is None
            assert (msg.app_env, msg.topic) == ("shop-prod", "events.eventbus.orders")
            assert msg.json()["payload"] == {"ok": 1}
            assert msg.json()["taproom"]["offset"] == 1

    async def test_mixed_batches_go_out_in_journal_order(self, tmp_path):
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:
            consumer = LogjamConsumer(url(app, "logjam_pub"), [""], timeout=5)
            await asyncio.to_thread(wait_subscriptions, app, 1)
            kinds = ["logjam", "lumberjack", "logjam", "eventbus", "eventbus", "logjam", "logtk"]
            for _ in range(2):
                builder = BatchBuilder()
                for i, protocol in enumerate(kinds):
                    builder.add(
                        protocol,
                        orjson.dumps({"i": i}),
                        stream="mix-prod",
                        topic="logs" if protocol == "logjam" else "t",
                        content_type="json",
                        ts_ns=(i + 1) * 1_000_000,
                    )
                await app.hub.ingest(builder.build())
            msgs = [await asyncio.to_thread(consumer.recv, 5) for _ in range(14)]
            consumer.close()
            assert all(m is not None for m in msgs)
            assert [m.meta.sequence for m in msgs] == list(range(1, 15))
            order = [m.json()["i"] if m.topic == "logs" else m.json()["payload"]["i"] for m in msgs]
            assert order == list(range(7)) * 2
            assert [m.meta.created_ms for m in msgs] == [i + 1 for i in range(7)] * 2
            assert [m.json()["taproom"]["offset"] for m in msgs if m.topic != "logs"] == [
                1,
                3,
                4,
                6,
                8,
                10,
                11,
                13,
            ]


class TestReplay:
    async def test_offset_and_seq_replay(self, tmp_path):
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:

            def work():
                consumer = LogjamConsumer(
                    url(app, "logjam_pub"), [""], replay_endpoint=url(app, "logjam_replay")
                )
                wait_subscriptions(app, 1)
                with LogjamAgent(url(app, "logjam_router"), topic="logs") as agent:
                    for i in range(30):
                        agent.send({"i": i}, app_env=("a-x", "b-x")[i % 2])
                wait_published(app)
                live = [consumer.recv(5) for _ in range(30)]
                nxt, by_offset = consumer.replay_offsets(10, 10, ["b-"])
                nxt2, rest = consumer.replay_offsets(nxt, 1000)
                seq_all = consumer.replay_seq(1, 30)
                seq_b = consumer.replay_seq(5, 8, ["b-"])
                consumer.close()
                return live, nxt, by_offset, nxt2, rest, seq_all, seq_b

            live, nxt, by_offset, nxt2, rest, seq_all, seq_b = await asyncio.to_thread(work)
            assert nxt == 20 and [m.offset for m in by_offset] == [11, 13, 15, 17, 19]
            assert all(m.app_env == "b-x" and m.meta.sequence == 0 for m in by_offset)
            assert nxt2 == 30 and [m.offset for m in rest] == list(range(20, 30))
            # seq replay returns exactly what the PUB sent, with the same numbers
            assert [(m.meta.sequence, m.body) for m in seq_all] == [
                (m.meta.sequence, m.body) for m in live
            ]
            assert [m.meta.sequence for m in seq_b] == [6, 8]

    async def test_gap_fill_and_errors(self, tmp_path):
        cfg = dict(QUIET, replay_index_size=16)
        async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:

            def work():
                # a consumer that only subscribes to a-: the b- messages are seq gaps; replay
                # proves nothing matching was lost
                consumer = LogjamConsumer(
                    url(app, "logjam_pub"), ["a-"], replay_endpoint=url(app, "logjam_replay")
                )
                wait_subscriptions(app, 2)
                with LogjamAgent(url(app, "logjam_router"), topic="logs") as agent:
                    for i in range(10):
                        agent.send({"i": i}, app_env=("a-x", "b-x")[i % 2])
                got = list(consumer.messages(1.0))
                filled = consumer.filled
                ctx = zmq.Context.instance()
                req = ctx.socket(zmq.REQ)  # REQ works too: the reply keeps the envelope
                req.connect(url(app, "logjam_replay"))
                answers = []
                for frames in ([b"seq", b"1", b"1"], [b"rewind", b"1", b"2"], [b"offset", b"0"]):
                    req.send_multipart(frames)
                    assert req.poll(5000)
                    answers.append(req.recv_multipart()[0])
                with LogjamAgent(url(app, "logjam_router"), topic="logs") as agent:
                    for i in range(20):
                        agent.send({"i": i}, app_env="a-x")
                req.send_multipart([b"seq", b"1", b"1"])
                assert req.poll(5000)
                answers.append(req.recv_multipart()[0])
                req.close()
                consumer.close()
                return got, filled, answers

            got, filled, answers = await asyncio.to_thread(work)
            assert [m.json()["i"] for m in got] == [0, 2, 4, 6, 8]
            assert filled == 0
            assert answers == [b"200 OK", b"400 Bad Request", b"400 Bad Request", b"410 Gone"]


def test_taproom_serve_runs_logjam_and_stops_cleanly(tmp_path):
    """The real process: listeners in the ready file, a 202, then SIGTERM exits 0."""
    config = write_config(tmp_path, enable=["logjam"], logjam=QUIET)
    hub = HubProcess(config).start()
    try:
        names = {"logjam_router", "logjam_pull", "logjam_pub", "logjam_replay"}
        assert names <= set(hub.addresses)
        host, port = hub.address("logjam_router")
        with LogjamAgent(f"tcp://{host}:{port}", app_env="p-q", topic="logs") as agent:
            assert agent.send({"ok": True}) == b"202 Accepted"
        assert hub.terminate() == 0
    finally:
        hub.kill()


def test_config_checks(tmp_path):
    for text, key in [
        ("[logjam]\nmeta_size = 22\ndevice_number = 70000\n", "logjam.device_number"),
        ('[logjam]\ndefault_app_env = "{protocol}"\n', "logjam.default_app_env"),
        ('[logjam]\ndefault_app_env = "hub-{nope}"\n', "logjam.default_app_env"),
        ('[logjam]\noutput_compression = "brotli"\n', "logjam.output_compression"),
        ('[logjam]\ngrammar = "relaxed"\n', "logjam.grammar"),
        ("[logjam]\nmax_message_bytes = 9000\nmax_frame_bytes = 8000\n", "logjam.max_frame_bytes"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(text=text, env={})
        assert info.value.key == key
    cfg = load_config(text='[logjam]\nroutes = ["logjam", "logtk"]\n', env={})
    assert cfg.logjam.routes == ("logjam", "logtk")
