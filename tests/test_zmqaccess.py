"""Access control on every ZeroMQ listener (taproom/zmqaccess.py), over real sockets: the
allowlist through the hub's ZAP handler with clients bound to their own source addresses, and
CURVE with taproom's own logjam and Event BUS clients (issue 27)."""

from __future__ import annotations

import asyncio
import struct
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
import zmq.auth

from taproom.clients.eventbus import EventBusClient
from taproom.clients.logjam import LogjamAgent, LogjamConsumer, ReplyError
from taproom.journal import JournalReader
from taproom.metrics import Metrics
from taproom.protocols import logjam as lj
from taproom.protocols.lager.chp import snapshot_request_frames
from taproom.zmqaccess import ZmqAccess
from tests.support import load, running_app, write_config

ALLOWED, REFUSED = "127.0.0.2", "127.0.0.3"

# The socket type a client of each listener uses.
PEER = {
    "logjam_router": zmq.DEALER,
    "logjam_pull": zmq.PUSH,
    "logjam_pub": zmq.SUB,
    "logjam_replay": zmq.DEALER,
    "eventbus_snapshot": zmq.DEALER,
    "eventbus_publisher": zmq.SUB,
    "eventbus_collector": zmq.DEALER,
    "eventbus_chp_snapshot": zmq.DEALER,
    "eventbus_chp_publisher": zmq.SUB,
    "eventbus_chp_collector": zmq.PUB,
    "lager_registrar_snapshot": zmq.DEALER,
    "lager_registrar_publisher": zmq.SUB,
    "lager_registrar_collector": zmq.PUB,
    "lager_forwarder_in": zmq.PUB,
    "lager_forwarder_out": zmq.SUB,
    "lager_forwarder_counted": zmq.SUB,
}
SECTIONS = {
    "logjam": {"heartbeat_interval_s": 0.05},
    "eventbus": {"chp": True},
    "lager": {},
}
_HANDSHAKE = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def refused(app: Any, listener: str, reason: str) -> float:
    value = app.hub.metrics.registry.get_sample_value(
        "taproom_access_refused_connections_total", {"listener": listener, "reason": reason}
    )
    return value or 0.0


