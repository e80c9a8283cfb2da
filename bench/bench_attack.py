"""Hostile senders (issues 18 and 19): the hub's peak RSS under each attack, with the defaults.

The promise is ``hub.max_pending_bytes``: whatever a sender does, the hub's peak RSS should
stay within ``2 x max_pending_bytes + 100 MB`` (the goal printed beside each figure). Every
attack runs against a fresh ``taproom serve`` child (default settings, journal in a temporary
directory, only the attacked protocol and the web listener on), while an honest sender of the
same protocol keeps sending; the figure is the child's VmHWM, and a second line says how many
of the honest sender's events were acknowledged meanwhile.

The table is :data:`ATTACKS`: one :class:`Attack` per row, so other protocols add theirs by
appending rows (an ``attack`` callable gets the hub's listener addresses and returns when done;
``honest`` keeps the protocol's ordinary traffic going and returns the events acked).
``tests/test_probe.py`` runs the same rows under ``make soak``.

Issue 26's attacks (one process-wide budget, whatever the number of connections) are the
second table, :data:`SCALED`: each :class:`ScaledAttack` takes the number of attacking
connections, and :func:`run_scaled` runs it at 1, 8 and 64 against a hub with every protocol
on, while honest Lumberjack, logjam and LogTK senders keep going and ``/health`` is polled
(:class:`HonestLoad`, :class:`HealthWatch`); :func:`run_all_at_once` runs every row together
against one hub (``tests/test_memory_attacks.py``): zlib bombs, the Event BUS hashmap flood,
slow PUB subscribers, unfinished ZeroMQ multi-part messages.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import tempfile
import threading
import time
import urllib.request
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import orjson
import zmq
from tests.hubprocess import HubProcess

from taproom.clients.lumberjack import LumberjackClient
from taproom.config import HubConfig, known_sections
from taproom.protocols.lumberjack import CompressedFrame, JsonFrame, WindowSizeFrame
from taproom.servers import SERVICE_MODULES

from .common import Figure, rss_of_pid_kib

__all__ = ["ATTACKS", "Attack", "AttackHub", "run"]

MiB = 1 << 20
Addresses = dict[str, tuple[str, int]]


@dataclass(frozen=True)
class Attack:
    """One row: what it does, to which protocol, and how an honest sender of it behaves."""

    name: str
    protocol: str  # the section enabled in the hub under attack
    attack: Callable[[Addresses, threading.Event], None]
    honest: Callable[[Addresses, threading.Event], int]
    settings: tuple[tuple[str, str, object], ...] = ()  # (section, key, value) beyond defaults


class AttackHub:
    """``taproom serve`` with the defaults, one protocol and the web listener on port 0."""

    def __init__(self, workdir: Path, protocol: str, settings: tuple = ()) -> None:
        self.workdir = workdir
        tables: dict[str, dict[str, object]] = {
            "journal": {"dir": str(workdir / "journal")},
            "web": {"port": 0},
        }
        for name in SERVICE_MODULES:
            if name in known_sections():
                tables[name] = {"enabled": name == protocol}
        ports = [f for f in known_sections()[protocol].__dataclass_fields__ if f.endswith("port")]
        tables[protocol].update(dict.fromkeys(ports, 0))
        for section, key, value in settings:
            tables.setdefault(section, {})[key] = value
        lines: list[str] = []

        def table(name: str, values: dict[str, object]) -> None:
            lines.append(f"[{name}]")
            nested = {k: v for k, v in values.items() if isinstance(v, dict)}
            lines.extend(
                f"{k} = {orjson.dumps(v).decode()}" for k, v in values.items() if k not in nested
            )
            for key, value in nested.items():
                table(f"{name}.{key}", value)  # type: ignore[arg-type]

        for name, values in tables.items():
            table(name, values)
        config = workdir / "attack.toml"
        config.write_text("\n".join(lines) + "\n")
        self.hub = HubProcess(config).start()
        self.proc = self.hub.proc
        self.log = self.hub.log_path
        self.addresses: Addresses = {}
        for name, text in self.hub.addresses.items():
            host, port = text.rsplit(":", 1)
            self.addresses[name] = (host, int(port))

    def status_kib(self, field: str) -> int:
        return rss_of_pid_kib(self.proc.pid, field)

    def stop(self) -> None:
        self.hub.stop(30)


# --- Lumberjack -------------------------------------------------------------------------------


def _json_frame(seq: int, payload_bytes: int) -> bytes:
    payload = b'{"pad":"' + b"a" * (payload_bytes - 10) + b'"}'
    return JsonFrame(seq, payload).serialize()


def lumberjack_honest(addresses: Addresses, stop: threading.Event) -> int:
    """A Filebeat-like sender: windows of 100 small events until told to stop."""
    host, port = addresses["lumberjack"]
    acked = 0
    with LumberjackClient(host, port, window_size=100, timeout=60) as client:
        while not stop.is_set():
            acked += client.send({"message": f"honest {acked + i}"} for i in range(100))
    return acked


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def _await_close(sock: socket.socket, seconds: float) -> None:
    sock.settimeout(seconds)
    with contextlib.suppress(OSError):
        while sock.recv(65536):
            pass


def lumberjack_nested_compression(addresses: Addresses, stop: threading.Event) -> None:
    """Issue 19 item 6: one small 2C frame holding 8 C frames of 63 MiB each (520 MB once)."""
    inner = WindowSizeFrame(1).serialize() + CompressedFrame.compress(_json_frame(1, 63 * MiB), 9)
    frame = CompressedFrame.compress(inner * 8, 9)
    with socket.create_connection(addresses["lumberjack"]) as sock:
        _send_quietly(sock, frame)
        _await_close(sock, 120)


def lumberjack_compressed_burst(addresses: Addresses, stop: threading.Event) -> None:
    """Valid windows packed tight: 8 small C frames in one read, each inflating to 40 MiB of
    10 MiB events, Filebeat's largest (once all submitted from one read: 320 MB pending)."""
    events = b"".join(_json_frame(seq, 10 * MiB) for seq in range(1, 5))
    one = WindowSizeFrame(4).serialize() + CompressedFrame.compress(events, 9)
    with socket.create_connection(addresses["lumberjack"]) as sock:
        _send_quietly(sock, one * 8)
        acks = b""
        sock.settimeout(300)
        while not acks.endswith(b"2A\0\0\0\x04" * 1) or acks.count(b"2A\0\0\0\x04") < 8:
            try:
                chunk = sock.recv(64)
            except OSError:
                break
            if not chunk:
                break
            acks += chunk


