"""Lumberjack figures (issue 3): v2 and v1 ingest rates, ack latency, idle-connection cost.

The hub runs as a child process (``taproom serve``, ``fsync = "always"``) pinned to one core;
this process is the load generator, pinned to another. Windows are pre-encoded the way
Filebeat sends them (``W 2048`` + one zlib level-3 ``C``, sequence numbers restarting at 1), so
the generator costs little; the same generator against a socket drain that parses nothing gives
the ceiling the hub is compared with.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from tests.hubprocess import HubProcess

from taproom.config import known_sections
from taproom.protocols.lumberjack import ClientSession, Version
from taproom.servers import SERVICE_MODULES

from .common import Figure, percentile, rss_of_pid_kib

WINDOW = 2048
CONNECTIONS = 4
PIPELINE = 2


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _pin(core: int) -> None:
    with contextlib.suppress(AttributeError, OSError):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[core % len(cores)]})


def _hub_preexec() -> None:
    _raise_nofile()
    _pin(0)


def _event(i: int) -> dict[str, object]:
    # ~300 bytes of JSON, shaped like a Filebeat log event.
    return {
        "@timestamp": "2026-01-01T00:00:00.000Z",
        "message": f"GET /api/items/{i} 200 {i % 977} ms user={i % 131} "
        + "lorem ipsum dolor sit amet " * 3,
        "host": {"name": f"web-{i % 7}"},
        "fields": {"app": "shop"},
        "type": "access",
        "offset": i * 311,
    }


def _event_1k(i: int) -> dict[str, object]:
    # ~1 KiB: issue 32's shape (a Filebeat log line with its usual fields).
    event = _event(i)
    event["message"] = str(event["message"]) + " lorem ipsum dolor sit amet" * 26
    event["agent"] = {"name": "filebeat", "version": "8.15.0", "type": "filebeat"}
    event["log"] = {"file": {"path": "/var/log/shop/access.log"}, "offset": i * 1024}
    return event


def _window_1k_zlib0() -> bytes:
    """2,048 events of ~1 KiB as bare J frames (Filebeat with compression_level 0)."""
    session = ClientSession(Version.V2, compression_level=0)
    return session.encode_window([_event_1k(i) for i in range(WINDOW)]).data


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _window_bytes(version: int) -> bytes:
    session = ClientSession(Version.V2 if version == 2 else Version.V1, compression_level=3)
    if version == 2:
        events: list[object] = [_event(i) for i in range(WINDOW)]
    else:
        events = [
            {k: str(v) for k, v in _event(i).items() if k not in ("host", "fields")}
            | {"host": f"web-{i % 7}", "app": "shop"}
            for i in range(WINDOW)
        ]
    return session.encode_window(events).data


class Hub:
    """``taproom serve`` in a child process on one core."""

    def __init__(self, workdir: Path, max_connections: int = 12_000) -> None:
        self.workdir = workdir
        sections = known_sections()
        lines = [
            "[journal]",
            f'dir = "{workdir / "journal"}"',
            'fsync = "always"',
            "[web]",
            "enabled = false",
            "[lumberjack]",
            "enabled = true",
            "port = 0",
            f"max_connections = {max_connections}",
            # Every connection of the bench comes from 127.0.0.1: the per-address gate is set
            # to the whole fleet's size, else the idle figure measures refused connections.
            f"max_connections_per_peer = {max_connections}",
            f"peer_connection_burst = {max_connections}",
            "peer_connections_per_s = 100000.0",
            "idle_timeout_s = 600.0",
        ]
        for name in SERVICE_MODULES:
            if name != "lumberjack" and name in sections:
                lines += [f"[{name}]", "enabled = false"]
        self.config = workdir / "bench.toml"
        self.config.write_text("\n".join(lines) + "\n")
        self.hub = HubProcess(self.config, preexec_fn=_hub_preexec).start()
        self.proc = self.hub.proc
        host, port = self.hub.addresses["lumberjack"].rsplit(":", 1)
        self.address = (host, int(port))

    def stop(self) -> None:
        self.hub.stop(30)


def _drive(
    address: tuple[str, int],
    window: bytes,
    seconds: float,
    *,
    connections: int = CONNECTIONS,
    rate: float | None = None,
    events: int = WINDOW,
) -> tuple[float, list[float]]:
    """Send ``window`` (of ``events`` events numbered from 1) over ``connections`` for
    ``seconds``; (acked events/s, ack latencies). Events count when acknowledged, by a partial
    ack (a large window's committed part: only a few 85 MB windows end in a run, and counting
    whole windows alone left the hub's work on the others out) or the window's last; latency is
    the whole window's."""
    counts = [0] * connections
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds
    interval = connections / (rate / events) if rate else 0.0

    def one(index: int) -> None:
        with socket.create_connection(address) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sent: deque[float] = deque()
            slots = threading.Semaphore(PIPELINE)
            sending = threading.Event()
            sending.set()

            def read_acks() -> None:
                # Acks are read as they come, beside the sender (whose sendall of a large
                # window blocks until the hub has read most of it): a partial ack counts when
                # it arrives.
                acked = 0  # events of the oldest window in flight acknowledged so far
                while sent or sending.is_set():
                    if not select.select([sock], [], [], 0.1)[0]:
                        continue
                    data = b""
                    while len(data) < 6:
                        chunk = sock.recv(6 - len(data))
                        if not chunk:
                            raise ConnectionError("hub closed the connection")
                        data += chunk
                    now = time.monotonic()
                    seq = int.from_bytes(data[2:], "big")
                    if seq <= acked:
                        continue  # a keepalive (0)
                    if now < stop_at:
                        counts[index] += seq - acked
                    if seq < events:
                        acked = seq  # a partial ack
                        continue
                    acked = 0
                    t0 = sent.popleft()
                    if now < stop_at:
                        latencies.append(time.perf_counter() - t0)
                    slots.release()

            reader = threading.Thread(target=read_acks)
            reader.start()
            try:
                next_send = time.monotonic()
                while True:
                    now = time.monotonic()
                    if now >= stop_at:
                        break
                    if now < next_send:
                        time.sleep(min(next_send - now, 0.01))
                        continue
                    if not slots.acquire(timeout=0.05):
                        continue
                    sent.append(time.perf_counter())
                    sock.sendall(window)
                    next_send = (next_send + interval) if rate else now
            finally:
                sending.clear()
                reader.join()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(connections)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Only acks received before the deadline are counted, so the rate is over ``seconds``.
    assert time.perf_counter() - started >= seconds
    return sum(counts) / seconds, latencies


def _drain_server(window_len: int) -> tuple[subprocess.Popen[bytes], tuple[str, int]]:
    """A server that parses nothing: it counts bytes and acks once per window's worth."""
    code = (
        "import socket,sys,threading\n"
        "n=int(sys.argv[1]);ack=b'2A\\0\\0\\x08\\0'\n"
        "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind(('127.0.0.1',0));s.listen(64);print(s.getsockname()[1],flush=True)\n"
        "def d(c):\n"
        "  got=0\n"
        "  while True:\n"
        "    b=c.recv(1<<20)\n"
        "    if not b:return\n"
        "    got+=len(b)\n"
        "    if got>=n:\n"
        "      k,got=divmod(got,n);c.sendall(ack*k)\n"
        "while True:\n"
        "  c,_=s.accept();threading.Thread(target=d,args=(c,),daemon=True).start()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(window_len)],
        stdout=subprocess.PIPE,
        preexec_fn=_hub_preexec,
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, ("127.0.0.1", port)


_WORDS = [f"w{i:x}" for i in range(64)] + ["GET", "POST", "/api/v1", "200", "500", "user=", "at"]


def _large_window(event_bytes: int = 40 * 1024) -> bytes:
    """Issue 24's window: 2,048 events of ~40 KiB of log-like text (85 MB inflated), zlib 3,
    numbered 1..2048 (Filebeat's numbering)."""
    import random

    rng = random.Random(24)
    base = " ".join(rng.choices(_WORDS, k=event_bytes))
    events = [
        {"message": base[i % 997 : i % 997 + event_bytes], "n": i, "fields": {"app": "big"}}
        for i in range(WINDOW)
    ]
    return ClientSession(Version.V2, compression_level=3).encode_window(events).data


def _large_events(seconds: float, connections: int = CONNECTIONS) -> list[Figure]:
    """Issue 24's benchmark: 4 connections each sending 2,048 x 40 KiB windows; the hub's peak
    RSS (a fresh hub) beside the goal, and the events/s of that run."""
    window = _large_window()
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="bench-lj-large-") as tmp:
        hub = Hub(Path(tmp))
        try:
            baseline = rss_of_pid_kib(hub.proc.pid, "VmRSS") / 1024
            cpu0 = _cpu_seconds(hub.proc.pid)
            rate, _ = _drive(hub.address, window, seconds, connections=connections)
            cpu = _cpu_seconds(hub.proc.pid) - cpu0
            peak = rss_of_pid_kib(hub.proc.pid, "VmHWM") / 1024
        finally:
            hub.stop()
    goal = (2 * 64 * 1024 * 1024 + 100_000_000) / (1 << 20)
    figures.append(
        Figure(
            f"v2 40 KiB events/s (2048/window = {len(window) / 1e6:.1f} MB zlib 3, 4 conns)",
            rate,
            "ev/s",
        )
    )
    figures.append(Figure("v2 40 KiB events per hub CPU-second", rate * seconds / cpu, "ev/cpu-s"))
    figures.append(Figure("v2 40 KiB: MB of events/s", rate * 40 * 1024 / 1e6, "MB/s"))
    figures.append(Figure("v2 40 KiB: hub baseline RSS", baseline, "MiB"))
    figures.append(Figure("v2 40 KiB: hub peak RSS (VmHWM)", peak, "MiB", f"<= {goal:.0f}"))
    return figures


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False  # open, nothing to read
    except ConnectionError:
        return True


def _idle_connections(hub: Hub, count: int) -> float:
    """KiB of hub RSS per idle connection (each sent one W frame and went quiet)."""
    before = rss_of_pid_kib(hub.proc.pid)
    socks = []
    try:
        for _ in range(count):
            s = socket.create_connection(hub.address)
            s.sendall(b"2W\0\0\0\x01")
            socks.append(s)
        time.sleep(2.0)
        after = rss_of_pid_kib(hub.proc.pid)
        closed = sum(1 for s in socks if _closed_by_peer(s))
        if closed:  # a refused connection costs nothing: the figure would be too good
            raise RuntimeError(f"the hub closed {closed} of {count} idle connections")
    finally:
        for s in socks:
            s.close()
    return (after - before) / count


def run(quick: bool) -> list[Figure]:
    _raise_nofile()
    _pin(1)
    seconds = 3.0 if quick else 15.0
    idle = 1000 if quick else 10_000
    figures: list[Figure] = []
    v2 = _window_bytes(2)
    v1 = _window_bytes(1)
    v2_1k = _window_1k_zlib0()
    with tempfile.TemporaryDirectory(prefix="bench-lj-") as tmp:
        hub = Hub(Path(tmp))
        try:
            # Idle cost first, on a heap that no burst of windows has grown and freed.
            _idle_connections(hub, 10)
            per_conn = _idle_connections(hub, idle)
            _drive(hub.address, v2, 1.0)  # warm-up
            cpu0 = _cpu_seconds(hub.proc.pid)
            rate2, lat2 = _drive(hub.address, v2, seconds)
            cpu2 = _cpu_seconds(hub.proc.pid) - cpu0
            figures.append(
                Figure(
                    "v2 events/s (2048/window, zlib 3, 4 conns, fsync always)",
                    rate2,
                    "ev/s",
                    ">= 300000",
                )
            )
            cpu0 = _cpu_seconds(hub.proc.pid)
            rate1, _ = _drive(hub.address, v1, seconds)
            cpu1 = _cpu_seconds(hub.proc.pid) - cpu0
            figures.append(Figure("v1 D-frame events/s (same shape)", rate1, "ev/s", ">= 150000"))
            # Events per second of CPU the hub actually got: comparable on a busy machine.
            figures.append(
                Figure(
                    "v2 events per hub CPU-second", rate2 * seconds / max(cpu2, 1e-9), "ev/cpu-s"
                )
            )
            figures.append(
                Figure(
                    "v1 events per hub CPU-second", rate1 * seconds / max(cpu1, 1e-9), "ev/cpu-s"
                )
            )
            cpu0 = _cpu_seconds(hub.proc.pid)
            rate_1k, _ = _drive(hub.address, v2_1k, seconds)
            cpu_1k = _cpu_seconds(hub.proc.pid) - cpu0
            figures.append(Figure("v2 1 KiB events/s (zlib 0, bare J frames)", rate_1k, "ev/s"))
            figures.append(
                Figure(
                    "v2 1 KiB zlib 0 events per hub CPU-second",
                    rate_1k * seconds / max(cpu_1k, 1e-9),
                    "ev/cpu-s",
                    ">= 300000",
                )
            )
            _, lat = _drive(hub.address, v2, seconds * 2 / 3, rate=rate2 / 2)
            lat.sort()
            figures.append(
                Figure("v2 ack latency p50 at half peak", percentile(lat, 50) * 1e3, "ms")
            )
            figures.append(
                Figure("v2 ack latency p99 at half peak", percentile(lat, 99) * 1e3, "ms")
            )
            lat2.sort()
            figures.append(Figure("v2 ack latency p99 at peak", percentile(lat2, 99) * 1e3, "ms"))
            figures.append(
                Figure(f"hub RSS per idle connection ({idle:,} held)", per_conn, "KiB", "<= 20")
            )
            figures.append(Figure("hub RSS at the end", rss_of_pid_kib(hub.proc.pid) / 1024, "MiB"))
        finally:
            hub.stop()
        drain, address = _drain_server(len(v2))
        try:
            ceiling, _ = _drive(address, v2, seconds / 2)
        finally:
            drain.kill()
            drain.wait()
        figures.append(Figure("same client against a socket drain (ceiling)", ceiling, "ev/s"))
        figures.append(Figure("v2 rate / ceiling", rate2 / ceiling if ceiling else 0.0, "ratio"))
    # Large events next to the ~300-byte ones above (issue 24).
    figures += _large_events(seconds * 2)
    return figures