def wait_for(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def connect_from(ctx: zmq.Context[Any], kind: int, source: str, address: str) -> zmq.Socket[Any]:
    sock = ctx.socket(kind)
    sock.linger = 0
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://{source}:0;{address}")  # ZeroMQ's source-address form
    return sock


def message(topic: bytes, source: str) -> list[bytes]:
    body = f'"{source}"'.encode()
    return lj.encode_message(
        b"access-test", topic, body, compression=0, device=0, created_ms=1, sequence=1
    )


def handshake(sock: zmq.Socket[Any], monitor: zmq.Socket[Any], timeout: float = 10.0) -> str:
    """What the client's own monitor says of its first handshake: ok, or how it failed."""
    from zmq.utils.monitor import recv_monitor_message

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if monitor.poll(100):
            event = recv_monitor_message(monitor)
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "ok"
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return f"refused {event['value']}"
            return f"failed {hex(event['value'])}"
    return "no handshake"


@pytest.mark.parametrize("section", sorted(SECTIONS))
async def test_allowlist_on_every_zeromq_listener(tmp_path: Path, section: str) -> None:
    """Each listener binds 127.0.0.1 and allows 127.0.0.2 only: a client from 127.0.0.2
    finishes its handshake, one from 127.0.0.3 is refused by the ZAP handler and counted."""
    tables = {
        section: SECTIONS[section],
        "access": {section: {"allow": [ALLOWED]}},
    }
    async with running_app(tmp_path, enable=[section], **tables) as app:  # type: ignore[arg-type]
        listeners = [name for name in PEER if name in app.addresses]
        assert len(listeners) == (4 if section == "logjam" else 6)

        def attempt() -> dict[str, tuple[str, str]]:
            ctx = zmq.Context()
            outcome = {}
            try:
                for name in listeners:
                    result = []
                    for source in (ALLOWED, REFUSED):
                        sock = ctx.socket(PEER[name])
                        sock.linger = 0
                        monitor = sock.get_monitor_socket(_HANDSHAKE)
                        sock.connect(f"tcp://{source}:0;{app.addresses[name]}")
                        result.append(handshake(sock, monitor))
                        sock.disable_monitor()
                        monitor.close(0)
                        sock.close(0)
                    outcome[name] = (result[0], result[1])
            finally:
                ctx.destroy(0)
            return outcome

        outcome = await asyncio.to_thread(attempt)
        assert outcome == {name: ("ok", "refused 400") for name in listeners}
        for name in listeners:
            assert refused(app, name, "address_not_allowed") >= 1, name


async def test_refused_peers_deliver_nothing_and_allowed_ones_are_served(tmp_path: Path) -> None:
    """Data, replies and broadcasts: logjam PUSH and DEALER, its PUB output, the Event BUS
    collector and the Lager registrar's snapshot, each from 127.0.0.2 (allowed) and .3."""
    tables: dict[str, Any] = {
        "logjam": {"heartbeat_interval_s": 0.05},
        "access": {"allow": [ALLOWED]},
    }
    async with running_app(tmp_path, enable=["logjam", "eventbus", "lager"], **tables) as app:
        addr = app.addresses

        def exercise() -> dict[str, Any]:
            ctx = zmq.Context()
            got: dict[str, Any] = {}
            try:
                for source in (REFUSED, ALLOWED):  # the refused peer goes first
                    push = connect_from(ctx, zmq.PUSH, source, addr["logjam_pull"])
                    push.send_multipart(message(b"logs.pull", source))
                    dealer = connect_from(ctx, zmq.DEALER, source, addr["logjam_router"])
                    dealer.send_multipart([b"", *message(b"logs.dealer", source)])
                    collector = connect_from(ctx, zmq.DEALER, source, addr["eventbus_collector"])
                    collector.send_multipart(
                        [
                            f"/access/{source}/".encode(),
                            struct.pack(">Q", 0),
                            b"access-test",
                            b"2024-01-01T00:00:00Z",
                            str(uuid.uuid4()).encode(),
                            msgpack.packb(source),
                        ]
                    )
                    snapshot = connect_from(
                        ctx, zmq.DEALER, source, addr["lager_registrar_snapshot"]
                    )
                    snapshot.send_multipart(snapshot_request_frames(""))
                    sub = connect_from(ctx, zmq.SUB, source, addr["logjam_pub"])
                    wait = 1000 if source == REFUSED else 10_000
                    got[source] = {
                        "reply": dealer.poll(wait) and dealer.recv_multipart(),
                        "snapshot": snapshot.poll(wait) and snapshot.recv_multipart(),
                        "pub": sub.poll(wait) and sub.recv_multipart()[0],
                    }
            finally:
                ctx.destroy(0)
            return got

        got = await asyncio.to_thread(exercise)
        assert got[REFUSED] == {"reply": 0, "snapshot": 0, "pub": 0}
        assert got[ALLOWED]["reply"] == [b"access-test", b"202 Accepted"]
        assert got[ALLOWED]["snapshot"][0] == b"KTHXBAI"
        # a heartbeat, or an event published from the journal: the PUB output serves it
        assert got[ALLOWED]["pub"]

        def journaled() -> list[bytes]:
            return [r.payload for r in app.hub.journal.read(0)]

        await asyncio.to_thread(
            wait_for, lambda: len(journaled()) >= 3, "the allowed peer's three events"
        )
        payloads = journaled()
        assert payloads.count(f'"{ALLOWED}"'.encode()) == 2  # PUSH and DEALER bodies
        assert msgpack.packb(ALLOWED) in payloads
        assert not any(REFUSED.encode() in p for p in payloads)
        for name in ("logjam_pull", "logjam_router", "eventbus_collector", "logjam_pub"):
            assert refused(app, name, "address_not_allowed") >= 1, name


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """The hub's pair, a known client (its public key in the clients directory) and an
    unknown one, as `taproom access keygen` writes them."""
    clients = tmp_path / "clients"
    clients.mkdir()
    made: dict[str, Path] = {"clients": clients}
    for name, where in (("hub", tmp_path), ("known", tmp_path), ("unknown", tmp_path)):
        public, secret = zmq.auth.create_certificates(str(where), name)
        made[name], made[f"{name}_secret"] = Path(public), Path(secret)
    (clients / "known.key").write_bytes(made["known"].read_bytes())
    return made


def _curve_tables(keys: dict[str, Path], section: str) -> dict[str, Any]:
    rule = {
        "curve_secret_key_file": str(keys["hub_secret"]),
        "curve_allowed_clients": str(keys["clients"]),
    }
    return {"access": {section: rule}}


async def test_curve_with_the_logjam_clients(tmp_path: Path, keys: dict[str, Path]) -> None:
    tables = {"logjam": {"heartbeat_interval_s": 0.05}, **_curve_tables(keys, "logjam")}
    async with running_app(tmp_path, enable=["logjam"], **tables) as app:  # type: ignore[arg-type]
        router = "tcp://" + app.addresses["logjam_router"]
        known = (str(keys["hub"]), str(keys["known_secret"]))

        def clients() -> dict[str, Any]:
            out: dict[str, Any] = {}
            with LogjamAgent(router, app_env="curve-test", curve=known, timeout=10) as agent:
                out["known"] = agent.send({"who": "known"})
            stranger = (str(keys["hub"]), str(keys["unknown_secret"]))
            for name, curve in (("unknown", stranger), ("null", None)):
                with LogjamAgent(router, app_env="curve-test", curve=curve, timeout=1) as agent:
                    try:
                        out[name] = agent.send({"who": name})
                    except ReplyError:
                        out[name] = None
            consumer = LogjamConsumer(
                "tcp://" + app.addresses["logjam_pub"], return_heartbeats=True, curve=known
            )
            try:
                message = consumer.recv(10)
                out["pub"] = message.app_env if message is not None else None
            finally:
                consumer.close()
            return out

        out = await asyncio.to_thread(clients)
        assert out == {
            "known": b"202 Accepted",
            "unknown": None,
            "null": None,
            "pub": lj.HEARTBEAT_APP_ENV.decode(),
        }
        assert refused(app, "logjam_router", "curve_key_not_allowed") >= 1
        # libzmq names the mechanism when it read the NULL greeting before the peer hung up
        await asyncio.to_thread(
            wait_for,
            lambda: (
                refused(app, "logjam_router", "mechanism_mismatch")
                + refused(app, "logjam_router", "handshake_failed")
                >= 1
            ),
            "the NULL peer refused and counted",
        )
        payloads = [r.payload for r in app.hub.journal.read(0)]
        assert payloads == [b'{"who":"known"}']


async def test_curve_with_the_eventbus_client(tmp_path: Path, keys: dict[str, Path]) -> None:
    async with running_app(tmp_path, enable=["eventbus"], **_curve_tables(keys, "eventbus")) as app:
        server = ["tcp://" + app.addresses["eventbus_snapshot"]]
        known = EventBusClient(server, ["/"], curve=(str(keys["hub"]), str(keys["known_secret"])))
        await known.start(timeout=20)
        try:
            future = await known.publish("/curve/known/", {"ok": True})
            assert await asyncio.wait_for(future, 20) == 1
        finally:
            await known.stop()
        for _name, curve in (
            ("unknown", (str(keys["hub"]), str(keys["unknown_secret"]))),
            ("null", None),
        ):
            client = EventBusClient(server, ["/"], curve=curve, server_timeout=0.5)
            with pytest.raises(TimeoutError):
                await client.start(timeout=2)
            await client.stop()
        assert refused(app, "eventbus_snapshot", "curve_key_not_allowed") >= 1
        # The NULL client: the mechanism named, or (it hung up first) the bus's own count
        # of handshakes refused by ZeroMQ.
        handshakes = app.hub.metrics.registry.get_sample_value(
            "taproom_ingest_rejected_items_total",
            {"protocol": "eventbus", "reason": "handshake_refused"},
        )
        mismatches = sum(
            refused(app, f"eventbus_{name}", "mechanism_mismatch")
            for name in ("snapshot", "publisher", "collector")
        )
        assert mismatches + (handshakes or 0) >= 1
        assert [r.topic for r in app.hub.journal.read(0)] == ["/curve/known/"]


async def test_curve_flags_of_taproom_send(tmp_path: Path, keys: dict[str, Path]) -> None:
    """`taproom send logjam --curve-server-key --curve-key-file` reaches a CURVE listener; the
    same command without them is refused."""
    async with running_app(tmp_path, enable=["logjam"], **_curve_tables(keys, "logjam")) as app:
        endpoint = "tcp://" + app.addresses["logjam_router"]
        base = [sys.executable, "-m", "taproom", "send", "logjam", "--endpoint", endpoint]
        flags = ["--curve-server-key", str(keys["hub"]), "--curve-key-file"]
        results = []
        for extra in ([*flags, str(keys["known_secret"])], ["--timeout", "1"]):
            proc = await asyncio.create_subprocess_exec(
                *base, *extra, '{"via": "cli"}', stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _out, err = await asyncio.wait_for(proc.communicate(), 60)
            results.append((proc.returncode, err.decode()))
        assert results[0][0] == 0, results[0][1]
        assert results[1][0] == 1 and "no reply" in results[1][1]


class TestZapRequests:
    """The handler's answers to requests libzmq would never send malformed: still answered."""

    def access(self, tmp_path: Path) -> ZmqAccess:
        config = load(write_config(tmp_path, access={"allow": [ALLOWED]}))
        ctx = zmq.asyncio.Context()
        zmq_access = ZmqAccess(ctx, config, Metrics())
        sock = ctx.socket(zmq.PULL)
        zmq_access.secure(sock, "logjam_pull")
        zmq_access.close()
        sock.close(0)
        ctx.term()
        return zmq_access

    @pytest.mark.parametrize(
        ("body", "status"),
        [
            ([b"1.0", b"7", b"logjam_pull", ALLOWED.encode(), b"", b"NULL"], b"200"),
            ([b"1.0", b"7", b"logjam_pull", REFUSED.encode(), b"", b"NULL"], b"400"),
            ([b"1.0", b"7", b"logjam_pull", ALLOWED.encode(), b"", b"PLAIN", b"u", b"p"], b"400"),
            ([b"1.0", b"7", b"logjam_pub", ALLOWED.encode(), b"", b"NULL"], b"400"),
            ([b"2.0", b"7", b"logjam_pull", ALLOWED.encode(), b"", b"NULL"], b"500"),
            ([b"1.0", b"7"], b"500"),
        ],
    )
    def test_answers(self, tmp_path: Path, body: list[bytes], status: bytes) -> None:
        reply = self.access(tmp_path).answer([b"peer", b"", *body])
        assert reply is not None and reply[:3] == [b"peer", b"", b"1.0"]
        assert reply[4] == status and reply[3] == b"7"

    def test_no_envelope_no_answer(self, tmp_path: Path) -> None:
        assert self.access(tmp_path).answer([b"1.0", b"7"]) is None


async def test_a_binary_star_pair_over_curve(tmp_path: Path, keys: dict[str, Path]) -> None:
    """Both servers of a pair share one key pair (their clients fail over with one server key)
    and link to each other with it: the backup copies the primary's state and becomes a
    synced passive; a CURVE client's update reaches both, a NULL peer neither."""
    from tests.servers.test_eventbus import _wait_synced_passive, start_pair

    # The hub's own public key is among the clients: the peer link connects with it.
    (keys["clients"] / "hub.key").write_bytes(keys["hub"].read_bytes())
    rule = {
        "curve_secret_key_file": str(keys["hub_secret"]),
        "curve_allowed_clients": str(keys["clients"]),
    }
    curve = (str(keys["hub"]), str(keys["known_secret"]))
    primary, backup = await start_pair(tmp_path, access={"eventbus": rule}, curve=curve)
    try:
        servers = ["tcp://" + s.addresses["eventbus_snapshot"] for s in (primary, backup)]
        client = await EventBusClient(servers, ["/"], curve=curve).start(timeout=20)
        try:
            future = await client.publish("/pair/curve/", 1)
            sequence = await asyncio.wait_for(future, 20)
        finally:
            await client.stop()
        assert sequence == 1
        await _wait_synced_passive(backup.addresses["eventbus_publisher"], curve=curve)
        stranger = EventBusClient(servers, ["/"], server_timeout=0.5)
        with pytest.raises(TimeoutError):
            await stranger.start(timeout=2)
        await stranger.stop()
    finally:
        primary.stop()
        backup.stop()
    journals = [
        [r.topic for r in JournalReader(str(tmp_path / name / "journal")).read(0)]
        for name in ("p", "b")
    ]
    # replicated to the backup (whose journal also holds the copy's marker record)
    assert journals[0] == ["/pair/curve/"] and "/pair/curve/" in journals[1]
