"""clients/logjam.py: the agent's frames, the consumer's gap/duplicate tracking and replay fill,
and the ``taproom send logjam`` / ``taproom tail --logjam`` commands, over real ZeroMQ."""

from __future__ import annotations

import argparse
import asyncio
import struct
import threading
import time

import orjson
import pytest
import zmq

from taproom.cli import main
from taproom.clients.logjam import LogjamAgent, LogjamConsumer, register_tail
from taproom.protocols import logjam as lj
from tests.servers.test_logjam import QUIET, url, wait_committed, wait_published, wait_subscriptions
from tests.support import running_app


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def _wait_for_subscription(pub, consumer):
    """Send probes (device 99) until one arrives, drain stragglers, forget device 99."""
    for _ in range(200):
        pub.send_multipart([b"probe-x", b"logs", b"{}", lj.encode_meta(0, 99, 1, 1)])
        if consumer.recv(0.02) is not None:
            break
    while consumer.recv(0.1) is not None:
        pass
    consumer.devices.clear()


class TestAgent:
    def test_push_frames_sequence_and_meta(self, ctx):
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        before = int(time.time() * 1000)
        with LogjamAgent(
            f"tcp://127.0.0.1:{port}",
            mode="push",
            app_env="app-prod",
            topic="logs.app",
            compression="snappy",
            device=12,
            context=ctx,
        ) as agent:
            for i in range(3):
                agent.send({"i": i})
            frames = [pull.recv_multipart() for _ in range(3)]
        pull.close()
        for i, (app_env, topic, body, meta_frame) in enumerate(frames):
            meta = lj.parse_meta(meta_frame)
            assert (app_env, topic) == (b"app-prod", b"logs.app")
            assert (meta.sequence, meta.device, meta.compression) == (
                i + 1,
                12,
                lj.Compression.SNAPPY,
            )
            assert meta.created_ms >= before
            assert orjson.loads(lj.decompress(meta.compression, body, 1 << 20)) == {"i": i}

    def test_dealer_sync_sends_the_empty_frame_and_reads_the_reply(self, ctx):
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        with LogjamAgent(f"tcp://127.0.0.1:{port}", app_env="x-y", context=ctx) as agent:
            done = []
            t = threading.Thread(target=lambda: done.append(agent.send({"a": 1})))
            t.start()
            assert router.poll(5000)
            rid, empty, app_env, *_ = router.recv_multipart()
            assert (empty, app_env) == (b"", b"x-y")
            # logjam-device's own reply form ("" status) is understood as well
            router.send_multipart([rid, b"", b"202 Accepted"])
            t.join(5)
            assert done == [b"202 Accepted"]
        router.close()