def lumberjack_partial_frames(addresses: Addresses, stop: threading.Event) -> None:
    """Issue 19 item 9: 20 connections each holding 15 MiB of an unfinished 16 MiB frame."""
    head = WindowSizeFrame(1).serialize() + _json_frame(1, 16 * MiB - 64)[: 15 * MiB]
    socks = [socket.create_connection(addresses["lumberjack"]) for _ in range(20)]
    try:
        senders = []
        for sock in socks:
            sock.settimeout(10)  # a connection the hub does not read blocks: give up then
            sender = threading.Thread(target=_send_quietly, args=(sock, head))
            sender.start()
            senders.append(sender)
        for sender in senders:
            sender.join()
        time.sleep(2)  # hold them while the honest sender goes on
    finally:
        for sock in socks:
            sock.close()


def lumberjack_idle_sockets(addresses: Addresses, stop: threading.Event) -> None:
    """Issue 19 item 9: 4,096 idle sockets from one host (they locked out every new shipper)."""
    socks = []
    try:
        for _ in range(4096):
            with contextlib.suppress(OSError):
                socks.append(socket.create_connection(addresses["lumberjack"], timeout=5))
        time.sleep(2)
    finally:
        for sock in socks:
            sock.close()


def lumberjack_zlib_bomb(addresses: Addresses, stop: threading.Event) -> None:
    """A 1 KiB triple-nested C frame that would inflate to 1 GiB, three times."""
    comp = zlib.compressobj(9)
    block = bytes(MiB)
    stream = comp.compress(block) + comp.flush(zlib.Z_FULL_FLUSH)
    middle = comp.compress(block) + comp.flush(zlib.Z_FULL_FLUSH)
    stream += middle * 1022 + comp.flush()[:-4] + struct.pack(">I", ((1 << 30) % 65521) << 16 | 1)
    frame = CompressedFrame(stream).serialize()
    for _ in range(2):
        frame = CompressedFrame.compress(frame, 9)
    for _ in range(3):
        with socket.create_connection(addresses["lumberjack"]) as sock:
            _send_quietly(sock, WindowSizeFrame(1).serialize() + frame)
            _await_close(sock, 60)


# --- Event BUS ----------------------------------------------------------------------------


def _bus_pub(topic: bytes, data: bytes) -> list[bytes]:
    return [topic, bytes(8), b"attack", b"2026-11-22T08:00:00Z", str(uuid.uuid4()).encode(), data]


def eventbus_honest(addresses: Addresses, stop: threading.Event) -> int:
    """A seed client publishing small updates to ten topics, each confirmed by its BROADCAST."""
    import asyncio

    from taproom.clients.eventbus import EventBusClient

    host, port = addresses["eventbus_snapshot"]

    async def go() -> int:
        confirmed = 0
        async with EventBusClient([f"tcp://{host}:{port}"], server_timeout=30) as client:
            while not stop.is_set():
                await asyncio.wait_for(await client.publish(f"/honest/{confirmed % 10}", 1), 60)
                confirmed += 1
        return confirmed

    return asyncio.run(go())


