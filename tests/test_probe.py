"""The adversarial probe (issues 18 and 19), against a hub with every protocol enabled.

Every listener, TCP and ZeroMQ, gets garbage, absurd lengths, truncated frames and connect/RST
floods, while honest Lumberjack, LogTK and logjam senders keep sending. Throughout, the hub must
stay up, ``/health`` answer every time (within 1 s: ``python -m bench attack``'s figure), the
honest senders keep being acknowledged, the hub's descriptors and RSS stay bounded, and what
taproom itself refuses be counted in /metrics.

``make test`` runs the short version: one hub for the module, each attack once, 10,000
connect/RST cycles per TCP listener. ``make soak`` also replays every row of
``bench/bench_attack.py`` (Lumberjack's memory attacks with the default settings, each against a
fresh hub) and checks the peak RSS goal of issue 19.
"""

from __future__ import annotations

import base64
import contextlib
import multiprocessing
import os
import random
import selectors
import socket
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from bench.bench_attack import ATTACKS, Attack, HonestLoad, goal_mib, run_attack
from bench.bench_attack import HealthWatch as _HealthWatch

from taproom.protocols.lumberjack import JsonFrame, WindowSizeFrame
from taproom.servers.logtk import hash_token
from tests.support import SOAK, HubProcess, fuzz_examples, write_config

TOKEN = bytes(range(1, 65))
ALL = ("lumberjack", "logtk", "logjam", "eventbus", "lager")
TCP_LISTENERS = ("lumberjack", "logtk_ws", "logtk_tcp")
# Connect/RST cycles per listener: 3,000 (the reproduction) under make test, 10,000 under
# make soak. A flood overflows the listeners' accept queues and the kernel's SYN retries pace it
# at a few hundred cycles a second: that is the point of a bounded backlog.
RST_CYCLES = {"lumberjack": 3_000, "logtk_ws": 3_000, "logtk_tcp": 3_000, "web": 2_000}
# The requirement, /health within 1 s during and after an attack, is a figure: `python
# -m bench attack` measures the slowest /health against it. Here every /health must answer 200,
# each within a hang guard: a 1 s deadline failed under load > 15 on 2 cores (the hub and this
# process waiting for a core, not the flood), while a hub that stops answering, refuses or
# resets (issue 18 item 5) still fails.
HEALTH_S = 30.0
GARBAGE = random.Random(18).randbytes(64 * 1024)


# --- the hub and what watches it -------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubProcess]:
    tmp = tmp_path_factory.mktemp("probe")
    apps = {"apps": {"probe": {"token_sha256": hash_token(TOKEN)}}}
    with HubProcess(write_config(tmp, enable=ALL, logtk=apps)) as process:
        yield process


def get(hub: HubProcess, path: str, timeout: float = HEALTH_S) -> int:
    host, port = hub.address("web")
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as reply:
        return int(reply.status)


def metric_sum(hub: HubProcess, name: str, *labels: str) -> float:
    """The sum of ``name`` over the series that carry every one of ``labels``."""
    host, port = hub.address("web")
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(label in line for label in labels)
    )


def open_fds(hub: HubProcess) -> int:
    assert hub.proc is not None
    return len(os.listdir(f"/proc/{hub.proc.pid}/fd"))