class TestConsumer:
    def test_gaps_duplicates_restarts_per_device_and_every_meta_form(self, ctx):
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        consumer = LogjamConsumer(f"tcp://127.0.0.1:{port}", [""], timeout=2, context=ctx)
        # wait until the subscription is through: send probes until one arrives
        _wait_for_subscription(pub, consumer)
        sent = [(5, 1), (5, 2), (9, 10), (5, 4), (5, 4), (5, 3), (9, 11), (5, 5), (5, 1)]
        methods = list(lj.Compression)
        for k, (device, seq) in enumerate(sent):
            method = methods[k % 4]
            body = orjson.dumps({"k": k})
            if k == 2:  # the seed's 22-byte form
                meta = lj.encode_meta(method, device, 7, seq, size=22)
            elif k == 3:  # byte-swapped tag: a little-endian sender
                meta = struct.pack("<HBBIQQ", 0xCABD, method, 1, device, 7, seq)
            else:
                meta = lj.encode_meta(method, device, 7, seq)
            pub.send_multipart([b"app-prod", b"logs", lj.compress(method, body), meta])
        pub.send_multipart([b"app-prod", b"logs", b"{}"])  # not a logjam message
        got = list(consumer.messages(0.5))
        consumer.close()
        pub.close()
        assert [m.json()["k"] for m in got] == [0, 1, 2, 3, 6, 7, 8]  # duplicates dropped
        five, nine = consumer.devices[5], consumer.devices[9]
        assert (five.gaps, five.duplicates, five.restarts) == (1, 2, 1)
        assert (nine.gaps, nine.duplicates, nine.restarts) == (0, 0, 0)
        assert consumer.bad == 1

    def test_unreachable_replay_is_counted_and_the_stream_goes_on(self, ctx):
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        dead = ctx.socket(zmq.ROUTER)  # bound, never answers
        dead_port = dead.bind_to_random_port("tcp://127.0.0.1")
        consumer = LogjamConsumer(
            f"tcp://127.0.0.1:{port}",
            [""],
            replay_endpoint=f"tcp://127.0.0.1:{dead_port}",
            timeout=0.3,
            context=ctx,
        )
        _wait_for_subscription(pub, consumer)
        for seq in (5, 9):
            pub.send_multipart([b"a-b", b"logs", b'{"s":%d}' % seq, lj.encode_meta(0, 3, 1, seq)])
        got = list(consumer.messages(1.0))
        consumer.close()
        pub.close()
        dead.close()
        assert [m.json()["s"] for m in got] == [5, 9]
        assert consumer.filled == 0 and consumer.unfilled == consumer.gaps > 0

    async def test_gap_fill_through_replay_recovers_every_event(self, tmp_path):
        # heartbeats matter here: the one after the burst reveals the gap at its end
        cfg = dict(QUIET, snd_hwm=50, heartbeat_interval_s=0.2)
        async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:

            def work():
                consumer = LogjamConsumer(
                    url(app, "logjam_pub"),
                    [""],
                    replay_endpoint=url(app, "logjam_replay"),
                    rcvhwm=10,
                    rcvbuf=4096,
                    timeout=5,
                )
                wait_subscriptions(app, 1)
                pad = "p" * 4000
                with LogjamAgent(url(app, "logjam_pull"), mode="push", app_env="g-x") as push:
                    # 12 MB while the consumer does not read: more than its queues and the
                    # TCP buffers (4 MB at most here) hold
                    for i in range(3000):
                        push.send({"i": i, "pad": pad}, topic="logs")
                    wait_committed(app, 3000)
                wait_published(app)
                got = list(consumer.messages(1.0))
                consumer.close()
                return got, consumer.filled, consumer.gaps

            got, filled, gaps = await asyncio.to_thread(work)
            dropped = sum(
                app.hub.metrics.registry.get_sample_value(
                    "taproom_output_dropped_messages_total",
                    {"output": "logjam_pub", "reason": reason},
                )
                for reason in ("hwm", "subscriber_bytes")
            )
            assert dropped > 0
            assert sorted(m.json()["i"] for m in got) == list(range(3000))
            replayed = [m for m in got if m.replayed]
            assert 0 < len(replayed) == filled <= gaps
            # replayed messages carry their PUB sequence numbers and journal offsets
            assert all(m.offset == m.json()["i"] for m in replayed)
            seqs = [m.meta.sequence for m in got]
            assert len(set(seqs)) == len(seqs)
            live = {m.meta.sequence for m in got if not m.replayed}
            assert not live & {m.meta.sequence for m in replayed}


class TestCommands:
    async def test_send_and_tail(self, tmp_path, capfd):
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:

            def work():
                results = {}
                tail = threading.Thread(
                    target=lambda: results.setdefault(
                        "tail",
                        main(
                            [
                                "tail",
                                "--logjam",
                                url(app, "logjam_pub"),
                                "--limit",
                                "3",
                                "--logjam-prefix",
                                "cli-",
                                "--logjam-idle",
                                "10",
                            ]
                        ),
                    )
                )
                tail.start()
                wait_subscriptions(app, 2)  # cli- and heartbeat
                router = url(app, "logjam_router")
                results["send"] = main(
                    [
                        "send",
                        "logjam",
                        "--endpoint",
                        router,
                        "--app-env",
                        "cli-test",
                        "--topic",
                        "logs.cli",
                        "--compression",
                        "zlib",
                        '{"a":1}',
                        '{"b":2}',
                    ]
                )
                results["push"] = main(
                    [
                        "send",
                        "logjam",
                        "--mode",
                        "push",
                        "--endpoint",
                        url(app, "logjam_pull"),
                        "--app-env",
                        "cli-push",
                        "--topic",
                        "logs",
                        '{"c":3}',
                    ]
                )
                results["ping"] = main(["send", "logjam", "--endpoint", router, "--ping"])
                results["bad"] = main(
                    ["send", "logjam", "--endpoint", router, "--app-env", "nope", '{"x":1}']
                )
                tail.join(15)
                return results

            results = await asyncio.to_thread(work)
            out, err = capfd.readouterr()
            assert results == {"send": 0, "push": 0, "ping": 0, "bad": 1, "tail": 0}
            lines = [orjson.loads(line) for line in out.splitlines() if line.startswith("{")]
            assert [(d["app_env"], d["topic"], d["body"]) for d in lines] == [
                ("cli-test", "logs.cli", {"a": 1}),
                ("cli-test", "logs.cli", {"b": 2}),
                ("cli-push", "logs", {"c": 3}),
            ]
            assert all(d["device"] == 1 and d["compression"] == "none" for d in lines)
            assert "ping 200 OK hub.example" in out
            assert "400 Bad Request" in err
            assert app.hub.journal.end_offset == 3

    def test_tail_handler_falls_through_without_logjam(self):
        parser = argparse.ArgumentParser()
        handler = register_tail(parser)
        assert handler(parser.parse_args([])) is None
        args = parser.parse_args(["--logjam", "tcp://127.0.0.1:1", "--logjam-prefix", "a-"])
        assert args.logjam_prefix == ["a-"]