def eventbus_hashmap_flood(addresses: Addresses, stop: threading.Event) -> None:
    """Issue 19 item 10: 300 topics of 1 MiB each (1.63 GB of RSS before the hashmap's bound)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("tcp://{}:{}".format(*addresses["eventbus_collector"]))
    value = msgpack.packb(b"v" * (MiB - 64), use_bin_type=True)
    for i in range(300):
        dealer.send_multipart(_bus_pub(b"/flood/%d" % i, value))
    time.sleep(5)  # committed, refused or broadcast by now
    dealer.close(linger=0)
    ctx.term()


def eventbus_long_subscriptions(addresses: Addresses, stop: threading.Event) -> None:
    """Issue 19 item 10: four subscribers with 1 MiB prefixes (+264 MB before the bound).
    Written in ZMTP by hand: a libzmq SUB would keep the same 1 MiB-deep trie itself."""
    host, port = addresses["eventbus_publisher"]
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 3) + b"SUB"
    body = b"\x01" + b"p" * MiB
    for _ in range(4):
        with socket.create_connection((host, port)) as sock:
            _send_quietly(sock, greeting + bytes([0x04, len(ready)]) + ready)
            _send_quietly(sock, b"\x02" + struct.pack(">Q", len(body)) + body)
            _await_close(sock, 30)


# --- ZeroMQ: unfinished multi-part messages (issue 26.2) ------------------------------------


def zmtp_peer(address: tuple[str, int], socket_type: bytes) -> socket.socket:
    """A raw ZMTP 3.0 peer after its greeting and READY (NULL mechanism): libzmq's own
    handshake, written by hand so nothing on this side buffers what is sent."""
    sock = socket.create_connection(address, timeout=10)
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    _send_quietly(sock, greeting + bytes([0x04, len(ready)]) + ready)
    return sock


def zmq_unfinished_multipart(
    targets: tuple[tuple[str, bytes], ...], peers: int, frames: int = 40
) -> Callable[[Addresses, threading.Event], None]:
    """Issue 26.2: ``peers`` connections (spread over the listeners of ``targets``: name and
    the peer's socket type), each sending ``frames`` frames of 1 MiB flagged MORE, never the
    last, then holding the connection for 2 s (libzmq kept every frame: 271 MiB with 5 peers
    on one socket)."""
    frame = b"\x03" + struct.pack(">Q", MiB) + b"m" * MiB  # MORE | LONG

    def attack(addresses: Addresses, stop: threading.Event) -> None:
        socks = []
        try:
            for k in range(peers):
                name, socket_type = targets[k % len(targets)]
                socks.append(zmtp_peer(addresses[name], socket_type))

            def flood(sock: socket.socket) -> None:
                for _ in range(frames):
                    try:
                        sock.sendall(frame)
                    except OSError:
                        return  # disconnected (message_too_large) or not read: done

            senders = [threading.Thread(target=flood, args=(sock,)) for sock in socks]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join()
            time.sleep(2)
        finally:
            for sock in socks:
                sock.close()

    return attack


# --- PUB outputs: subscribers that never read (issue 26 part 3) ------------------------------


def pub_subscriber(address: tuple[str, int], prefix: bytes = b"") -> socket.socket:
    """A raw ZMTP 3.0 SUB that subscribes to ``prefix`` and never reads again: a consumer that
    hangs (a 4 KiB receive buffer, so what it does not read piles up on the publisher's side).
    It subscribes once the publisher's READY is in, with a 3.0 subscription message: libzmq's
    XPUB (4.3.5) refuses a subscription that comes before its own READY went out, and takes
    no 3.1 SUBSCRIBE command, so this is the same attack on libzmq's publisher and taproom's."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(address)
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 3) + b"SUB"
    _send_quietly(sock, greeting + bytes([0x04, len(ready)]) + ready)
    got = b""
    # the publisher's greeting (64 bytes) and its READY command (a short frame): a subscription
    # sent before them would be ignored and the attack would test nothing, so no READY in 30 s
    # (or a closed connection) is the attack's error, not a subscriber that silently is not one
    try:
        while len(got) < 66 or len(got) < 66 + got[65]:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"the publisher closed after {len(got)} bytes")
            got += chunk
    except OSError as exc:
        sock.close()
        raise ConnectionError(f"no greeting and READY from the publisher: {exc!r}") from exc
    subscribe = b"\x01" + prefix
    _send_quietly(sock, bytes([0x00, len(subscribe)]) + subscribe)
    return sock


