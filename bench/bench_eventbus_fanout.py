"""Event BUS fan-out to 1,000 subscribers (issue 32): deliveries per second, per-subscriber lag
p99 and the hub's RSS, at two publish rates.

The seed promises "thousands" of clients and "some millions of updates per second, at peak".
The bus (``taproom serve``, fsync ``always``) gets paced PUB commands whose data carries the
send time; 1,000 SUB sockets spread over four processes read every BROADCAST in a C loop
(bench/zmqloops.c ``bl_count_many``: Python subscribers were what the figure measured) and time
every tenth one. The lag is PUB sent -> BROADCAST received (so it includes the commit); "p99"
is the 99th percentile over all sampled deliveries, "worst subscriber p99" the slowest socket's
own p99. Everything shares the machine's cores, so beside the rates the bench prints the hub's
CPU per delivery (all its threads: libzmq's I/O thread does the sending to each subscriber).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import struct
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import zmq
from tests.hubprocess import HubProcess

from . import zmqloops
from .common import Figure, cpu_seconds_of_pid, percentile, rss_of_pid_kib

_CTX = mp.get_context("spawn")
TS = b"2026-11-22T08:00:00.000000+00:00"
PROCESSES = 4
WARM = b"/fan/warm"


def _serve(root: Path) -> HubProcess:
    cfg = root / "taproom.toml"
    cfg.write_text(
        f'[journal]\ndir = "{root / "journal"}"\nfsync = "always"\n'
        '[web]\nport = 0\n[hub]\nlog_level = "WARNING"\n'
        "[lumberjack]\nenabled = false\n[logtk]\nenabled = false\n"
        "[logjam]\nenabled = false\n[lager]\nenabled = false\n"
        "[eventbus]\nenabled = true\nport = 0\n"
    )
    return HubProcess(cfg).start()


def _subscribers(endpoint: str, count: int, expected: int, ready: Any, out: Any) -> None:
    """``count`` SUB sockets; until each has ``expected`` BROADCASTs (or 10 s of silence):
    (received, per-socket sampled lags in ms)."""
    ctx = zmq.Context()
    socks = []
    for _ in range(count):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"/fan")
        sock.connect(endpoint)
        socks.append(sock)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    # the publisher sends warm-up updates until every socket has one: no slow joiner after
    waiting = set(socks)
    while waiting:
        for sock, _ in poller.poll(200):
            while True:
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                waiting.discard(sock)
    ready.release()
    # counted in C: Python subscribers on a small machine measured themselves, not the hub
    received, lags, last = zmqloops.count_many(socks, expected, 10_000, 10, 4096)
    out.put((received, lags, last))
    ctx.destroy(0)


def _publisher(endpoint: str, n: int, rate: float, go: Any) -> None:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 1_000_000)
    dealer.connect(endpoint)
    zero = struct.pack(">Q", 0)
    while not go.wait(0.05):  # warm-up updates until every subscriber has seen one
        data = msgpack.packb(("warm-up",))  # no send time: the counting loop skips it
        dealer.send_multipart([WARM, zero, b"bench", TS, str(uuid.uuid4()).encode(), data])
    time.sleep(0.5)  # the last warm-ups are read before the run's updates count
    started = time.monotonic()
    for i in range(n):
        delay = started + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        data = msgpack.packb((time.time_ns(), "x" * 150))
        dealer.send_multipart(
            [f"/fan/{i % 100}".encode(), zero, b"bench", TS, str(uuid.uuid4()).encode(), data]
        )
    dealer.close(linger=60_000)
    ctx.term()


def _run(hub: HubProcess, subscribers: int, rate: float, seconds: float) -> list[Figure]:
    n = int(rate * seconds)
    endpoint = "tcp://" + hub.addresses["eventbus_publisher"]
    ready, go, out = _CTX.Semaphore(0), _CTX.Event(), _CTX.Queue()
    per = [subscribers // PROCESSES + (k < subscribers % PROCESSES) for k in range(PROCESSES)]
    subs = [_CTX.Process(target=_subscribers, args=(endpoint, c, n, ready, out)) for c in per]
    pub = _CTX.Process(
        target=_publisher, args=("tcp://" + hub.addresses["eventbus_collector"], n, rate, go)
    )
    pub.start()
    for p in subs:
        p.start()
    for _ in subs:
        if not ready.acquire(timeout=300):
            raise RuntimeError("subscribers never saw the warm-up updates")
    cpu0, t0 = cpu_seconds_of_pid(hub.pid), time.time() + 0.5  # the publisher's pause
    go.set()
    results = [out.get(timeout=seconds * 10 + 120) for _ in subs]
    wall = max(last for _, _, last in results) - t0  # to the last delivery
    cpu = cpu_seconds_of_pid(hub.pid) - cpu0
    rss = rss_of_pid_kib(hub.pid, "VmHWM") / 1024
    pub.join(60)
    for p in subs:
        p.join(60)
    received = [r for got, _, _ in results for r in got]
    lags = [sorted(lag) for _, per_sock, _ in results for lag in per_sock]
    every = sorted(x for lag in lags for x in lag)
    worst = max((percentile(lag, 99) for lag in lags if lag), default=float("nan"))
    delivered = sum(received)
    name = f"{subscribers} subscribers, {rate:,.0f} updates/s"
    return [
        Figure(name + ": deliveries/s", delivered / wall, "deliveries/s"),
        Figure(f"  delivered of {n * subscribers}", delivered, "messages", f"= {n * subscribers}"),
        Figure(
            "  subscribers that got everything",
            sum(r >= n for r in received),
            "of " + str(subscribers),
        ),
        Figure("  lag p50 (PUB sent -> BROADCAST received)", percentile(every, 50), "ms"),
        Figure("  lag p99, all sampled deliveries", percentile(every, 99), "ms"),
        Figure("  lag p99 of the worst subscriber", worst, "ms"),
        Figure("  hub CPU per delivery (all threads)", cpu / max(1, delivered) * 1e6, "us"),
        Figure("  hub peak RSS", rss, "MiB"),
    ]


def run(quick: bool) -> list[Figure]:
    root = Path(tempfile.mkdtemp(prefix="taproom-bench-fanout-", dir=os.environ.get("BENCH_DIR")))
    figures: list[Figure] = []
    try:
        hub = _serve(root)
        try:
            subscribers = 200 if quick else 1000
            seconds = 5.0 if quick else 20.0
            for rate in (100.0, 400.0):
                figures += _run(hub, subscribers, rate, seconds)
        finally:
            hub.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return figures
