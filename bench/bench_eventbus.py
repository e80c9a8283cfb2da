"""Event BUS figures (issue 6): PUB -> durable commit -> BROADCAST rate with fsync=always and
200-byte MessagePack events, a 100,000-key snapshot to a new client, and broadcast latency
at half the measured rate; and the CHP dialect (issue 16): kvmsg updates from a Clone model 5
PUSH through the PULL collector -> commit -> the CHP PUB.

The bus is a child process (``taproom serve``); a spawned process publishes (raw DEALER, PUB
commands pre-built with distinct UUIDs) and this process counts BROADCASTs on a SUB, so the
hub has one core and the load generator the other.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import struct
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import zmq
from tests.hubprocess import HubProcess

from . import zmqloops
from .common import Figure, cpu_seconds_of_pid, percentile

# The Cython send/recv without pyzmq's Python wrappers: the load generator must not be the
# bottleneck of what it measures.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_MORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)


def _recv_frames(sock: zmq.Socket[bytes], flags: int = 0) -> list[bytes]:
    frame = _recv(sock, flags, False)
    parts = [frame.bytes]
    while frame.more:
        frame = _recv(sock, flags, False)
        parts.append(frame.bytes)
    return parts


_CTX = mp.get_context("spawn")
SNAPSHOT_KEYS = 100_000  # issue 32's snapshot goal: >= 400,000 keys/s at this size
TS = b"2026-11-22T08:00:00.000000+00:00"
DATA = msgpack.packb({"host": "web-1", "metric": "latency", "value": 12.5, "pad": "x" * 150})


class _Serve:
    def __init__(self, tmp: Path, chp: bool = False) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        cfg = tmp / "taproom.toml"
        cfg.write_text(
            f'[journal]\ndir = "{tmp / "journal"}"\nfsync = "always"\n'
            '[web]\nport = 0\n[hub]\nlog_level = "WARNING"\n'
            # the hashmap below is its own share of a budget raised to hold it
            "memory_budget_bytes = 402653184\n"
            "[lumberjack]\nenabled = false\n[logtk]\nenabled = false\n"
            "[logjam]\nenabled = false\n[lager]\nenabled = false\n"
            "[eventbus]\nenabled = true\nport = 0\n"
            # room for the 100,000-key snapshot beside the rate runs' 1,000 topics
            "max_keys = 200000\nmax_hashmap_bytes = 268435456\n"
            + ('chp = true\nchp_port = 0\nchp_collector = "pull"\n' if chp else "")
        )
        self.hub = HubProcess(cfg).start()
        self.proc = self.hub.proc
        self.addresses = self.hub.addresses

    def stop(self) -> None:
        self.hub.stop(30)


def _publisher(
    endpoint: str,
    n: int,
    topics: int,
    rate: float,
    stamp: bool,
    ready: Any,
    go: Any,
    kvmsg: bool = False,
) -> None:
    """Send ``n`` PUB commands (``rate`` per second, 0 = as fast as possible), or with
    ``kvmsg`` n kvmsg updates from a PUSH, as a Clone model 5 client sends them."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.PUSH if kvmsg else zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 100_000)
    dealer.connect(endpoint)
    if kvmsg:
        _kvmsg_updates(dealer, n, topics, ready, go)
        ctx.term()
        return
    if not rate and not stamp:  # as fast as possible: the C loop, not pyzmq per frame
        ready.set()
        go.wait()
        zmqloops.bus_publisher(dealer, n, topics, random.getrandbits(32), b"bench", TS, DATA)
        time.sleep(1.0)  # let ZeroMQ flush before the context goes
        dealer.close(linger=120_000)  # until the hub has read all of it
        ctx.term()
        return
    keys = [str(uuid.uuid4()).encode() for _ in range(n)]
    names = [f"/bench/{i % topics}".encode() for i in range(n)] if topics < n else None
    zero = struct.pack(">Q", 0)
    ready.set()
    go.wait()
    more = _MORE
    started = time.monotonic()
    for i in range(n):
        if rate and i % 50 == 0:
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        _send(dealer, names[i] if names else f"/bench/{i}".encode(), more)
        _send(dealer, zero, more)
        _send(dealer, b"bench", more)
        _send(dealer, TS, more)
        _send(dealer, keys[i], more)
        _send(dealer, msgpack.packb((time.monotonic_ns(), "x" * 180)) if stamp else DATA, 0)
    time.sleep(1.0)  # let ZeroMQ flush before the context goes
    dealer.close(linger=120_000)  # until the hub has read all of it
    ctx.term()