def logjam_flood(addresses: Addresses, events: int, size: int, app_env: str = "flood-pub") -> None:
    """``events`` logjam events of ``size`` bytes through the PULL port (PUSH: as fast as the
    hub takes them), then until they have all come out of the PUB output (120 s at most): a
    small end marker is sent after them, again every 0.2 s, until a subscriber of ``app_env``
    that reads sees one (the output keeps each sender's order; one marker may be dropped for
    that subscriber while the flood's tail drains, the next is not). Not the output's
    published count: it counts the honest senders' events too, and under their load it passed
    ``events`` before the flood was through (a CI run closed the slow subscribers first, so
    nothing was dropped)."""
    from taproom.clients.logjam import LogjamAgent

    host, port = addresses["logjam_pull"]
    body = b'{"pad":"' + b"f" * max(0, size - 10) + b'"}'
    end = b'{"end":true}'
    ctx = zmq.Context()
    watcher = ctx.socket(zmq.SUB)
    watcher.setsockopt(zmq.RCVHWM, 0)  # libzmq takes all it is sent: the hub's queue drains
    watcher.setsockopt(zmq.SUBSCRIBE, app_env.encode())
    try:
        subscribed = _metric_sum(
            addresses, "taproom_output_subscribers_count", 'output="logjam_pub"'
        )
        watcher.connect("tcp://{}:{}".format(*addresses["logjam_pub"]))
        deadline = time.monotonic() + 30
        while (
            _metric_sum(addresses, "taproom_output_subscribers_count", 'output="logjam_pub"')
            <= subscribed
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        with LogjamAgent(
            f"tcp://{host}:{port}", mode="push", app_env=app_env, timeout=120
        ) as agent:
            for _ in range(events):
                agent.send(body, topic="logs")
            deadline = time.monotonic() + 120
            seen = False
            while not seen and time.monotonic() < deadline:
                agent.send(end, topic="logs")
                until = time.monotonic() + 0.2
                while not seen and (left := until - time.monotonic()) > 0:
                    if watcher.poll(max(1, int(left * 1000))):
                        seen = watcher.recv_multipart()[2] == end
    finally:
        watcher.close(linger=0)
        ctx.term()


def slow_pub_subscribers(
    events: int, size: int, subscribers: int = 1
) -> Callable[[Addresses, threading.Event], None]:
    """Issue 26 attack 3: ``subscribers`` consumers of the logjam PUB that never read, while
    ``events`` x ``size``-byte events go through (20,000 x 16 KB held 420 MiB of libzmq
    queues, 200,000 x 1 KB 229 MiB; nothing counted)."""

    def attack(addresses: Addresses, stop: threading.Event) -> None:
        before = _metric_sum(addresses, "taproom_output_subscribers_count", 'output="logjam_pub"')
        subs = [pub_subscriber(addresses["logjam_pub"]) for _ in range(subscribers)]
        try:
            # the flood once the hub has them all (30 s at most: a hub without this metric,
            # libzmq's PUB before, is flooded then anyway)
            deadline = time.monotonic() + 30
            while (
                _metric_sum(addresses, "taproom_output_subscribers_count", 'output="logjam_pub"')
                < before + subscribers
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            logjam_flood(addresses, events, size)
        finally:
            for sub in subs:
                sub.close()

    return attack


def logjam_honest(addresses: Addresses, stop: threading.Event) -> int:
    """A DEALER agent waiting for each 202 (logjam_agent's sync mode)."""
    from taproom.clients.logjam import LogjamAgent

    host, port = addresses["logjam_router"]
    acked = 0
    with LogjamAgent(f"tcp://{host}:{port}", app_env="honest-test", timeout=60) as agent:
        while not stop.is_set():
            if agent.send({"honest": acked}) == b"202 Accepted":
                acked += 1
    return acked


ATTACKS: list[Attack] = [
    Attack(
        "lumberjack nested compression",
        "lumberjack",
        lumberjack_nested_compression,
        lumberjack_honest,
    ),
    Attack(
        "lumberjack compressed burst",
        "lumberjack",
        lumberjack_compressed_burst,
        lumberjack_honest,
    ),
    Attack("lumberjack partial frames", "lumberjack", lumberjack_partial_frames, lumberjack_honest),
    Attack("lumberjack idle sockets", "lumberjack", lumberjack_idle_sockets, lumberjack_honest),
    Attack("lumberjack zlib bomb", "lumberjack", lumberjack_zlib_bomb, lumberjack_honest),
    Attack("eventbus hashmap flood", "eventbus", eventbus_hashmap_flood, eventbus_honest),
    Attack(
        "eventbus 1 MiB subscriptions", "eventbus", eventbus_long_subscriptions, eventbus_honest
    ),
    Attack(
        "logjam ROUTER, 5 peers x unfinished 40 MiB",
        "logjam",
        zmq_unfinished_multipart((("logjam_router", b"DEALER"),), 5),
        logjam_honest,
    ),
    Attack(
        "logjam PULL, 5 peers x unfinished 40 MiB",
        "logjam",
        zmq_unfinished_multipart((("logjam_pull", b"PUSH"),), 5),
        logjam_honest,
    ),
    Attack(
        "logjam ROUTER + PULL, 10 peers x unfinished 40 MiB",
        "logjam",
        zmq_unfinished_multipart((("logjam_router", b"DEALER"), ("logjam_pull", b"PUSH")), 10),
        logjam_honest,
    ),
    Attack(
        "eventbus COLLECTOR, 5 peers x unfinished 40 MiB",
        "eventbus",
        zmq_unfinished_multipart((("eventbus_collector", b"DEALER"),), 5),
        eventbus_honest,
    ),
    Attack(
        "logjam PUB, a subscriber that never reads, 20,000 x 16 KB events",
        "logjam",
        slow_pub_subscribers(20_000, 16_000),
        logjam_honest,
    ),
    Attack(
        "logjam PUB, a subscriber that never reads, 200,000 x 1 KB events",
        "logjam",
        slow_pub_subscribers(200_000, 1_000),
        logjam_honest,
    ),
    Attack(
        "lager forwarder input + registrar collector, 10 peers x unfinished 40 MiB",
        "lager",
        zmq_unfinished_multipart(
            (("lager_forwarder_in", b"PUB"), ("lager_registrar_collector", b"PUB")), 10
        ),
        logjam_honest,  # the same hub's logjam ROUTER: acked through the same budget
        settings=(
            ("logjam", "enabled", True),
            ("logjam", "router_port", 0),
            ("logjam", "pull_port", 0),
            ("logjam", "pub_port", 0),
            ("logjam", "replay_port", 0),
        ),
    ),
]


@dataclass(frozen=True)
class Outcome:
    baseline_mib: float
    peak_mib: float
    honest_acked: int
    hub_alive: bool


def run_attack(row: Attack, workdir: Path) -> Outcome:
    """One row against a fresh hub: its peak RSS and what the honest sender got acked."""
    hub = AttackHub(workdir, row.protocol, row.settings)
    try:
        stop = threading.Event()
        acked: list[int] = []
        honest = threading.Thread(target=lambda: acked.append(row.honest(hub.addresses, stop)))
        honest.start()
        time.sleep(1.0)  # the honest sender is under way, every code path warmed up
        baseline = hub.status_kib("VmRSS") / 1024
        row.attack(hub.addresses, stop)
        time.sleep(1.0)  # the honest sender keeps going after the attack
        stop.set()
        honest.join(120)
        alive = hub.proc.poll() is None
        peak = hub.status_kib("VmHWM") / 1024 if alive else float("nan")
        return Outcome(baseline, peak, acked[0] if acked else 0, alive)
    finally:
        hub.stop()


def goal_mib() -> float:
    """2 x max_pending_bytes + 100 MB, with the default bound."""
    return (2 * HubConfig().max_pending_bytes + 100_000_000) / MiB


# --- issue 26: attacks scaled by connections, against one hub with every protocol on -----------


@dataclass(frozen=True)
class ScaledAttack:
    """One attack of issue 26: ``attack(addresses, connections, full)`` returns when done;
    ``full`` is the issue's size (``make soak``, the bench), else a short real version."""

    name: str
    attack: Callable[[Addresses, int, bool], None]
    # What the hub must have counted once the attack is over: (metric, labels) whose sum grew;
    # labels may be alternatives (a tuple: their sum, whichever the attacker ends with).
    refusals: tuple[tuple[str, str | tuple[str, ...]], ...] = ()
    # every attacking connection is counted: the sum grew by at least their number
    per_connection: bool = False
    # metrics whose growth a failed check prints beside the refusals (what the hub did)
    watched: tuple[tuple[str, str], ...] = ()


LOGTK_TOKEN = bytes(range(1, 65))


def bomb_frame(inflated: int, prefix: bytes = b"") -> bytes:
    """A ``C`` frame whose zlib stream inflates to ``prefix`` and then zeros, ``inflated`` bytes
    in all, built without inflating it (a compressed MiB of zeros repeated; Adler-32 patched)."""
    comp = zlib.compressobj(9)
    block = bytes(MiB)
    head = comp.compress(prefix + block[len(prefix) :]) + comp.flush(zlib.Z_FULL_FLUSH)
    middle = comp.compress(block) + comp.flush(zlib.Z_FULL_FLUSH)
    final = comp.flush()[:-4]
    blocks = inflated // MiB
    # Adler-32 of the content: of the prefix, then of the zeros after it.
    a, b = 1, 0
    for byte in prefix:
        a = (a + byte) % 65521
        b = (b + a) % 65521
    zeros = blocks * MiB - len(prefix)
    b = (b + zeros * a) % 65521
    stream = head + middle * (blocks - 1) + final + struct.pack(">I", (b << 16) | a)
    return CompressedFrame(stream).serialize()


def lumberjack_bombs(addresses: Addresses, connections: int, full: bool) -> None:
    """Attack 1: each connection sends ``2W 1`` and one ``2C`` frame that inflates to 1 GiB
    (``full``; 64 MiB otherwise): a ``J`` frame announcing an event of the largest size the
    hub takes, then zeros (the worst a bomb can do: make the hub inflate one whole event before
    it finds the payload is no JSON)."""
    from taproom.servers.lumberjack import LumberjackConfig

    event = LumberjackConfig().max_event_bytes
    prefix = b"2J" + struct.pack(">II", 1, event)
    frame = WindowSizeFrame(1).serialize() + bomb_frame((1 << 30) if full else 64 * MiB, prefix)

    def one() -> None:
        with socket.create_connection(addresses["lumberjack"]) as sock:
            _send_quietly(sock, frame)
            _await_close(sock, 120)

    threads = [threading.Thread(target=one) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def eventbus_hashmap_dealers(addresses: Addresses, connections: int, full: bool) -> None:
    """Attack 4: ``connections`` DEALERs share 300 topics of valid 1 MiB updates, sent as
    fast as ZeroMQ takes them (the issue's size is quick: short and full are the same)."""
    size = MiB
    value = msgpack.packb(b"v" * (size - 64), use_bin_type=True)
    ctx = zmq.Context()
    try:
        dealers = []
        for _ in range(connections):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.SNDHWM, 8)
            dealer.connect("tcp://{}:{}".format(*addresses["eventbus_collector"]))
            dealers.append(dealer)
        for i in range(300):
            dealers[i % connections].send_multipart(_bus_pub(b"/flood/%d" % i, value))
        time.sleep(3)  # committed, refused or broadcast by now
        for dealer in dealers:
            dealer.close(linger=0)
    finally:
        ctx.term()


def slow_subscribers_scaled(addresses: Addresses, connections: int, full: bool) -> None:
    """Attack 3: ``connections`` subscribers of the logjam PUB that never read while 20,000 x
    16 KB events go through (``full``; 2,000 otherwise)."""
    slow_pub_subscribers(20_000 if full else 2_000, 16_000, connections)(addresses, None)  # type: ignore[arg-type]


# the ingest listeners on taproom's transport a hub with every protocol's defaults has, and
# the socket type of their peers
UNFINISHED_TARGETS = (
    ("logjam_router", b"DEALER"),
    ("logjam_pull", b"PUSH"),
    ("eventbus_collector", b"DEALER"),
    ("lager_forwarder_in", b"PUB"),
    ("lager_registrar_collector", b"PUB"),
)


def unfinished_multipart_scaled(addresses: Addresses, connections: int, full: bool) -> None:
    """Attack 2: ``connections`` raw ZMTP peers spread over every ingest listener, each sending
    frames of 1 MiB flagged MORE and never the last (40: past logjam's 8 MiB bound; 10 in the
    short version: past every bound but logjam's, whose peers then leave mid-message)."""
    zmq_unfinished_multipart(UNFINISHED_TARGETS, connections, 40 if full else 10)(addresses, None)  # type: ignore[arg-type]


SCALED: list[ScaledAttack] = [
    ScaledAttack(
        "zlib bombs",
        lumberjack_bombs,
        (("taproom_ingest_rejected_items_total", 'reason="bad_json"'),),
    ),
    ScaledAttack(
        "eventbus 300 topics of 1 MiB",
        eventbus_hashmap_dealers,
        (("taproom_ingest_rejected_items_total", 'reason="hashmap_full"'),),
    ),
    ScaledAttack(
        "slow PUB subscribers",
        slow_subscribers_scaled,
        (
            (
                "taproom_output_dropped_messages_total",
                # what a subscriber that never reads cannot take is dropped and counted by
                # the bound it met first: its own bytes, its message count, or the output
                # queues' share of the process budget (all at once, the other attacks
                # hold the rest of the budget: one quiet run of the suite counted only
                # output_budget drops); not "disconnected", counted when it goes anyway
                tuple(
                    f'output="logjam_pub",reason="{reason}"'
                    for reason in ("subscriber_bytes", "hwm", "output_budget")
                ),
            ),
        ),
        watched=(
            ("taproom_output_subscribers_count", 'output="logjam_pub"'),
            ("taproom_output_sent_messages_total", 'output="logjam_pub"'),
            ("taproom_output_delivered_messages_total", 'output="logjam_pub"'),
            ("taproom_output_dropped_messages_total", 'reason="disconnected"'),
            ("taproom_logjam_published_messages_total", 'kind="data"'),
        ),
    ),
    ScaledAttack(
        "unfinished multipart messages",
        unfinished_multipart_scaled,
        (
            (
                "taproom_ingest_rejected_items_total",
                (
                    'reason="message_too_large"',
                    'reason="unfinished_message"',
                    'reason="partial_timeout"',
                ),
            ),
        ),
        per_connection=True,
    ),
]


class HealthWatch:
    """Polls ``/health`` every 0.1 s while attacks run; ``slowest`` and ``failures``. A poll
    unanswered within ``timeout`` (a hang guard: the bench compares ``slowest`` with 1 s) is a
    failure."""

    def __init__(self, web: tuple[str, int], timeout: float = 30.0) -> None:
        self.url = "http://{}:{}/health".format(*web)
        self.timeout = timeout
        self.slowest = 0.0
        self.answered = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:  # one poll at once: a short attack still has its /health checked
            if self.answered + len(self.failures) and self._stop.wait(0.1):
                return
            started = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=self.timeout) as reply:
                    ok = reply.status == 200
            except OSError as exc:
                self.failures.append(repr(exc))
                continue
            took = time.monotonic() - started
            self.slowest = max(self.slowest, took)
            self.answered += 1
            if not ok:
                self.failures.append("not 200")

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class HonestLoad:
    """Honest Lumberjack, logjam (DEALER, 202 replies) and LogTK (TCP) senders in threads; each
    counts what the hub acknowledged. ``acked_since(mark)`` tells who was acked after it."""

    def __init__(
        self,
        addresses: Addresses,
        *,
        logtk_app: str = "honest",
        logjam_app_env: str = "honest-test",
        ack_timeout: float = 120,
    ) -> None:
        self.addresses = addresses
        self.logtk_app = logtk_app  # an app whose token is LOGTK_TOKEN
        self.logjam_app_env = logjam_app_env
        self.ack_timeout = ack_timeout
        self.acked = {"lumberjack": 0, "logjam": 0, "logtk": 0}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._guard, args=(loop,), daemon=True)
            for loop in (self._lumberjack, self._logjam, self._logtk)
        ]

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except Exception as exc:  # reported by the caller, not lost in a thread
            self.errors.append(f"{loop.__name__}: {exc!r}")

    def _lumberjack(self) -> None:
        host, port = self.addresses["lumberjack"]
        with LumberjackClient(host, port, window_size=20, timeout=self.ack_timeout) as client:
            while not self._stop.wait(0.05):
                self.acked["lumberjack"] += client.send({"honest": i} for i in range(20))

    def _logjam(self) -> None:
        from taproom.clients.logjam import LogjamAgent

        host, port = self.addresses["logjam_router"]
        with LogjamAgent(
            f"tcp://{host}:{port}", app_env=self.logjam_app_env, timeout=self.ack_timeout
        ) as agent:
            while not self._stop.wait(0.05):
                if agent.send({"honest": True}) == b"202 Accepted":
                    self.acked["logjam"] += 1

    def _logtk(self) -> None:
        from taproom.clients.logtk import SyncLogTKClient

        host, port = self.addresses["logtk_tcp"]
        client = SyncLogTKClient("tcp", host, port, token=LOGTK_TOKEN, app=self.logtk_app)
        try:
            while not self._stop.wait(0.05):
                for i in range(20):
                    client.send(orjson.dumps({"honest": i}))
                client.flush(self.ack_timeout)
                self.acked["logtk"] += 20
        finally:
            client.close()

    def __enter__(self) -> HonestLoad:
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + 120
        while not all(self.acked.values()) and not self.errors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"honest senders not under way: {self.acked}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)

    def still_acked(self, timeout: float = 60) -> None:
        """Every honest sender gets more acknowledged from now on (AssertionError if not)."""
        got = self.wait_acked_beyond(dict(self.acked), timeout)
        if self.errors or not all(got.values()):
            raise AssertionError(f"honest senders: acked since {got}, errors {self.errors}")

    def wait_acked_beyond(self, mark: dict[str, int], timeout: float = 120) -> dict[str, int]:
        """Wait until every sender is acked past ``mark``; what each got since."""
        deadline = time.monotonic() + timeout
        while not all(self.acked[p] > mark[p] for p in mark) and not self.errors:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return {p: self.acked[p] - mark[p] for p in mark}