def status_kib(hub: HubProcess, field: str) -> int:
    assert hub.proc is not None
    with open(f"/proc/{hub.proc.pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def HealthWatch(hub: HubProcess) -> _HealthWatch:
    """Polls /health every 0.1 s while attacks run; every request must answer 200 (HEALTH_S)."""
    return _HealthWatch(hub.address("web"), timeout=HEALTH_S)


class HonestSenders(HonestLoad):
    """Lumberjack, LogTK (TCP) and logjam (DEALER, 202 replies) senders in threads
    (bench/bench_attack.py's HonestLoad); each counts what the hub acknowledged."""

    def __init__(self, hub: HubProcess) -> None:
        addresses = {name: hub.address(name) for name in hub.addresses}
        super().__init__(addresses, logtk_app="probe", logjam_app_env="probe-test", ack_timeout=60)


@pytest.fixture(scope="module")
def senders(hub: HubProcess) -> Iterator[HonestSenders]:
    with HonestSenders(hub) as running:
        yield running


# --- connect/RST floods (issue 18 item 5) ------------------------------------------------------


Flood = Callable[[tuple[str, int], int], int]


@pytest.fixture(scope="module")
def rst_flood() -> Iterator[Flood]:
    """``rst_flood(address, cycles)``: connect/RST from an attacker address, in a process of its
    own (a flood loop in this process would starve the threads watching /health of the GIL)."""
    with ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn")
    ) as pool:

        def flood(address: tuple[str, int], cycles: int) -> int:
            return pool.submit(_rst_flood, address, cycles, attacker()).result(timeout=600)

        yield flood


def _rst_flood(
    address: tuple[str, int], cycles: int, source: tuple[str, int], in_flight: int = 64
) -> int:
    """Connect and reset (SO_LINGER 0) ``cycles`` times, up to ``in_flight`` at once.

    Non-blocking, so a SYN the full accept queue dropped (retried by the kernel after a second)
    holds one slot, not the flood. Returns the cycles whose connect completed.
    """
    linger = struct.pack("ii", 1, 0)
    selector = selectors.DefaultSelector()
    done = started = dropped = 0
    deadline = time.monotonic() + 300
    while done < cycles and time.monotonic() < deadline:
        while len(selector.get_map()) < in_flight and started - dropped < cycles:
            sock = socket.socket()
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            sock.bind(source)
            sock.connect_ex(address)
            selector.register(sock, selectors.EVENT_WRITE, time.monotonic())
            started += 1
        now = time.monotonic()
        for key, _ in selector.select(0.2):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            selector.unregister(sock)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                done += 1
            else:
                dropped += 1
            sock.close()
        for key in list(selector.get_map().values()):
            if now - key.data > 3:  # dropped by a full accept queue: not a cycle
                dropped += 1
                selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    selector.close()
    return done


@pytest.mark.parametrize("listener", TCP_LISTENERS)
def test_connect_rst_flood_leaves_health_and_acks_alone(
    hub: HubProcess, senders: HonestSenders, rst_flood: Flood, listener: str
) -> None:
    # Issue 18 item 5: after 3,000 connect/RST cycles on the Lumberjack port /health stopped
    # answering. Up to 10,000 here, on every TCP listener, with /health polled all along.
    fds = open_fds(hub)
    with HealthWatch(hub) as watch:
        cycles = fuzz_examples(RST_CYCLES[listener], 10_000)
        assert rst_flood(hub.address(listener), cycles) == cycles
    assert watch.failures == [] and watch.answered > 0
    assert get(hub, "/health") == 200 and get(hub, "/ready") == 200
    wait_for(lambda: open_fds(hub) <= fds + 8)  # every reset connection released
    senders.still_acked()


def test_connect_rst_flood_of_the_web_port_itself(hub: HubProcess, rst_flood: Flood) -> None:
    # With a 100-connection accept queue dropped SYNs cost /health a 1 s retry, and reset
    # connections accepted in large bursts filled the hard limit (too_many_connections).
    fds = open_fds(hub)
    with HealthWatch(hub) as watch:
        cycles = fuzz_examples(RST_CYCLES["web"], 10_000)
        assert rst_flood(hub.address("web"), cycles) == cycles
    assert get(hub, "/health") == 200
    assert watch.failures == [] and watch.answered > 0
    wait_for(lambda: open_fds(hub) <= fds + 8)  # every reset connection released


# --- garbage, absurd lengths, truncation -----------------------------------------------------


