"""servers/zmtp: taproom's own ZeroMQ sockets against real libzmq peers (pyzmq) and raw ZMTP
bytes: every accepted socket type, ZMTP 3.0 and 3.1, heartbeats, reconnects, refusals, the
message bound at the header, TCP backpressure, and the budget."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import types

import pytest
import zmq

from taproom.budget import Holder, MemoryBudget
from taproom.config import load_config
from taproom.metrics import Metrics
from taproom.protocols import zmtp as zp
from taproom.servers.zmtp import ZmtpConfig, ZmtpSocket
from taproom.supervise import Supervisor

pytestmark = pytest.mark.usefixtures("zmq_path")

MiB = 1 << 20
# a listener of each kind (its name picks its [access] rules)
LISTENER = {"ROUTER": "logjam_router", "PULL": "logjam_pull", "SUB": "lager_forwarder_in"}


class Hub:
    """What a ZmtpSocket needs of a hub: its configuration, metrics, memory budget and
    supervisor (which counts a read the transport fails on)."""

    def __init__(self, text: str = "") -> None:
        self.config = load_config(text=text)
        self.metrics = Metrics()
        self.budget = MemoryBudget(self.config, self.metrics)
        self.supervisor = Supervisor(self.config.hub, self.metrics)
        self.commits_now = 0

    def commit_now(self) -> bool:  # a read callback that served everything asks for it
        self.commits_now += 1
        return False

    def rejected(self, reason: str, protocol: str = "test") -> float:
        value = self.metrics.registry.get_sample_value(
            "taproom_ingest_rejected_items_total", {"protocol": protocol, "reason": reason}
        )
        return value or 0


@contextlib.asynccontextmanager
async def bound(kind, *, max_message=MiB, subscribe=(), config=None, holder=None, text=""):
    hub = Hub(text)
    sock = ZmtpSocket(
        kind,
        hub=hub,
        protocol="test",
        name=LISTENER[kind],
        max_message_bytes=max_message,
        subscribe=subscribe,
        config=config,
        holder=holder,
    )
    await sock.bind("127.0.0.1", 0)
    try:
        yield sock, hub
    finally:
        sock.close()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def peer(ctx, kind, address, **options):
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        s.setsockopt(getattr(zmq, name), value)
    s.connect("tcp://" + address)
    return s


async def receive(sock, n, max_frames=16, timeout=10.0):
    """``n`` messages from the socket's burst reader: [(count, frames)]."""
    reader = sock.reader(max_frames)
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)} of {n} messages"
        await asyncio.wait_for(sock.wait_readable(), left)
        got += list(reader.recv(1000, 1 << 30).messages())
    return got


async def until(condition, timeout=10.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} never held"
        await asyncio.sleep(0.01)