@dataclass(frozen=True)
class ScaledOutcome:
    peak_mib: float
    slowest_health_s: float
    health_failures: list[str]
    honest_during: dict[str, int]  # events acked while the attack ran, per protocol
    refused: dict[str, float]  # growth of each row's refusal metric
    hub_alive: bool
    errors: list[str]
    holder_peaks: dict[str, float] = field(default_factory=dict)  # the budget's, per holder
    holder_bounds: dict[str, float] = field(default_factory=dict)
    # the hub's memory at the end (/proc status, MiB) and the load then: what an overrun
    # of the goal was made of (anonymous or file-backed, still resident or freed since)
    memory_at_end: dict[str, float] = field(default_factory=dict)
    # the growth of each alternative of a row's refusal labels apart (which bound a refusal
    # met) and of each row's watched metrics
    growth: dict[str, float] = field(default_factory=dict)

    def explain(self) -> str:
        """The figures a failed check prints."""
        mib = {name: round(peak / MiB, 1) for name, peak in self.holder_peaks.items()}
        return (
            f"peak RSS {self.peak_mib:.1f} MiB (goal {goal_mib():.1f}); holders' peaks MiB {mib}; "
            f"at the end {self.memory_at_end}; refusals counted {self.refused}; "
            f"each refusal by its labels and what was watched {self.growth}"
        )

    @property
    def holder_peaks_within_bounds(self) -> bool:
        """Every holder of the budget stayed within its bound, but by one request granted
        beyond it to break a deadlock (taproom.budget; at most one event, 12 MiB)."""
        slack = 12 * MiB + 64
        return all(
            peak <= self.holder_bounds[name] + slack for name, peak in self.holder_peaks.items()
        )


