"""servers/zmtp/publisher: taproom's own PUB/XPUB against real libzmq SUB and XSUB peers
(pyzmq) and raw ZMTP bytes: subscriptions in both forms, prefix filters, every message a
subscriber misses counted (sent = delivered + dropped + queued), bounds in messages and bytes,
the budget, whole messages only, CURVE and the allowlist, refusals."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time

import pytest
import zmq

from taproom.budget import Holder
from taproom.protocols import zmtp as zp
from taproom.servers.zmtp import ZmtpConfig, ZmtpPublisher
from tests.servers.test_zmtp import Hub, peer, read_frame, until

pytestmark = pytest.mark.usefixtures("zmq_path")

MiB = 1 << 20
OUTPUT = "logjam_pub"  # the listener (its [access] rules) and the metrics' output label
REASONS = ("hwm", "subscriber_bytes", "output_budget", "disconnected")


@contextlib.asynccontextmanager
async def publisher(*, hwm=100_000, config=None, holder=None, text="", on_subscription=None):
    hub = Hub(text)
    pub = ZmtpPublisher(
        "XPUB",
        hub=hub,
        protocol="test",
        name=OUTPUT,
        hwm=hwm,
        max_subscription_bytes=255,
        config=config,
        holder=holder,
        on_subscription=on_subscription,
    )
    await pub.bind("127.0.0.1", 0)
    try:
        yield pub, hub
    finally:
        pub.close()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def counted(hub, name, **labels):
    value = hub.metrics.registry.get_sample_value(name, {"output": OUTPUT, **labels})
    return value or 0


def dropped(hub, *reasons):
    return sum(
        counted(hub, "taproom_output_dropped_messages_total", reason=r) for r in reasons or REASONS
    )


def accounted(hub, pub):
    """sent == delivered + dropped + queued, exactly."""
    sent = counted(hub, "taproom_output_sent_messages_total")
    delivered = counted(hub, "taproom_output_delivered_messages_total")
    return sent == delivered + dropped(hub) + pub.queued_messages


def numbered(i, size=0):
    return [b"topic", struct.pack(">Q", i), b"p" * size]


async def drain(sock, n, timeout=20.0, got=None):
    """``n`` messages from a libzmq socket, in a thread (appended to ``got`` as they come, if
    given, so the caller sees the progress)."""

    def work():
        nonlocal got
        got = [] if got is None else got
        deadline = time.monotonic() + timeout
        while len(got) < n:
            left = deadline - time.monotonic()
            assert left > 0 and sock.poll(int(left * 1000)), f"only {len(got)} of {n}"
            got.append(sock.recv_multipart())
        return got

    return await asyncio.to_thread(work)


def raw_subscriber(address, prefix=b"", minor=1, rcvbuf=0):
    """A raw ZMTP peer (SUB) that subscribes to ``prefix`` and then reads only when asked."""
    host, port = address.rsplit(":", 1)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect((host, int(port)))
    s.sendall(
        zp.Greeting(3, minor, b"NULL", False).serialize()
        + zp.encode_command(b"READY", zp.encode_metadata({b"Socket-Type": b"SUB"}))
        + zp.subscribe_message(prefix, minor)
    )
    got = b""
    while len(got) < 64:
        got += s.recv(64 - len(got))
    assert read_frame(s)[1].startswith(b"\x05READY")
    return s


def recv_exactly(s, n):
    """``n`` bytes (MSG_WAITALL returns short on a socket with a timeout); TimeoutError when
    none come, AssertionError when the stream stops inside them."""
    data = b""
    while len(data) < n:
        try:
            chunk = s.recv(n - len(data))
        except TimeoutError:
            assert not data, "the stream stopped inside a frame"
            raise
        assert chunk, "closed"
        data += chunk
    return data


def read_whole_frame(s):
    head = recv_exactly(s, 2)
    size = head[1]
    if head[0] & zp.Flag.LONG:
        size = int.from_bytes(head[1:] + recv_exactly(s, 7), "big")
    return head[0], recv_exactly(s, size) if size else b""


def read_messages(s, timeout=2.0, done=lambda: True, deadline_s=60.0):
    """Every whole message a raw subscriber can read until it is quiet for ``timeout`` once
    ``done()`` (e.g. the publisher has nothing queued for it; read from this thread)."""
    s.settimeout(timeout)
    deadline = time.monotonic() + deadline_s
    messages, frames = [], []
    while True:
        try:
            flags, body = read_whole_frame(s)
        except TimeoutError:
            assert not frames, "a message was cut in the middle"
            if done() or time.monotonic() > deadline:
                return messages
            continue
        frames.append(body)
        if not flags & zp.Flag.MORE:
            messages.append(frames)
            frames = []


class TestSubscriptions:
    async def test_prefix_filters_of_sub_and_xsub_peers(self, ctx):
        seen = []
        async with publisher(on_subscription=lambda s, p, on: seen.append((p, on))) as (pub, _):
            every = peer(ctx, zmq.SUB, pub.address, SUBSCRIBE=b"")
            alpha = peer(ctx, zmq.SUB, pub.address, SUBSCRIBE=b"al")
            xsub = peer(ctx, zmq.XSUB, pub.address)
            xsub.send(b"\x01be")  # an XSUB's subscription: libzmq sends it as a command
            await until(lambda: pub.subscribed() == 3, what="three subscribers")
            pub.send([[b"alpha", b"1"], [b"beta", b"2"], [b"gamma", b"3"]])
            assert [m[0] for m in await drain(every, 3)] == [b"alpha", b"beta", b"gamma"]
            assert await drain(alpha, 1) == [[b"alpha", b"1"]]
            assert await drain(xsub, 1) == [[b"beta", b"2"]]
            assert sorted(seen) == [(b"", True), (b"al", True), (b"be", True)]
            assert pub.prefixes() == 3
            alpha.setsockopt(zmq.UNSUBSCRIBE, b"al")  # a CANCEL command
            await until(lambda: pub.prefixes() == 2, what="the cancel")
            xsub.close(0)  # gone: its prefixes are cancelled with it
            await until(lambda: pub.prefixes() == 1, what="the XSUB gone")
            assert (b"be", False) in seen and (b"al", False) in seen
            for s in (every, alpha):
                s.close(0)

    async def test_zmtp_3_0_and_3_1_message_form(self):
        """A 3.0 peer subscribes with a message (1 + prefix, 0 + prefix cancels); a 3.1 peer
        may too. A subscription is a set per peer: twice and a cancel leaves it cancelled."""
        seen = []
        async with publisher(on_subscription=lambda s, p, on: seen.append((p, on))) as (pub, _):
            old = await asyncio.to_thread(raw_subscriber, pub.address, b"a", 0)
            new = await asyncio.to_thread(raw_subscriber, pub.address, b"b", 1)
            new.sendall(zp.encode_frame(b"\x01b") + zp.encode_frame(b"\x01c"))  # b again, c
            new.sendall(zp.encode_frame(b"\x00b"))  # one cancel: b is gone
            await until(lambda: (b"b", False) in seen, what="the cancel")
            assert sorted(seen) == [(b"a", True), (b"b", False), (b"b", True), (b"c", True)]
            pub.send([[b"a1"], [b"b1"], [b"c1"]])
            assert await asyncio.to_thread(read_messages, old, 0.5) == [[b"a1"]]
            assert await asyncio.to_thread(read_messages, new, 0.5) == [[b"c1"]]
            old.close()
            new.close()

    async def test_a_multipart_message_from_a_peer_is_no_subscription(self):
        async with publisher() as (pub, _hub):
            s = await asyncio.to_thread(raw_subscriber, pub.address, b"x")
            s.sendall(zp.encode_message([b"\x01y", b"\x01z"]) + zp.encode_frame(b"\x01w"))
            await until(lambda: pub.prefixes() == 2, what="x and w")
            pub.send([[b"y"], [b"z"], [b"w"], [b"x"]])
            assert await asyncio.to_thread(read_messages, s, 0.5) == [[b"w"], [b"x"]]
            s.close()

    async def test_heartbeats_are_answered(self, ctx):
        async with publisher() as (pub, _hub):
            sub = peer(ctx, zmq.SUB, pub.address, SUBSCRIBE=b"", HEARTBEAT_IVL=50)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 200)
            await until(lambda: pub.subscribed() == 1, what="the subscription")
            first = next(iter(pub._joined_set))
            await asyncio.sleep(1.0)  # 20 PINGs; unanswered, libzmq would reconnect
            assert pub.subscribers() == 1 and next(iter(pub._joined_set)) is first
            pub.send([[b"still", b"here"]])
            assert await drain(sub, 1) == [[b"still", b"here"]]
            sub.close(0)


class TestFanout:
    async def test_subscribers_with_one_filter_share_one_burst(self, ctx, monkeypatch):
        """A burst is built once: every subscriber whose filter takes all of it is offered
        the very same bytes, and subscribers with equal filters share one selection."""
        from taproom.servers.zmtp import publisher as module

        offered = []
        real = module.Subscriber.offer

        def spy(self, burst, shared):
            offered.append((self.filter.key, id(burst.wire)))
            real(self, burst, shared)

        monkeypatch.setattr(module.Subscriber, "offer", spy)
        async with publisher() as (pub, _hub):
            subs = [peer(ctx, zmq.SUB, pub.address, SUBSCRIBE=b"") for _ in range(3)]
            subs += [peer(ctx, zmq.SUB, pub.address, SUBSCRIBE=b"a") for _ in range(2)]
            await until(lambda: pub.subscribed() == 5, what="five subscribers")
            pub.send([[b"a1"], [b"b1"], [b"a2"]])
            everything = {wire for key, wire in offered if key == (b"",)}
            selected = {wire for key, wire in offered if key == (b"a",)}
            assert len(offered) == 5 and len(everything) == 1 and len(selected) == 1
            assert everything != selected
            for s in subs[:3]:
                assert len(await drain(s, 3)) == 3
            for s in subs[3:]:
                assert await drain(s, 2) == [[b"a1"], [b"a2"]]
            for s in subs:
                s.close(0)

    async def test_a_slow_subscriber_costs_its_bound_and_the_fast_one_nothing(self, ctx):
        """One subscriber never reads: it holds at most max_subscriber_bytes beyond what the
        kernel took, misses the rest (counted), while a fast one gets every message; once it
        goes, what it had queued is counted and its room goes back."""
        config = ZmtpConfig(max_subscriber_bytes=MiB)
        async with publisher(config=config) as (pub, hub):
            fast = peer(ctx, zmq.SUB, pub.address, SUBSCRIBE=b"", RCVHWM=0)
            slow = await asyncio.to_thread(raw_subscriber, pub.address, b"", 1, 4096)
            await until(lambda: pub.subscribed() == 2, what="both subscribers")
            received: list[list[bytes]] = []
            reading = asyncio.create_task(drain(fast, 2000, got=received))
            for burst in range(20):
                pub.send([numbered(burst * 100 + i, 16_000) for i in range(100)])
                assert pub.holder.used <= 2 * MiB + 16_100  # the slow one's, and a burst
                # "fast": it keeps up (has read each burst before the next; on a loaded machine
                # its thread could lag a burst and its own 1 MiB bound, and miss some, counted)
                await until(lambda b=burst: len(received) >= (b + 1) * 100 or reading.done(),
                            what=f"burst {burst} read by the fast one")  # fmt: skip
            got = await reading
            assert [struct.unpack(">Q", m[1])[0] for m in got] == list(range(2000))
            assert dropped(hub, "subscriber_bytes") > 0
            assert pub.queued_bytes <= MiB
            assert accounted(hub, pub)
            slow.close()
            await until(lambda: pub.subscribers() == 1, what="the slow one gone")
            assert pub.queued_messages == 0 and pub.holder.used == 0
            assert dropped(hub, "disconnected") > 0
            assert accounted(hub, pub)
            fast.close(0)

    async def test_the_hwm_counts_messages(self):
        async with publisher(hwm=50) as (pub, hub):
            slow = await asyncio.to_thread(raw_subscriber, pub.address, b"", 1, 4096)
            await until(lambda: pub.subscribed() == 1, what="the subscription")
            for i in range(20):
                pub.send([numbered(i * 100 + j, 10_000) for j in range(100)])
            assert 0 < pub.queued_messages <= 50
            assert dropped(hub, "hwm") > 0 and accounted(hub, pub)
            slow.close()

    async def test_subscribers_share_the_output_holder(self):
        """Two that never read: each holds at most half of the holder (its share), so a
        third always finds room; past the holder itself: output_budget. The kernel's send
        buffers are fixed small: left to Linux they grow to tcp_wmem's maximum (4 MiB each), and
        how far they grew decided whether 4 MiB sent reached the share (a clean-clone CI run
        had both subscribers at 1,024,416 of 1,048,576 bytes, nothing dropped)."""
        holder = Holder("output_queues", 2 * MiB)
        config = ZmtpConfig(subscriber_send_buffer_bytes=64 * 1024)
        async with publisher(holder=holder, config=config) as (pub, hub):
            slow = [
                await asyncio.to_thread(raw_subscriber, pub.address, b"", 1, 4096) for _ in range(2)
            ]
            await until(lambda: pub.subscribed() == 2, what="two subscribers")
            for i in range(40):
                pub.send([numbered(i * 10 + j, 10_000) for j in range(10)])
                assert holder.used <= 2 * MiB
                assert all(sub.pinned <= MiB for sub in pub._joined_set)
            assert dropped(hub, "subscriber_bytes") > 0
            holder.try_reserve(holder.bound - holder.used)  # someone else takes the rest
            before = dropped(hub, "output_budget")
            third = await asyncio.to_thread(raw_subscriber, pub.address, b"", 1, 4096)
            await until(lambda: pub.subscribed() == 3, what="the third")
            for i in range(10):
                pub.send([numbered(i, 100_000) for _ in range(20)])
            assert dropped(hub, "output_budget") > before and accounted(hub, pub)
            for s in (*slow, third):
                s.close()

    async def test_messages_arrive_whole_and_in_order_with_gaps_counted(self):
        """A subscriber with a small receive buffer that reads late: every message it gets is
        whole (a message the kernel took part of is always finished), in order, and what it
        got plus what was counted missing is everything offered to it."""
        config = ZmtpConfig(max_subscriber_bytes=256 * 1024)
        async with publisher(config=config) as (pub, hub):
            s = await asyncio.to_thread(raw_subscriber, pub.address, b"", 1, 8192)
            await until(lambda: pub.subscribed() == 1, what="the subscription")
            sizes = [10, 300, 70_000, 5, 200_000, 1000]
            n = 0
            for _ in range(30):
                pub.send([numbered(n + i, sizes[(n + i) % len(sizes)]) for i in range(7)])
                n += 7
            got = await asyncio.to_thread(read_messages, s, 0.5, lambda: pub.queued_messages == 0)
            numbers = [struct.unpack(">Q", m[1])[0] for m in got]
            assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
            assert all(
                m[2] == b"p" * sizes[i % len(sizes)] for m, i in zip(got, numbers, strict=True)
            )
            await until(lambda: pub.queued_messages == 0, what="everything written")
            assert len(got) + dropped(hub) == n
            assert 0 < dropped(hub) < n and accounted(hub, pub)
            s.close()


class TestAccess:
    async def test_only_allowed_addresses_are_served(self, ctx):
        text = f'[access.{OUTPUT}]\nallow = ["127.0.0.2"]\n'
        async with publisher(text=text) as (pub, hub):
            allowed = ctx.socket(zmq.SUB)
            allowed.setsockopt(zmq.SUBSCRIBE, b"")
            allowed.connect(f"tcp://127.0.0.2:0;127.0.0.1:{pub.port}")
            refused = ctx.socket(zmq.SUB)
            refused.setsockopt(zmq.SUBSCRIBE, b"")
            refused.connect(f"tcp://127.0.0.3:0;127.0.0.1:{pub.port}")

            def refusals():
                return hub.metrics.registry.get_sample_value(
                    "taproom_access_refused_connections_total",
                    {"listener": OUTPUT, "reason": "address_not_allowed"},
                )

            await until(lambda: pub.subscribed() == 1, what="the allowed one")
            await until(lambda: (refusals() or 0) >= 1, what="the refusal counted")
            pub.send([[b"for", b"the allowed"]])
            assert await drain(allowed, 1) == [[b"for", b"the allowed"]]
            assert not await asyncio.to_thread(refused.poll, 300)
            assert pub.subscribers() == 1
            allowed.close(0)
            refused.close(0)

    async def test_curve_subscribers_with_a_known_key_only(self, ctx, tmp_path):
        import zmq.auth

        hub_public, hub_secret = zmq.auth.create_certificates(str(tmp_path), "hub")
        clients = tmp_path / "clients"
        clients.mkdir()
        _, known_secret = zmq.auth.create_certificates(str(clients), "known")
        _, stranger_secret = zmq.auth.create_certificates(str(tmp_path), "stranger")
        text = (
            f'[access.{OUTPUT}]\ncurve_secret_key_file = "{hub_secret}"\n'
            f'curve_allowed_clients = "{clients}"\n'
        )
        server_public, _ = zmq.auth.load_certificate(hub_public)

        def client(secret_file, prefix=b""):
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, prefix)
            if secret_file is not None:
                public, secret = zmq.auth.load_certificate(secret_file)
                sock.curve_publickey, sock.curve_secretkey = public, secret
                sock.curve_serverkey = server_public
            sock.connect("tcp://" + pub.address)
            return sock

        async with publisher(text=text) as (pub, hub):
            known, picky = client(known_secret), client(known_secret, b"b")
            await until(lambda: pub.subscribed() == 2, what="the known subscribers")
            pub.send([[b"a", b"x" * 300], [b"b", b"y"]])
            pub.send([numbered(i, i * 100) for i in range(50)])
            got = await drain(known, 52)
            assert got[:2] == [[b"a", b"x" * 300], [b"b", b"y"]]
            assert [m[2] for m in got[2:]] == [b"p" * (i * 100) for i in range(50)]
            assert await drain(picky, 1) == [[b"b", b"y"]]

            def refusals(reason):
                value = hub.metrics.registry.get_sample_value(
                    "taproom_access_refused_connections_total",
                    {"listener": OUTPUT, "reason": reason},
                )
                return value or 0

            stranger, null = client(stranger_secret), client(None)
            await until(lambda: refusals("curve_key_not_allowed") >= 1, what="the stranger")
            await until(
                lambda: refusals("mechanism_mismatch") + refusals("handshake_failed") >= 1,
                what="the NULL peer",
            )
            assert pub.subscribers() == 2 and accounted(hub, pub)
            for s in (known, picky, stranger, null):
                s.close(0)


class TestRefusals:
    async def test_wrong_peers_and_subscriptions_are_refused_and_counted(self, ctx):
        config = ZmtpConfig(max_subscriptions=3)
        async with publisher(config=config) as (pub, hub):
            push = peer(ctx, zmq.PUSH, pub.address)
            push.send(b"never")
            long = peer(ctx, zmq.SUB, pub.address, SUBSCRIBE=b"x" * 256)
            many = peer(ctx, zmq.SUB, pub.address)
            for topic in (b"a", b"b", b"c", b"d"):
                many.setsockopt(zmq.SUBSCRIBE, topic)
            await until(lambda: hub.rejected("socket_type") >= 1, what="the PUSH")
            await until(lambda: hub.rejected("message_too_large") >= 1, what="the long topic")
            await until(lambda: hub.rejected("too_many_subscriptions") >= 1, what="the 4th")
            for s in (push, long, many):
                s.close(0)

    async def test_a_handshake_that_never_ends_times_out(self):
        config = ZmtpConfig(handshake_timeout_s=0.2)
        async with publisher(config=config) as (pub, hub):
            host, port = pub.address.rsplit(":", 1)
            silent = socket.create_connection((host, int(port)))
            await until(lambda: hub.rejected("handshake_timeout") == 1, what="the timeout")
            silent.close()

    async def test_a_reconnecting_subscriber_is_served_again(self, ctx):
        async with publisher() as (pub, _hub):
            for round_ in range(3):
                sub = peer(ctx, zmq.SUB, pub.address, SUBSCRIBE=b"")
                await until(lambda: pub.subscribed() == 1, what="the subscription")
                pub.send([[b"round", b"%d" % round_]])
                assert await drain(sub, 1) == [[b"round", b"%d" % round_]]
                sub.close(0)
                await until(lambda: pub.subscribers() == 0, what="the subscriber gone")
