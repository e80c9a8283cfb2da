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
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
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
        lines = []
        for name, values in tables.items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {orjson.dumps(v).decode()}" for k, v in values.items()]
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
    """Valid windows packed tight: 8 small C frames in one read, each inflating to 60 MiB of
    15 MiB events (once all submitted from one read: 480 MB pending)."""
    events = b"".join(_json_frame(seq, 15 * MiB) for seq in range(1, 5))
    one = WindowSizeFrame(4).serialize() + CompressedFrame.compress(events, 9)
    with socket.create_connection(addresses["lumberjack"]) as sock:
        _send_quietly(sock, one * 8)
        acks = b""
        sock.settimeout(300)
        while len(acks) < 6 * 8:
            chunk = sock.recv(64)
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
    figures.append(Figure("load average (1 min) at the end", os.getloadavg()[0], ""))
    return figures