def _by_holder(addresses: Addresses, name: str) -> dict[str, float]:
    url = "http://{}:{}/metrics".format(*addresses["web"])
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + '{holder="'):
            holder = line.split('"', 2)[1]
            found[holder] = float(line.rsplit(" ", 1)[1])
    return found


def _metric_sum(addresses: Addresses, name: str, label: str | tuple[str, ...]) -> float:
    """The sum of ``name``'s samples whose labels contain ``label`` (or any of ``label``s)."""
    url = "http://{}:{}/metrics".format(*addresses["web"])
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    labels = (label,) if isinstance(label, str) else label
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and any(one in line for one in labels)
    )


def scaled_hub(workdir: Path) -> AttackHub:
    """A hub with every protocol on (defaults, ports 0), and a LogTK app for the honest
    sender."""
    from taproom.servers.logtk import hash_token

    settings: list[tuple[str, str, object]] = []
    for name in SERVICE_MODULES:
        if name in known_sections():
            settings.append((name, "enabled", True))
            for key in known_sections()[name].__dataclass_fields__:
                if key.endswith("port"):
                    settings.append((name, key, 0))
    return AttackHub(
        workdir,
        "lumberjack",
        (*settings, ("logtk", "apps", {"honest": {"token_sha256": hash_token(LOGTK_TOKEN)}})),
    )