def raw_peer(address, socket_type=b"DEALER", minor=1, identity=b""):
    """A plain TCP socket that has done a NULL handshake as ``socket_type``."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    props = {b"Socket-Type": socket_type}
    if identity:
        props[b"Identity"] = identity
    s.sendall(
        zp.Greeting(3, minor, b"NULL", False).serialize()
        + zp.encode_command(b"READY", zp.encode_metadata(props))
    )
    got = b""
    while len(got) < 64:
        got += s.recv(64 - len(got))
    assert zp.Greeting.parse(got).minor == 1
    return s


def read_frame(s):
    head = s.recv(2, socket.MSG_WAITALL)
    size = head[1]
    if head[0] & zp.Flag.LONG:
        size = int.from_bytes(head[1:] + s.recv(7, socket.MSG_WAITALL), "big")
    return head[0], s.recv(size, socket.MSG_WAITALL) if size else b""


class TestPeers:
    async def test_dealer_and_req_on_a_router_replies_go_back(self, ctx):
        async with bound("ROUTER") as (sock, _hub):
            dealer = peer(ctx, zmq.DEALER, sock.address)
            named = peer(ctx, zmq.DEALER, sock.address, ROUTING_ID=b"agent-7")
            req = peer(ctx, zmq.REQ, sock.address)
            dealer.send_multipart([b"", b"a", b"b"])
            named.send_multipart([b"x"])
            req.send(b"question")
            got = await receive(sock, 3)
            by_body = {frames[-1]: frames for _, frames in got}
            assert by_body[b"b"][1:] == [b"", b"a", b"b"]
            assert by_body[b"x"] == [b"agent-7", b"x"]  # the peer's Identity routes
            assert by_body[b"question"][1:] == [b"", b"question"]  # REQ's delimiter
            assert by_body[b"b"][0][0] == 0 and len(by_body[b"b"][0]) == 5  # libzmq's form
            assert sock.send([by_body[b"b"][0], b"", b"202"])
            assert sock.send([b"agent-7", b"hi"])
            assert sock.send([by_body[b"question"][0], b"", b"answer"])
            assert not sock.send([b"nobody", b"lost"])
            assert await asyncio.to_thread(dealer.recv_multipart) == [b"", b"202"]
            assert await asyncio.to_thread(named.recv_multipart) == [b"hi"]
            assert await asyncio.to_thread(req.recv) == b"answer"

    async def test_push_on_a_pull_in_order_across_peers(self, ctx):
        async with bound("PULL") as (sock, _hub):
            pushes = [peer(ctx, zmq.PUSH, sock.address) for _ in range(3)]
            for k, push in enumerate(pushes):
                for i in range(200):
                    push.send_multipart([b"%d" % k, b"%d" % i, b"y" * (i % 300)])
            got = await receive(sock, 600)
            for k in range(3):
                mine = [int(frames[1]) for _, frames in got if frames[0] == b"%d" % k]
                assert mine == list(range(200))

    @pytest.mark.parametrize("publisher", [zmq.PUB, zmq.XPUB])
    async def test_a_sub_subscribes_its_publishers(self, ctx, publisher):
        async with bound("SUB", subscribe=(b"",)) as (sock, _hub):
            pub = peer(ctx, publisher, sock.address)
            if publisher == zmq.XPUB:  # the subscription comes up to the XPUB
                assert await asyncio.to_thread(pub.poll, 5000)
                assert pub.recv() == b"\x01"
            else:  # a PUB drops until the subscription arrived: send until one is read
                await until(lambda: sock.peers() == 1, what="the handshake")
            deadline = time.monotonic() + 10
            while not sock.readable:
                assert time.monotonic() < deadline
                pub.send_multipart([b"topic", b"row"])
                await asyncio.sleep(0.02)
            got = await receive(sock, 1)
            assert got[0] == (2, [b"topic", b"row"])

    async def test_heartbeats_are_answered_and_the_connection_stays(self, ctx):
        async with bound("ROUTER") as (sock, _hub):
            dealer = peer(ctx, zmq.DEALER, sock.address, HEARTBEAT_IVL=50, HEARTBEAT_TIMEOUT=200)
            dealer.send(b"first")
            (first,) = await receive(sock, 1)
            await asyncio.sleep(1.0)  # 20 PINGs; unanswered, libzmq would reconnect
            dealer.send(b"second")
            (second,) = await receive(sock, 1)
            assert first[1][0] == second[1][0]  # the same connection: the same routing id

    async def test_a_reconnected_peer_is_served_again(self, ctx):
        async with bound("ROUTER") as (sock, _hub):
            for round_ in range(3):
                dealer = peer(ctx, zmq.DEALER, sock.address)
                dealer.send(b"%d" % round_)
                (got,) = await receive(sock, 1)
                assert sock.send([got[1][0], b"ok"])
                assert await asyncio.to_thread(dealer.recv) == b"ok"
                dealer.close(0)
                await until(lambda: sock.peers() == 0, what="the peer gone")

    async def test_zmtp_3_0_peers(self):
        async with bound("PULL") as (pull, _), bound("SUB", subscribe=(b"ab",)) as (sub, _):
            push = await asyncio.to_thread(raw_peer, pull.address, b"PUSH", 0)
            push.sendall(zp.encode_message([b"old", b"peer"]))
            assert await receive(pull, 1) == [(2, [b"old", b"peer"])]
            pub = await asyncio.to_thread(raw_peer, sub.address, b"PUB", 0)
            await asyncio.to_thread(read_frame, pub)  # READY
            # a 3.0 peer gets its subscription as a message: 1, then the topic
            assert await asyncio.to_thread(read_frame, pub) == (0, b"\x01ab")
            pub31 = await asyncio.to_thread(raw_peer, sub.address, b"PUB", 1)
            await asyncio.to_thread(read_frame, pub31)
            assert await asyncio.to_thread(read_frame, pub31) == (
                zp.Flag.COMMAND,
                b"\x09SUBSCRIBEab",
            )
            for s in (push, pub, pub31):
                s.close()


class TestAccess:
    async def test_only_allowed_addresses_are_served(self, ctx):
        text = '[access.logjam_pull]\nallow = ["127.0.0.2"]\n'
        async with bound("PULL", text=text) as (sock, hub):
            port = sock.port
            allowed = ctx.socket(zmq.PUSH)
            allowed.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")
            refused = ctx.socket(zmq.PUSH)
            refused.connect(f"tcp://127.0.0.3:0;127.0.0.1:{port}")
            refused.send(b"from 127.0.0.3")
            allowed.send(b"from 127.0.0.2")
            assert await receive(sock, 1) == [(1, [b"from 127.0.0.2"])]

            def refusals():
                return hub.metrics.registry.get_sample_value(
                    "taproom_access_refused_connections_total",
                    {"listener": "logjam_pull", "reason": "address_not_allowed"},
                )

            await until(lambda: (refusals() or 0) >= 1, what="the refusal counted")
            await asyncio.sleep(0.3)
            assert not sock.readable  # nothing from the refused peer, ever
            allowed.close(0)
            refused.close(0)

    @pytest.mark.parametrize("kind", ["ROUTER", "PULL"])
    async def test_curve_clients_with_a_known_key_only(self, ctx, tmp_path, kind):
        """RFC 26 against libzmq's CURVE client: a known key gets in and its messages (and,
        on a ROUTER, the replies) travel in MESSAGE boxes; an unknown key and a NULL peer are
        refused and counted by taproom.access's reasons."""
        import zmq.auth

        hub_public, hub_secret = zmq.auth.create_certificates(str(tmp_path), "hub")
        clients = tmp_path / "clients"
        clients.mkdir()
        _, known_secret = zmq.auth.create_certificates(str(clients), "known")
        _, stranger_secret = zmq.auth.create_certificates(str(tmp_path), "stranger")
        listener = LISTENER[kind]
        text = (
            f'[access.{listener}]\ncurve_secret_key_file = "{hub_secret}"\n'
            f'curve_allowed_clients = "{clients}"\n'
        )
        server_public, _ = zmq.auth.load_certificate(hub_public)

        def client(secret_file):
            sock = ctx.socket(zmq.DEALER if kind == "ROUTER" else zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if secret_file is not None:
                public, secret = zmq.auth.load_certificate(secret_file)
                sock.curve_publickey, sock.curve_secretkey = public, secret
                sock.curve_serverkey = server_public
            return sock

        async with bound(kind, text=text) as (sock, hub):
            known = client(known_secret)
            known.connect("tcp://" + sock.address)
            for i in range(50):
                known.send_multipart([b"%d" % i, b"x" * (i * 100)])
            got = await receive(sock, 50)
            offset = 1 if kind == "ROUTER" else 0
            assert [frames[offset:] for _, frames in got] == [
                [b"%d" % i, b"x" * (i * 100)] for i in range(50)
            ]
            if kind == "ROUTER":
                assert sock.send([got[0][1][0], b"202", b"y" * 300])
                assert await asyncio.to_thread(known.recv_multipart) == [b"202", b"y" * 300]

            def refusals(reason):
                value = hub.metrics.registry.get_sample_value(
                    "taproom_access_refused_connections_total",
                    {"listener": listener, "reason": reason},
                )
                return value or 0

            stranger, null = client(stranger_secret), client(None)
            for other in (stranger, null):
                other.connect("tcp://" + sock.address)
                other.send(b"never")
            await until(lambda: refusals("curve_key_not_allowed") >= 1, what="the stranger")
            # libzmq's NULL peer hangs up on reading the CURVE greeting (handshake_failed);
            # one that sends its whole greeting first is told mechanism_mismatch
            await until(
                lambda: refusals("mechanism_mismatch") + refusals("handshake_failed") >= 1,
                what="the NULL peer",
            )
            await asyncio.sleep(0.2)
            assert not sock.readable
            for s in (known, stranger, null):
                s.close(0)


class TestServedInTheReadCallback:
    """``wait_readable(direct=...)`` (issue 32): while the service is parked, messages made
    ready by a connection's read are served at the end of that read callback, with no task
    woken; when ``direct`` declines or raises, the parked task wakes as without it."""

    async def test_each_message_is_served_in_the_callback_and_the_task_stays_parked(self, ctx):
        async with bound("PULL") as (sock, hub):
            reader = sock.reader(16)
            served: list[tuple[list[bytes], bool]] = []

            def direct() -> bool:
                for _, frames in reader.recv(1000, 1 << 30).messages():
                    served.append((frames, asyncio.current_task() is None))
                return True

            woke = 0

            async def service() -> None:
                nonlocal woke
                while True:
                    await sock.wait_readable(direct=direct)
                    woke += 1
                    reader.recv(1000, 1 << 30)

            task = asyncio.create_task(service())
            push = peer(ctx, zmq.PUSH, sock.address)
            try:
                for i in range(5):
                    push.send_multipart([b"m", b"%d" % i])
                    await until(lambda i=i: len(served) == i + 1, what=f"message {i} served")
                assert served == [([b"m", b"%d" % i], True) for i in range(5)]
                assert woke == 0 and not sock.readable
                assert hub.commits_now == 5  # what was submitted is committed in place
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @pytest.mark.parametrize("alone", [True, False], ids=["alone", "with_others"])
    async def test_served_in_place_only_as_the_turns_last_callback(self, alone):
        """Served in place only as the turn's last callback: other reads ready in the same
        turn (many peers) are left to the task, which takes them in one burst, as before.
        (A connection's read, played by hand so that the turn's queue is known.)"""
        async with bound("PULL") as (sock, hub):
            calls = 0

            def direct() -> bool:
                nonlocal calls
                calls += 1
                sock._ready.clear()  # took it
                return True

            loop = asyncio.get_running_loop()
            waiting = asyncio.create_task(sock.wait_readable(direct=direct))
            await asyncio.sleep(0)  # parked

            read_done = loop.create_future()

            def read() -> None:  # what Connection.buffer_updated does around its bookkeeping
                sock._reading = True
                sock._mark_ready(types.SimpleNamespace(ready=False, _free=lambda: None))
                sock._reading = False
                sock._serve_deferred()
                read_done.set_result(None)

            loop.call_soon(read)
            if not alone:
                loop.call_soon(lambda: None)  # another read of this turn, say
            await read_done  # (this task is not in the turn's queue meanwhile)
            await asyncio.sleep(0)
            assert calls == alone and hub.commits_now == alone
            assert waiting.done() is not alone
            waiting.cancel()

    @pytest.mark.parametrize("outcome", ["declines", "raises"])
    async def test_the_task_wakes_when_direct_does_not_take_everything(self, ctx, outcome):
        """``direct`` declining (e.g. the hub is full) wakes the task; ``direct`` raising (a
        bug) raises in the task, as if it had run the code (a supervised loop dies and is
        restarted); either way the message is still there for it."""
        async with bound("PULL") as (sock, hub):
            calls = 0

            def direct() -> bool:
                nonlocal calls
                calls += 1
                if outcome == "raises":
                    raise RuntimeError("a bug in the service")
                return False

            waiting = asyncio.create_task(sock.wait_readable(direct=direct))
            await asyncio.sleep(0)  # parked
            push = peer(ctx, zmq.PUSH, sock.address)
            push.send_multipart([b"left", b"for the task"])
            if outcome == "raises":
                with pytest.raises(RuntimeError, match="a bug in the service"):
                    await asyncio.wait_for(waiting, 10)
            else:
                assert await asyncio.wait_for(waiting, 10) is True
            assert calls == 1
            assert list(sock.reader(16).recv(10, 1 << 20).messages()) == [
                (2, [b"left", b"for the task"])
            ]
            assert hub.rejected("internal_error") == 0  # not a connection's: the service's
            assert hub.commits_now == 0


class TestRefusals:
    async def test_wrong_socket_types_are_refused_and_counted(self, ctx):
        async with bound("ROUTER") as (sock, hub):
            pub = peer(ctx, zmq.PUB, sock.address)
            push = peer(ctx, zmq.PUSH, sock.address)
            push.send(b"never")
            await until(lambda: hub.rejected("socket_type") >= 2, what="two refusals")
            assert not sock.readable
            pub.close(0)
            push.close(0)

    async def test_handshake_and_message_timeouts(self):
        config = ZmtpConfig(handshake_timeout_s=0.2, partial_timeout_s=0.3)
        async with bound("PULL", config=config) as (sock, hub):
            host, port = sock.address.rsplit(":", 1)
            silent = socket.create_connection((host, int(port)))
            half = await asyncio.to_thread(raw_peer, sock.address, b"PUSH")
            half.sendall(zp.encode_frame(b"first", zp.Flag.MORE))
            await until(lambda: hub.rejected("handshake_timeout") == 1, what="handshake timeout")
            await until(lambda: hub.rejected("partial_timeout") == 1, what="partial timeout")
            assert sock.buffered == 0 and sock.holder.used == 0
            silent.close()
            half.close()

    async def test_unfinished_multipart_messages_cost_at_most_their_bound(self, ctx):
        """Issue 26.2: 40 x 1 MiB frames flagged MORE, never the last, from 5 peers: each is
        disconnected when its message passes the bound, counted, and what the socket held
        never passed 5 x the bound; an honest peer is served throughout."""
        holder = Holder("test", 64 * MiB)
        async with bound("ROUTER", max_message=8 * MiB, holder=holder) as (sock, hub):
            frame = zp.encode_frame(b"a" * MiB, zp.Flag.MORE)
            peak = 0

            def attack():
                with contextlib.ExitStack() as stack:
                    for _ in range(5):
                        s = stack.enter_context(raw_peer(sock.address))
                        with contextlib.suppress(OSError):
                            for _ in range(40):
                                s.sendall(frame)

            attacking = asyncio.create_task(asyncio.to_thread(attack))
            honest = peer(ctx, zmq.DEALER, sock.address)
            served = 0
            while not attacking.done() or served < 20:
                honest.send(b"%d" % served)
                await receive(sock, 1)
                served += 1
                peak = max(peak, holder.used)
            await attacking
            await until(lambda: hub.rejected("message_too_large") == 5, what="5 refusals")
            assert peak <= 5 * (8 * MiB + 16) + 5 * 262144
            await until(lambda: holder.used == sock.buffered, what="the buffers released")
            assert sock.buffered <= 262144  # the honest peer's, at most

    async def test_a_connection_that_is_not_taken_from_is_pushed_back_by_tcp(self, ctx):
        async with bound("PULL") as (sock, _hub):
            push = peer(ctx, zmq.PUSH, sock.address, SNDHWM=10)
            body = b"z" * 10_000
            sent = 0
            stalled = 0.0
            while True:  # until the sender stays blocked for half a second
                try:
                    push.send_multipart([b"%d" % sent, body], zmq.NOBLOCK)
                    sent += 1
                    stalled = 0.0
                except zmq.Again:
                    stalled = stalled or time.monotonic()
                    if time.monotonic() - stalled > 0.5:
                        break
                    await asyncio.sleep(0.01)
            assert sent < 2000  # kernel buffers and a connection buffer, not everything
            assert sock.buffered <= 262144
            got = await receive(sock, sent)
            assert [int(frames[0]) for _, frames in got] == list(range(sent))

    async def test_a_message_waits_for_budget_then_goes_through(self, ctx):
        holder = Holder("test", 4 * MiB)
        async with bound("PULL", max_message=8 * MiB, holder=holder) as (sock, _hub):
            holder.try_reserve(4 * MiB - 100_000)  # someone else holds nearly all of it
            push = peer(ctx, zmq.PUSH, sock.address)
            push.send(b"b" * (2 * MiB))
            await asyncio.sleep(0.5)
            assert not sock.readable  # no room: not read
            holder.release(4 * MiB - 100_000)
            got = await receive(sock, 1)
            assert got[0][1][0] == b"b" * (2 * MiB)