def _ws_upgrade() -> bytes:
    auth = base64.b64encode(TOKEN).decode()
    return (
        "GET /logging/probe HTTP/1.1\r\nHost: probe\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: logtk\r\nX-LogTK-Auth: {auth}\r\n"
        "\r\n"
    ).encode()


_MAX_VARUINT32 = b"\x8f\xff\xff\xff\x7f"
# What taproom itself can see and count, per TCP listener and attack: metric name and labels
# whose sum must grow. Truncation only costs the sender its connection.
TCP_ATTACKS: dict[str, dict[str, tuple[bytes, tuple[str, ...] | None]]] = {
    "lumberjack": {
        "garbage": (GARBAGE, ("taproom_ingest_rejected_items_total", 'protocol="lumberjack"')),
        "absurd_length": (
            WindowSizeFrame(1).serialize() + b"2J" + struct.pack(">II", 1, 0xFFFFFFFF),
            ("taproom_ingest_rejected_items_total", 'reason="frame_too_large"'),
        ),
        # A C frame is streamed (no length bound, nothing allocated for it): an absurd length
        # costs nothing, and what follows is judged as it arrives.
        "absurd_compressed": (
            b"2C" + struct.pack(">I", 0xFFFFFFFF) + GARBAGE[:1000],
            ("taproom_ingest_rejected_items_total", 'reason="bad_compressed"'),
        ),
        "truncated": (
            WindowSizeFrame(1).serialize() + JsonFrame(1, b'{"cut": true}').serialize()[:-4],
            None,
        ),
    },
    "logtk_tcp": {
        "garbage": (GARBAGE, ("taproom_ingest_rejected_items_total", 'protocol="logtk"')),
        "absurd_length": (
            b"\x03\x01" + _MAX_VARUINT32,
            ("taproom_ingest_rejected_items_total", 'protocol="logtk"'),
        ),
        "truncated": (b"\x01\x01" + TOKEN[:40], None),
    },
    "logtk_ws": {
        "garbage": (GARBAGE, None),
        # Closed with 1009 by websockets, counted by taproom.
        "absurd_length": (
            _ws_upgrade() + b"\x82\xff" + struct.pack(">Q", 1 << 62) + b"mask" + GARBAGE[:100],
            ("taproom_ingest_rejected_items_total", 'reason="ws_message_too_big"'),
        ),
        "truncated": (_ws_upgrade()[:60], None),
    },
    "web": {
        "garbage": (GARBAGE, ("taproom_web_requests_calls_total", 'reason="bad_request"')),
        "absurd_length": (
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\n",
            ("taproom_web_requests_calls_total", 'reason="head_too_large"'),
        ),
        "truncated": (b"GET /hea", None),
    },
}


_attacker_hosts = (f"127.0.{i // 250}.{i % 250 + 2}" for i in range(60_000))


def attacker() -> tuple[str, int]:
    """A loopback source address of its own for each attack: per-peer limits and LogTK's
    auth-failure throttle then judge every attack alone, and never the honest senders (which
    connect from 127.0.0.1)."""
    return (next(_attacker_hosts), 0)


def send_and_wait_close(address: tuple[str, int], data: bytes, *, hold: bool) -> None:
    """Send ``data``; then either close at once (truncation) or wait until the hub closes."""
    with socket.create_connection(address, timeout=30, source_address=attacker()) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        if hold:
            with contextlib.suppress(OSError):
                while sock.recv(65536):
                    pass


@pytest.mark.parametrize(
    ("listener", "attack"),
    [(listener, attack) for listener, rows in TCP_ATTACKS.items() for attack in rows],
)
def test_malformed_input_on_tcp_listeners(
    hub: HubProcess, senders: HonestSenders, listener: str, attack: str
) -> None:
    data, counter = TCP_ATTACKS[listener][attack]
    before = metric_sum(hub, *counter) if counter else 0.0
    with HealthWatch(hub) as watch:
        send_and_wait_close(hub.address(listener), data, hold=attack != "truncated")
    assert watch.failures == []
    assert get(hub, "/health") == 200
    if counter:
        wait_for(lambda: metric_sum(hub, *counter) > before)
    senders.still_acked()