def run_scaled(
    rows: list[ScaledAttack], connections: int, workdir: Path, *, full: bool
) -> ScaledOutcome:
    """``rows`` at once (one row: that attack alone), each with ``connections`` attacking
    connections, against a fresh hub with every protocol on, while honest senders keep going
    and /health is watched."""
    hub = scaled_hub(workdir)
    try:
        addresses = hub.addresses
        counted = [(row, name, label) for row in rows for name, label in row.refusals]
        before = [_metric_sum(addresses, name, label) for _row, name, label in counted]
        alternatives = [
            (name, one)
            for _row, name, label in counted
            if not isinstance(label, str)
            for one in label
        ] + [watch for row in rows for watch in row.watched]
        before_each = [_metric_sum(addresses, name, one) for name, one in alternatives]
        with HonestLoad(addresses) as honest, HealthWatch(addresses["web"]) as health:
            mark = dict(honest.acked)
            failed: list[str] = []

            def attack(row: ScaledAttack) -> None:
                try:
                    row.attack(addresses, connections, full)
                except Exception as exc:  # the check fails on it, with its row named
                    failed.append(f"attack {row.name!r}: {exc!r}")

            attackers = [threading.Thread(target=attack, args=(row,)) for row in rows]
            for thread in attackers:
                thread.start()
            for thread in attackers:
                thread.join()
            during = honest.wait_acked_beyond(mark)
        alive = hub.proc.poll() is None
        refused: dict[str, float] = {}
        for (row, name, label), value in zip(counted, before, strict=True) if alive else ():
            key = f"{name}{{{label if isinstance(label, str) else ' | '.join(label)}}}"
            # a peer is counted when the hub sees it go: each attacking connection of a row
            # that counts them must be, within a minute
            want = connections if row.per_connection else 1
            deadline = time.monotonic() + 60
            while True:
                refused[key] = _metric_sum(addresses, name, label) - value
                if refused[key] >= want or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if refused[key] < want:
                refused[key] = 0  # not every connection counted: the check fails on it
        growth = {
            f"{name}{{{one}}}": _metric_sum(addresses, name, one) - value
            for (name, one), value in zip(alternatives, before_each, strict=True)
            if alive
        }
        peak = hub.status_kib("VmHWM") / 1024 if alive else float("nan")
        peaks = _by_holder(addresses, "taproom_budget_peak_bytes") if alive else {}
        bounds = _by_holder(addresses, "taproom_budget_bound_bytes") if alive else {}
        memory = {
            name: round(hub.status_kib(name) / 1024, 1) if alive else float("nan")
            for name in ("VmRSS", "RssAnon", "RssFile")
        }
        memory["load_1min"] = os.getloadavg()[0]
        return ScaledOutcome(
            peak,
            health.slowest,
            health.failures,
            during,
            refused,
            alive,
            [*failed, *honest.errors],
            peaks,
            bounds,
            memory,
            growth,
        )
    finally:
        hub.stop()


