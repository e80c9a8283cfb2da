"""Acceptance and replies as logjam-device gives them, over a real ROUTER and a real PULL.

Every row states what logjam-device does with the message, read from logjam-tools' device
source (``src/logjam-device.c``: ``read_router_message_and_forward`` answers and forwards what
arrives on the ROUTER, ``read_zmq_message_and_forward`` what arrives on the PULL; the meta frame
is decoded by ``zmq_msg_extract_meta_info`` in ``src/logjam-util.c``), and what taproom does.
They agree except where ``DIFFERS`` says why (docs/compat.md lists the same differences).
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass

import orjson
import pytest
import zmq

from taproom.protocols import logjam as lj
from tests.servers.test_logjam import rejected, sample, url, wait_committed
from tests.support import running_app

# Every test on taproom.zmqburst's compiled path and on its pure-Python twin.
pytestmark = pytest.mark.usefixtures("zmq_path")

A = b"202 Accepted"
B = b"400 Bad Request"
META = lj.encode_meta(0, 7, 1_700_000_000_000, 1)
ZLIB_META = lj.encode_meta(1, 7, 1_700_000_000_000, 2)
LIMITS = {"max_message_bytes": 1024, "max_frame_bytes": 4096, "max_decompressed_bytes": 2048}


def canonical_host_name() -> bytes:
    """What logjam-device calls itself (my_fqdn in src/logjam-util.c): getaddrinfo of the
    host name with AI_CANONNAME."""
    name = socket.gethostname()
    infos = socket.getaddrinfo(
        name, None, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_CANONNAME
    )
    return next(info[3] for info in infos if info[3]).encode()


@dataclass(frozen=True)
class Row:
    name: str
    frames: list[bytes]  # after the routing id and the empty frame (ROUTER), as sent (PULL)
    device: tuple[bytes, ...]  # logjam-device's reply after the routing id
    stored: str | None  # the content type taproom stores it with, or None: not stored
    reason: str | None = None  # taproom's reject reason, counted on each socket
    reply: tuple[bytes, ...] | None = None  # taproom's reply where it DIFFERS from the device
    pull_stored: str | None = "same"  # what the PULL stores, where not as the ROUTER
    pull_reason: str | None = "same"

    def on_pull(self) -> tuple[str | None, str | None]:
        return (
            self.stored if self.pull_stored == "same" else self.pull_stored,
            self.reason if self.pull_reason == "same" else self.pull_reason,
        )


# What logjam-device does, row by row (file and function cited in each comment):
ROWS = [
    # read_router_message_and_forward: a well-formed stream and a decoded meta get "202
    # Accepted" after [routing id, app-env]; both loops forward it (compress_or_forward).
    Row("plain", [b"app-prod", b"logs.app.prod", b'{"a":1}', META], (b"app-prod", A), "json"),
    # The Ruby agent's app-env and routing key for an app called my_app (well_formed_stream_name
    # and well_formed_topic accept them: observed, PEERS.md).
    Row(
        "underscore app",
        [b"my_app-production", b"logs.my_app.production", b"{}", META],
        (b"my_app-production", A),
        "json",
    ),
    Row(
        "digits in the app",
        [b"web2-production", b"logs.web2.production", b"{}", META],
        (b"web2-production", A),
        "json",
    ),
    Row("routing key mobile", [b"app-prod", b"mobile", b"{}", META], (b"app-prod", A), "json"),
    Row(
        "hyphenated routing key",
        [b"app-prod", b"logs.perf-ua.production", b"{}", META],
        (b"app-prod", A),
        "json",
    ),
    # The device never looks into the body (compress_or_forward passes it on): any body is
    # accepted; taproom stores one that is not JSON as it came, content type "raw".
    Row("body not JSON", [b"app-prod", b"logs", b"plain text", META], (b"app-prod", A), "raw"),
    Row(
        "zlib body not JSON",
        [b"app-prod", b"logs", lj.compress(1, b"<xml/>"), ZLIB_META],
        (b"app-prod", A),
        "raw",
    ),
    Row(
        "gzip body (the Ruby agent)",
        [b"app-prod", b"logs", gzip.compress(b'{"g":1}'), ZLIB_META],
        (b"app-prod", A),
        "json",
    ),
    Row(
        "lz4 body",
        [b"app-prod", b"logs", lj.compress(3, b"[1]"), lj.encode_meta(3, 7, 1, 3)],
        (b"app-prod", A),
        "json",
    ),
    # zmq_msg_extract_meta_info: the frame must be sizeof(msg_meta_t) = 24 bytes with tag
    # 0xcabd or, since 2020, 0xbdca (META_INFO_TAG_LE) and version 1, else "400 Bad Request"
    # and nothing is forwarded.
    Row(
        "22-byte meta (the seed's form)",
        [b"app-prod", b"logs", b"{}", lj.encode_meta(0, 7, 1, 4, size=22)],
        (b"app-prod", B),
        "json",
        reply=(b"app-prod", A),
    ),
    # A little-endian meta: the device accepts the tag, then reads the other fields in network
    # order anyway (meta_info_decode), so it forwards a byte-swapped created_ms; taproom reads
    # the whole frame little-endian (checked below: SWAPPED_CREATED_MS).
    Row(
        "byte-swapped meta",
        [b"app-prod", b"logs", b'{"le":1}', struct.pack("<HBBIQQ", lj.META_TAG, 0, 1, 7, 1, 5)],
        (b"app-prod", A),
        "json",
    ),
    Row(
        "bad meta tag",
        [b"app-prod", b"logs", b"{}", b"\0" * 24],
        (b"app-prod", B),
        None,
        "bad_meta_tag",
    ),
    Row(
        "bad meta version",
        [b"app-prod", b"logs", b"{}", struct.pack("!HBBIQQ", lj.META_TAG, 0, 2, 7, 1, 6)],
        (b"app-prod", B),
        None,
        "bad_meta_version",
    ),
    Row(
        "23-byte meta",
        [b"app-prod", b"logs", b"{}", META[:23]],
        (b"app-prod", B),
        None,
        "bad_meta_size",
    ),
    # read_router_message_and_forward wants exactly 4 frames after the empty one (400 else);
    # read_zmq_message_and_forward takes 3 or 4 ("the old pull socket interface did not require
    # meta information") and forwards 3 with META_INFO_EMPTY.
    Row(
        "three frames, no meta",
        [b"app-prod", b"logs", b'{"old":1}'],
        (b"app-prod", B),
        None,
        "bad_frame_count",
        pull_stored="json",
        pull_reason=None,
    ),
    Row("two frames", [b"app-prod", b"logs"], (b"app-prod", B), None, "bad_frame_count"),
    Row(
        "five frames",
        [b"app-prod", b"logs", b"{}", META, b"extra"],
        (b"app-prod", B),
        None,
        "bad_frame_count",
    ),
    # No frame after the empty one: the reply names "unknown-unknown" (nothing to push on PULL).
    Row("nothing after the empty frame", [], (b"unknown-unknown", B), None, "bad_frame_count"),
    # well_formed_stream_name (src/logjam-util.c): every byte 32..127 and at least one "-";
    # nothing else. It refuses: "400 Bad Request", nothing forwarded.
    Row("app-env without '-'", [b"app", b"logs", b"{}", META], (b"app", B), None, "bad_app_env"),
    Row("empty app-env", [b"", b"logs", b"{}", META], (b"", B), None, "bad_app_env"),
    Row(
        "non-ASCII app-env",
        ["äpp-prod".encode(), b"logs", b"{}", META],
        ("äpp-prod".encode(), B),
        None,
        "bad_app_env",
    ),
    Row(
        "app-env with a control byte",
        [b"app\t-prod", b"logs", b"{}", META],
        (b"app\t-prod", B),
        None,
        "bad_app_env",
    ),
    # ... and takes everything else: "202 Accepted", forwarded.
    *(
        Row(f"app-env {name!r}", [name, b"logs", b"{}", META], (name, A), "json")
        for name in (b"my.app-production", b"my app-production", b"-production", b"myapp-")
    ),
    Row(
        "app-env with DEL (127)",
        [b"app\x7f-prod", b"logs", b"{}", META],
        (b"app\x7f-prod", A),
        "json",
    ),
    # well_formed_topic: the key starts with logs, javascript, events, frontend.page,
    # frontend.ajax or mobile; nothing after the prefix is checked: forwarded.
    *(
        Row(f"routing key {key!r}", [b"app-prod", key, b"{}", META], (b"app-prod", A), "json")
        for key in (
            b"logs.my app",
            b"logs/myapp",
            "logs.äpp".encode(),
            b"logsx",
            b"javascript",
            b"events.x",
            b"frontend.page.x",
            b"frontend.ajax",
        )
    ),
    # The device answers 202 before it checks the routing key (well_formed_topic), then drops
    # a malformed key ("malformed routing key"); taproom never acks what it does not store, so
    # it answers 400 (the agent learns it was not stored). On the PULL both drop it.
    *(
        Row(
            f"routing key {key!r}",
            [b"app-prod", key, b"{}", META],
            (b"app-prod", A),
            None,
            "bad_topic",
            reply=(b"app-prod", B),
        )
        for key in (b"metrics.cpu.production", b"Logs.myapp.production", b"frontend", b"")
    ),
    # The device forwards bodies without decoding them and does not check the compression
    # method; taproom stores bodies decompressed, so one it cannot decompress is refused.
    Row(
        "unknown compression method",
        [b"app-prod", b"logs", b"{}", struct.pack("!HBBIQQ", lj.META_TAG, 7, 1, 7, 1, 7)],
        (b"app-prod", A),
        None,
        "bad_compression",
        reply=(b"app-prod", B),
    ),
    Row(
        "corrupt zlib body",
        [b"app-prod", b"logs", b"not zlib", ZLIB_META],
        (b"app-prod", A),
        None,
        "bad_body",
        reply=(b"app-prod", B),
    ),
    Row(
        "inflates past max_decompressed_bytes",
        [b"app-prod", b"logs", lj.compress(1, b"[" + b"0," * 2000 + b"0]"), ZLIB_META],
        (b"app-prod", A),
        None,
        "decompressed_too_large",
        reply=(b"app-prod", B),
    ),
    Row(
        "body over max_message_bytes",
        [b"app-prod", b"logs", b"[" + b" " * 2000 + b"]", META],
        (b"app-prod", A),
        None,
        "body_too_large",
        reply=(b"app-prod", B),
    ),
    # Pings (read_router_message_and_forward, is_ping): "200 OK" and my_fqdn() when the frames
    # decode, else "400 Bad Request"; never forwarded. On the PULL "ping" is no app-env for
    # the device (dropped); taproom counts it as a ping and stores nothing either.
    Row("ping", [lj.PING, b"app-prod", b"{}", META], (lj.PING, lj.PING_OK, b"HOST"), None),
    Row(
        "ping with a short meta",
        [lj.PING, b"app-prod", b"{}", b"short"],
        (lj.PING, B),
        None,
        "bad_meta_size",
    ),
    Row(
        "ping with three frames",
        [lj.PING, b"app-prod", b"{}"],
        (lj.PING, B),
        None,
        "bad_frame_count",
        pull_reason=None,  # on the PULL three frames take META_INFO_EMPTY: a ping there
    ),
]

# Where taproom's reply differs from logjam-device's, and why (docs/compat.md, "Logjam").
DIFFERS = {
    "22-byte meta (the seed's form)": "the seed's meta form is accepted",
    **{
        f"routing key {key!r}": "never a 202 for a message that is not stored"
        for key in (b"metrics.cpu.production", b"Logs.myapp.production", b"frontend", b"")
    },
    "unknown compression method": "bodies are stored decompressed",
    "corrupt zlib body": "bodies are stored decompressed",
    "inflates past max_decompressed_bytes": "a bound (zlib bombs)",
    "body over max_message_bytes": "a bound",
}

# Without the empty frame the device replies nothing and stores as above (send_reply false).
ASYNC_ROWS = [
    ([b"app-prod", b"logs", b'{"async":1}', META], "json", None),
    ([b"app", b"logs", b"{}", META], None, "bad_app_env"),
    ([b"app-prod", b"logs", b"{}"], None, "bad_frame_count"),  # 3 frames: not on the ROUTER
    ([lj.PING, b"app-prod", b"{}", META], None, None),  # a ping: dropped, no reply
]


def _records(app, start, end):
    return [r for r in app.hub.journal.read(start) if r.offset < end]


# The byte-swapped row's created_ms as logjam-device forwards it (meta_info_decode reads the
# little-endian field in network order); taproom stores the sender's 1 ms.
SWAPPED_CREATED_MS = int.from_bytes((1).to_bytes(8, "little"), "big")


async def test_acceptance_and_replies_row_by_row(tmp_path):
    """Every row on the ROUTER (with the empty frame: the reply) and on the PULL; what is
    stored is what the PUB output publishes, byte for byte (and nothing else)."""
    host = canonical_host_name()
    cfg = dict(LIMITS, heartbeat_interval_s=3600.0)  # no hostname: the canonical one
    assert set(DIFFERS) == {row.name for row in ROWS if row.reply is not None}
    assert len({row.name for row in ROWS}) == len(ROWS)
    async with running_app(tmp_path, enable=["logjam"], logjam=cfg) as app:

        def work():
            ctx = zmq.Context.instance()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(url(app, "logjam_pub"))
            deadline = time.monotonic() + 10
            while app.services["logjam"].subscriber_count() < 1:
                assert time.monotonic() < deadline, "the subscription never arrived"
                time.sleep(0.01)
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(url(app, "logjam_router"))
            push = ctx.socket(zmq.PUSH)
            push.connect(url(app, "logjam_pull"))
            seen = []
            for i, row in enumerate(ROWS):
                before = app.hub.journal.end_offset
                dealer.send_multipart([b"", *row.frames])
                assert dealer.poll(5000), row.name
                reply = tuple(dealer.recv_multipart())
                router_span = (before, app.hub.journal.end_offset)  # a 202 follows the commit
                pull_span = None
                if row.frames:
                    before = app.hub.journal.end_offset
                    push.send_multipart(row.frames)
                    # then a marker: the row's message is committed with or before it
                    push.send_multipart([b"marker-x", b"logs", b"[%d]" % i, META])
                    wait_committed(app, before + 1 + (row.on_pull()[0] is not None))
                    pull_span = (before, app.hub.journal.end_offset)
                seen.append((reply, router_span, pull_span))
            for frames, _, _ in ASYNC_ROWS:
                dealer.send_multipart(frames)
            dealer.send_multipart([b"", b"app-prod", b"logs", b'"last"', META])
            assert dealer.poll(5000)
            last = dealer.recv_multipart()
            assert not dealer.poll(300)  # nothing came back for the async rows
            dealer.close()
            push.close(linger=1000)
            published = []
            end = app.hub.journal.end_offset
            deadline = time.monotonic() + 10
            while len(published) < end:
                assert time.monotonic() < deadline, f"{len(published)} of {end} published"
                if sub.poll(100):
                    frames = sub.recv_multipart()
                    if frames[0] != lj.HEARTBEAT_APP_ENV:
                        published.append(tuple(frames[:3]))
            sub.close(linger=0)
            return seen, last, published

        seen, last, published = await asyncio.to_thread(work)
        rejects: Counter[str] = Counter()
        for row, (reply, router_span, pull_span) in zip(ROWS, seen, strict=True):
            expected = row.reply or tuple(host if f == b"HOST" else f for f in row.device)
            assert reply == expected, row.name
            records = _records(app, *router_span)
            assert [r.content_type for r in records] == [row.stored] * bool(row.stored), row.name
            rejects[row.reason] += 1
            if pull_span is not None:
                pull_stored, pull_reason = row.on_pull()
                pull_records = [r for r in _records(app, *pull_span) if r.stream != "marker-x"]
                assert [r.content_type for r in pull_records] == [pull_stored] * bool(
                    pull_stored
                ), row.name
                records += pull_records
                rejects[pull_reason] += 1
            for record in records:
                assert tuple(
                    f.encode("utf-8", "surrogateescape") for f in (record.stream, record.topic)
                ) == tuple(row.frames[:2])
        assert last == [b"app-prod", A]
        # what is stored is published as the agent sent it; a key the device drops is not
        everything = list(app.hub.journal.read(0))
        assert published == [
            (r.stream.encode(), r.topic.encode("utf-8", "surrogateescape"), r.payload)
            for r in everything
        ]
        assert not [frames for frames in published if not lj.well_formed_topic(frames[1])]
        swapped = [r for r in everything if r.payload == b'{"le":1}']
        # the sender's 1 ms on both sockets, where the device forwards SWAPPED_CREATED_MS
        assert [r.ts_ns // 1_000_000 for r in swapped] == [1, 1] != [SWAPPED_CREATED_MS] * 2
        for _, _, reason in ASYNC_ROWS:
            rejects[reason] += 1
        del rejects[None]
        for reason, count in rejects.items():
            assert rejected(app, reason) == count, reason
        assert rejected(app, "bad_json") == 0
        stored = [r for r in app.hub.journal.read(0) if r.stream != "marker-x"]
        raw = [r.payload for r in stored if r.content_type == "raw"]
        assert raw == [b"plain text"] * 2 + [b"<xml/>"] * 2  # as they came, from both sockets
        odd = sample(app, "taproom_ingest_odd_events_total", protocol="logjam", reason="not_json")
        assert odd == len(raw)
        # the ROUTER ping, the PULL ping, the PULL's three-frame ping, the async ping
        assert sample(app, "taproom_logjam_pings_messages_total") == 4
        legacy = [r for r in stored if r.payload == b'{"old":1}']
        assert [(r.producer, r.seq, r.ts_ns) for r in legacy] == [("0", 0, 0)]  # META_INFO_EMPTY
        assert [r.payload for r in stored if r.payload in (b'{"async":1}', b'"last"')] == [
            b'{"async":1}',
            b'"last"',
        ]


async def test_a_5_mib_body_on_the_router_is_answered_400_and_counted(tmp_path):
    """Issue 18: over max_message_bytes (4 MiB) but within max_frame_bytes (8 MiB), the message
    is read, refused with logjam's 400 and counted; the agent's connection stays up."""
    async with running_app(
        tmp_path, enable=["logjam"], logjam={"heartbeat_interval_s": 3600.0}
    ) as app:

        def work():
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.connect(url(app, "logjam_router"))
            body = b"[" + b" " * (5 * 1024 * 1024) + b"]"
            dealer.send_multipart([b"", b"app-prod", b"logs", body, META])
            assert dealer.poll(10_000)
            big = dealer.recv_multipart()
            dealer.send_multipart([b"", b"app-prod", b"logs", b"{}", META])
            assert dealer.poll(10_000)
            small = dealer.recv_multipart()
            dealer.close()
            return big, small

        big, small = await asyncio.to_thread(work)
        assert big == [b"app-prod", B]
        assert small == [b"app-prod", A]
        assert rejected(app, "body_too_large") == 1
        assert [r.payload for r in app.hub.journal.read(0)] == [b"{}"]


async def test_each_socket_caps_its_frames_from_what_its_protocol_sends(tmp_path):
    """Frame bounds per socket: ROUTER and PULL at max_frame_bytes, the XPUB at a 255-byte
    prefix (taproom's transport: a longer subscription disconnects its peer, counted
    message_too_large), the replay ROUTER at 4 KiB (ZMQ_MAXMSGSIZE: libzmq drops a peer that
    sends a bigger frame before keeping it; the drop shows only as a disconnect;
    docs/protocols/logjam.md)."""
    async with running_app(
        tmp_path, enable=["logjam"], logjam=dict(LIMITS, heartbeat_interval_s=3600.0)
    ) as app:
        service = app.services["logjam"]

        def work():
            ctx = zmq.Context.instance()
            push = ctx.socket(zmq.PUSH)
            push.connect(url(app, "logjam_pull"))
            push.send_multipart([b"app-prod", b"logs", b"x" * 4097, META])  # over the cap
            # libzmq reconnects the PUSH; what it sends then arrives
            deadline = time.monotonic() + 10
            while app.hub.journal.end_offset == 0:
                assert time.monotonic() < deadline, "the PUSH never came back"
                push.send_multipart([b"app-prod", b"logs", b"[]", META])
                time.sleep(0.2)
            push.close(linger=0)

            long_sub = ctx.socket(zmq.SUB)
            long_sub.setsockopt(zmq.SUBSCRIBE, b"a" * 256)  # one byte over a prefix's bound
            long_sub.connect(url(app, "logjam_pub"))
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"a" * 255)
            sub.connect(url(app, "logjam_pub"))
            deadline = time.monotonic() + 10
            # the long one is refused at its subscription (counted, its address logged)
            while service.subscriber_count() < 1 or rejected(app, "message_too_large") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            subscriptions = service.subscriber_count()
            long_sub.close(linger=0)
            sub.close(linger=0)

            replay = ctx.socket(zmq.DEALER)
            replay.connect(url(app, "logjam_replay"))
            replay.send_multipart([b"", b"offset", b"0", b"1", b"p" * 300])
            assert replay.poll(5000)
            within = replay.recv_multipart()
            replay.send_multipart([b"", b"offset", b"0", b"1", b"p" * 5000])
            over = replay.poll(1000)
            replay.close(linger=0)
            return subscriptions, within, over

        subscriptions, within, over = await asyncio.to_thread(work)
        assert {r.payload for r in app.hub.journal.read(0)} == {b"[]"}
        assert subscriptions == 1  # the 255-byte prefix only
        assert within[1:3] == [B, b"prefix longer than 255 bytes"]
        assert not over  # dropped by libzmq, never answered


class RubyStyleAgent:
    """A DEALER agent as skaes/logjam_agent's ZMQForwarder behaves in sync mode
    (lib/logjam_agent/zmq_forwarder.rb, send_receive and ping): LINGER 1000, HWMs 1000,
    RCVTIMEO/SNDTIMEO 5000; request ``["", app_env, key, data, info]``; the routing key
    defaults to ``logs.`` + the app-env with its first "-" made a "."; the body is gzip under
    method 1; ping is ``send_receive("ping", app_env, "{}", NO_COMPRESSION)``. An answer is
    matched when ``answer[0] == app_env`` (the first frame of the device's reply) and
    ``answer[1].to_i`` is 200 or 202."""

    def __init__(self, endpoint: str, app: str, env: str) -> None:
        self.app_env = f"{app}-{env}".encode()
        self.sequence = 0
        self.unmatched: list[list[bytes]] = []
        sock = zmq.Context.instance().socket(zmq.DEALER)
        for option, value in (
            (zmq.LINGER, 1000),
            (zmq.SNDHWM, 1000),
            (zmq.RCVHWM, 1000),
            (zmq.RCVTIMEO, 5000),
            (zmq.SNDTIMEO, 5000),
        ):
            sock.setsockopt(option, value)
        sock.connect(endpoint)
        self.socket = sock

    def forward(self, data: dict, *, engine: str | None = None) -> bytes:
        key = b"logs." + self.app_env.replace(b"-", b".", 1)
        if engine:
            key += b"." + engine.encode()
        return self._send_receive(self.app_env, key, gzip.compress(orjson.dumps(data)), 1)

    def ping(self) -> bytes:
        return self._send_receive(lj.PING, self.app_env, b"{}", 0)

    def _send_receive(self, app_env: bytes, key: bytes, data: bytes, method: int) -> bytes:
        self.sequence += 1
        info = lj.encode_meta(method, 0, int(time.time() * 1000), self.sequence)
        self.socket.send_multipart([b"", app_env, key, data, info])
        answer = self.socket.recv_multipart()  # raises zmq.Again after RCVTIMEO
        if answer[0] != app_env or int(answer[1].split()[0]) not in (200, 202):
            self.unmatched.append(answer)
        return answer[1]

    def close(self) -> None:
        self.socket.close()


async def test_a_ruby_style_agent_gets_every_answer_matched(tmp_path):
    async with running_app(
        tmp_path, enable=["logjam"], logjam={"heartbeat_interval_s": 3600.0}
    ) as app:

        def work():
            statuses = []
            agents = [
                RubyStyleAgent(url(app, "logjam_router"), name, env)
                for name, env in (
                    ("my_app", "production"),
                    ("web2", "production"),
                    ("shop", "pre_view"),
                )
            ]
            for i in range(30):
                agent = agents[i % 3]
                statuses.append(agent.forward({"i": i}, engine="mobile" if i % 2 else None))
            statuses += [agent.ping() for agent in agents]
            unmatched = [answer for agent in agents for answer in agent.unmatched]
            for agent in agents:
                agent.close()
            return statuses, unmatched

        statuses, unmatched = await asyncio.to_thread(work)
        assert unmatched == []
        assert statuses == [A] * 30 + [lj.PING_OK] * 3
        records = list(app.hub.journal.read(0))
        assert len(records) == 30
        assert {(r.stream, r.topic) for r in records} == {
            ("my_app-production", "logs.my_app.production"),
            ("my_app-production", "logs.my_app.production.mobile"),
            ("web2-production", "logs.web2.production"),
            ("web2-production", "logs.web2.production.mobile"),
            ("shop-pre_view", "logs.shop.pre_view"),
            ("shop-pre_view", "logs.shop.pre_view.mobile"),
        }
        assert sorted(orjson.loads(r.payload)["i"] for r in records) == list(range(30))