def _zmtp_greeting() -> bytes:
    """ZMTP 3.0, NULL mechanism, as a client."""
    return b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)


def _zmtp_ready(socket_type: bytes) -> bytes:
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return bytes([0x04, len(body)]) + body


# The peer type each ZeroMQ socket type accepts (ZMTP 3.0 socket compatibility).
_ZMQ_PEER = {
    b"ROUTER": b"DEALER",
    b"DEALER": b"DEALER",
    b"PULL": b"PUSH",
    b"PUSH": b"PULL",
    b"SUB": b"PUB",
    b"XSUB": b"PUB",
    b"PUB": b"SUB",
    b"XPUB": b"SUB",
}


def zmtp_absurd_frame(address: tuple[str, int]) -> None:
    """Handshake as the peer the listener expects, then announce a 1 TiB frame."""
    with socket.create_connection(address, timeout=30, source_address=attacker()) as sock:
        sock.sendall(_zmtp_greeting())
        reply = b""
        theirs = None
        while theirs is None:
            chunk = sock.recv(4096)
            if not chunk:
                return  # refused at the greeting: nothing more to try
            reply += chunk
            at = reply.find(b"Socket-Type") + 11
            if at > 10 and len(reply) >= at + 4:
                (length,) = struct.unpack(">I", reply[at : at + 4])
                if len(reply) >= at + 4 + length:
                    theirs = reply[at + 4 : at + 4 + length]
        with contextlib.suppress(OSError):
            sock.sendall(_zmtp_ready(_ZMQ_PEER.get(theirs, b"DEALER")))
            sock.sendall(b"\x02" + struct.pack(">Q", 1 << 40) + GARBAGE[:1000])
            time.sleep(0.2)


def _zmq_listeners(hub: HubProcess) -> list[str]:
    return sorted(name for name in hub.addresses if name not in (*TCP_LISTENERS, "web"))


def test_malformed_input_on_zeromq_listeners(
    hub: HubProcess, senders: HonestSenders, rst_flood: Flood
) -> None:
    # libzmq refuses these itself (the hub sees nothing to count); the hub must not notice.
    rss_before = status_kib(hub, "VmRSS")
    with HealthWatch(hub) as watch:
        for name in _zmq_listeners(hub):
            address = hub.address(name)
            send_and_wait_close(address, GARBAGE, hold=True)
            send_and_wait_close(address, _zmtp_greeting()[:30], hold=False)
            zmtp_absurd_frame(address)
            assert rst_flood(address, 500) == 500
    assert watch.failures == []
    assert hub.proc is not None and hub.proc.poll() is None
    assert (status_kib(hub, "VmRSS") - rss_before) * 1024 < 64 << 20  # no 1 TiB allocation
    senders.still_acked()


def test_the_probe_left_the_hub_bounded(hub: HubProcess, senders: HonestSenders) -> None:
    # Runs last in the module: after every attack above the hub still serves and is ready.
    assert get(hub, "/ready") == 200
    peak_mib = status_kib(hub, "VmHWM") / 1024
    assert peak_mib < goal_mib(), peak_mib
    senders.still_acked()


# --- the long version: every attack of the bench, each against a fresh hub -------------------


@pytest.mark.soak
@pytest.mark.skipif(not SOAK, reason="memory attacks with the default bounds: make soak")
@pytest.mark.parametrize("row", ATTACKS, ids=[row.name for row in ATTACKS])
def test_attack_peak_rss_within_goal(tmp_path: Path, row: Attack) -> None:
    outcome = run_attack(row, tmp_path)
    assert outcome.hub_alive
    assert outcome.honest_acked > 0
    assert outcome.peak_mib <= goal_mib(), (outcome.peak_mib, goal_mib())