def run_all_at_once(connections: int, workdir: Path, *, full: bool) -> ScaledOutcome:
    """Every row of :data:`SCALED` at once against one hub (issue 26, "all of them at once")."""
    return run_scaled(SCALED, connections, workdir, full=full)


def run(quick: bool) -> list[Figure]:
    figures: list[Figure] = []
    goal = goal_mib()
    bound = HubConfig().max_pending_bytes / MiB
    figures.append(Figure("max_pending_bytes (default)", bound, "MiB"))
    rows = ATTACKS[:2] if quick else ATTACKS
    for row in rows:
        with tempfile.TemporaryDirectory(prefix="bench-attack-") as tmp:
            outcome = run_attack(row, Path(tmp))
        figures.append(Figure(f"{row.name}: hub baseline RSS", outcome.baseline_mib, "MiB"))
        figures.append(
            Figure(f"{row.name}: hub peak RSS", outcome.peak_mib, "MiB", f"<= {goal:.0f}")
        )
        figures.append(
            Figure(f"{row.name}: peak - baseline", outcome.peak_mib - outcome.baseline_mib, "MiB")
        )
        figures.append(
            Figure(
                f"{row.name}: honest events acked meanwhile", outcome.honest_acked, "events", "> 0"
            )
        )
        if not outcome.hub_alive:
            figures.append(Figure(f"{row.name}: HUB DIED", 1, "", "0"))
    for scaled_row in SCALED:
        for connections in (1, 8) if quick else (1, 8, 64):
            with tempfile.TemporaryDirectory(prefix="bench-attack-") as tmp:
                scaled = run_scaled([scaled_row], connections, Path(tmp), full=True)
            _scaled_figures(figures, f"{scaled_row.name} x {connections}", scaled, goal)
    with tempfile.TemporaryDirectory(prefix="bench-attack-") as tmp:
        scaled = run_all_at_once(8, Path(tmp), full=True)
    _scaled_figures(figures, "all at once x 8", scaled, goal)
    figures.append(Figure("load average (1 min) at the end", os.getloadavg()[0], ""))
    return figures


def _scaled_figures(figures: list[Figure], name: str, outcome: ScaledOutcome, goal: float) -> None:
    figures.append(Figure(f"{name}: hub peak RSS", outcome.peak_mib, "MiB", f"<= {goal:.0f}"))
    figures.append(Figure(f"{name}: slowest /health", outcome.slowest_health_s, "s", "< 1"))
    honest = ", ".join(f"{k} {v}" for k, v in outcome.honest_during.items())
    figures.append(
        Figure(f"{name}: honest acked during ({honest})", min(outcome.honest_during.values()), "")
    )
    if not outcome.hub_alive:
        figures.append(Figure(f"{name}: HUB DIED", 1, "", "0"))