def _kvmsg_updates(push: zmq.Socket[bytes], n: int, topics: int, ready: Any, go: Any) -> None:
    """The Guide's kvmsg: key, sequence 0, a fresh 16-byte uuid4, no properties, the body."""
    keys = [uuid.uuid4().bytes for _ in range(n)]
    names = [f"/bench/{i % topics}".encode() for i in range(topics)]
    zero = struct.pack(">Q", 0)
    ready.set()
    go.wait()
    more = _MORE
    for i in range(n):
        _send(push, names[i % topics], more)
        _send(push, zero, more)
        _send(push, keys[i], more)
        _send(push, b"", more)
        _send(push, DATA, 0)
    time.sleep(1.0)  # let ZeroMQ flush before the context goes
    push.close(linger=120_000)


def _run_load(
    serve: _Serve,
    n: int,
    topics: int,
    rate: float = 0.0,
    stamp: bool = False,
    kvmsg: bool = False,
) -> tuple[float, list[float]]:
    """Publish ``n`` events from a child; (seconds until the last BROADCAST, latencies). With
    ``kvmsg``, kvmsg updates into the CHP collector, counted on the CHP publisher."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"/")
    group = "eventbus_chp_" if kvmsg else "eventbus_"
    sub.connect("tcp://" + serve.addresses[group + "publisher"])
    time.sleep(0.3)
    ready, go = _CTX.Event(), _CTX.Event()
    child = _CTX.Process(
        target=_publisher,
        args=(
            "tcp://" + serve.addresses[group + "collector"],
            n,
            topics,
            rate,
            stamp,
            ready,
            go,
            kvmsg,
        ),
    )
    child.start()
    if not ready.wait(120):  # the child has made its UUIDs and connected
        raise RuntimeError("publisher did not start")
    time.sleep(0.2)
    latencies: list[float] = []
    go.set()
    started = time.perf_counter()
    if not stamp:  # counted by the C loop: a Python subscriber would be the bottleneck
        sub.setsockopt(zmq.RCVTIMEO, 30_000)
        received = zmqloops.count(sub, n)
        elapsed = time.perf_counter() - started
        child.join(30)
        ctx.destroy(0)
        if received < n:
            raise RuntimeError(f"only {received} of {n} broadcasts arrived")
        return elapsed, []
    received = 0
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while received < n:
        if not poller.poll(30_000):
            raise RuntimeError(f"only {received} of {n} broadcasts arrived")
        while True:
            try:
                frames = _recv_frames(sub, _NOBLOCK)
            except zmq.Again:
                break
            received += 1
            if stamp:
                sent_ns = msgpack.unpackb(frames[5])[0]
                latencies.append((time.monotonic_ns() - sent_ns) / 1e6)
    elapsed = time.perf_counter() - started
    child.join(30)
    ctx.destroy(0)
    return elapsed, sorted(latencies)


def _raw_relay(n: int, topics: int) -> float:
    """The raw ceiling of the same shape: the publisher child's PUB commands into a ROUTER,
    relayed by a C loop onto a PUB as numbered BROADCASTs, counted by a C loop on a SUB (no
    validation, no journal): seconds for n."""
    ctx = zmq.Context()
    router, pub, sub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    router.setsockopt(zmq.RCVTIMEO, 30_000)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.RCVTIMEO, 30_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"/")
    collector = router.bind_to_random_port("tcp://127.0.0.1")
    sub.connect(f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}")
    time.sleep(0.3)
    ready, go = _CTX.Event(), _CTX.Event()
    child = _CTX.Process(
        target=_publisher,
        args=(f"tcp://127.0.0.1:{collector}", n, topics, 0.0, False, ready, go),
    )
    child.start()
    if not ready.wait(120):
        raise RuntimeError("publisher did not start")
    relay = threading.Thread(target=zmqloops.bus_relay, args=(router, pub, n))
    relay.start()
    go.set()
    started = time.perf_counter()
    received = zmqloops.count(sub, n)
    elapsed = time.perf_counter() - started
    relay.join()
    child.join(30)
    ctx.destroy(0)
    if received < n:
        raise RuntimeError(f"raw ceiling: only {received} of {n} broadcasts arrived")
    return elapsed


def _snapshot_seconds(serve: _Serve, chp: bool = False) -> tuple[float, int, float]:
    """A whole snapshot to a new DEALER (the seed's SYNCSTART, or with ``chp`` the Clone
    model's ICANHAZ?), counted by a C loop: (seconds, keys, hub CPU seconds)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 60_000)
    group = "eventbus_chp_" if chp else "eventbus_"
    dealer.connect("tcp://" + serve.addresses[group + "snapshot"])
    zmqloops.lib()  # built before the clock starts
    cpu0 = cpu_seconds_of_pid(serve.proc.pid)
    started = time.perf_counter()
    if chp:
        dealer.send_multipart([b"ICANHAZ?", b""])
        keys = zmqloops.count_until(dealer, b"KTHXBAI")
    else:
        dealer.send_multipart([b"SYNCSTART", b"", struct.pack(">Q", 0)])
        keys = zmqloops.count_until(dealer, b"SYNCEND")
    elapsed = time.perf_counter() - started
    hub_cpu = cpu_seconds_of_pid(serve.proc.pid) - cpu0
    ctx.destroy(0)
    if keys < 0:
        raise RuntimeError("the snapshot did not end within 60 s")
    return elapsed, keys, hub_cpu


def _wait_idle(serve: _Serve, quiet: float = 1.2, limit: float = 20.0) -> float:
    """Wait until the hub has used no CPU for ``quiet`` seconds (longer than the checkpoint
    schedule's one-second check, so the load's checkpoint is written), at most ``limit``
    seconds: the seconds waited."""
    started = time.monotonic()
    last = cpu_seconds_of_pid(serve.proc.pid)
    while time.monotonic() - started < limit:
        time.sleep(quiet)
        now = cpu_seconds_of_pid(serve.proc.pid)
        if now - last < 0.02:  # two clock ticks: timers and the checkpoint schedule's polls
            break
        last = now
    return time.monotonic() - started


def _client_sync_seconds(serve: _Serve) -> float:
    import asyncio

    from taproom.clients.eventbus import EventBusClient

    async def go() -> float:
        started = time.perf_counter()
        client = EventBusClient(["tcp://" + serve.addresses["eventbus_snapshot"]])
        await client.start(timeout=60)
        elapsed = time.perf_counter() - started
        await client.stop()
        return elapsed

    return asyncio.run(go())


def run(quick: bool) -> list[Figure]:
    figures: list[Figure] = []
    root = Path(tempfile.mkdtemp(prefix="taproom-bench-eventbus-", dir=os.environ.get("BENCH_DIR")))
    try:
        serve = _Serve(root)
        try:
            n = 20_000 if quick else 300_000
            cpu0 = cpu_seconds_of_pid(serve.proc.pid)
            elapsed, _ = _run_load(serve, n, topics=1000)
            hub_cpu = cpu_seconds_of_pid(serve.proc.pid) - cpu0
            rate = n / elapsed
            figures.append(
                Figure(
                    "PUB -> commit (fsync=always) -> BROADCAST, 200 B msgpack",
                    rate,
                    "events/s",
                    ">= 150000",
                )
            )
            # Hub, publisher and counting subscriber share 2 cores here, so the hub never has
            # a whole core: events per second of hub CPU time is what one core would carry.
            figures.append(
                Figure("  events per hub CPU-second (load-independent)", n / hub_cpu, "events/s")
            )
            raw = n / _raw_relay(n, topics=1000)
            figures.append(
                Figure("  raw ceiling: C relay ROUTER -> PUB, same clients", raw, "events/s")
            )
            figures.append(Figure("  taproom / raw ceiling", rate / raw, "x", ">= 0.5"))
            # 100,000 keys in --quick too: the goal is stated at that size, and a smaller
            # snapshot mostly measures the request's fixed costs (connect, settle, the reply)
            keys = SNAPSHOT_KEYS
            _run_load(serve, keys, topics=keys * 2)  # `keys` distinct topics
            seconds, sent, hub_cpu = _snapshot_seconds(serve)
            figures.append(
                Figure(f"snapshot of {sent:,} keys to a new DEALER", seconds, "s", "< 1")
            )
            figures.append(
                Figure("  snapshot keys per second", sent / seconds, "keys/s", ">= 400000")
            )
            figures.append(Figure("  snapshot keys per hub CPU-second", sent / hub_cpu, "keys/s"))
            # The snapshot above follows the load at once, and about every other run meets the
            # load's checkpoint of the same keys (a writer thread packing them with the GIL
            # held, ~0.1 CPU-s): the same snapshot again once the hub is idle, so the two can
            # be told apart (issue 32).
            idle = _wait_idle(serve)
            seconds, sent, hub_cpu = _snapshot_seconds(serve)
            figures.append(
                Figure(f"  the same on an idle hub (waited {idle:.1f} s)", sent / seconds, "keys/s")
            )
            figures.append(
                Figure(
                    f"EventBusClient start-up sync, {sent:,} keys (validates each)",
                    _client_sync_seconds(serve),
                    "s",
                )
            )
            half = rate / 2
            duration = 2.0 if quick else 10.0
            count = int(half * duration)
            _, latencies = _run_load(serve, count, topics=1000, rate=half, stamp=True)
            figures.append(
                Figure(
                    f"broadcast latency p50 at {half:,.0f} ev/s", percentile(latencies, 50), "ms"
                )
            )
            figures.append(
                Figure(
                    f"broadcast latency p99 at {half:,.0f} ev/s", percentile(latencies, 99), "ms"
                )
            )
        finally:
            serve.stop()
        # The CHP dialect on a bus of its own: with chp on, every event also goes out as a
        # kvmsg, so the seed's figures above are taken with it off (the default).
        serve = _Serve(root / "chp", chp=True)
        try:
            n = 20_000 if quick else 300_000
            cpu0 = cpu_seconds_of_pid(serve.proc.pid)
            elapsed, _ = _run_load(serve, n, topics=1000, kvmsg=True)
            hub_cpu = cpu_seconds_of_pid(serve.proc.pid) - cpu0
            figures.append(
                Figure(
                    "CHP: kvmsg PUSH -> PULL -> commit (fsync=always) -> PUB, 200 B body",
                    n / elapsed,
                    "events/s",
                )
            )
            figures.append(
                Figure(
                    "  kvmsg updates per hub CPU-second (load-independent)",
                    n / hub_cpu,
                    "events/s",
                )
            )
            keys = SNAPSHOT_KEYS
            _run_load(serve, keys, topics=keys, kvmsg=True)  # `keys` distinct keys
            seconds, sent, hub_cpu = _snapshot_seconds(serve, chp=True)
            figures.append(
                Figure(
                    f"CHP: ICANHAZ? snapshot of {sent:,} keys",
                    sent / seconds,
                    "keys/s",
                    ">= 400000",
                )
            )
            figures.append(Figure("  snapshot keys per hub CPU-second", sent / hub_cpu, "keys/s"))
        finally:
            serve.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return figures
