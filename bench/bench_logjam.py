"""Logjam figures (issue 5): ingest through PUSH and DEALER agents with ``fsync = always``, and
the PUB output to 1 and to 8 subscribers, each beside a raw pyzmq loop of the same message
sizes on the same machine (the ceiling; the ratio says how much of it taproom keeps).

The hub is a child process (``taproom serve`` for ingest; for the PUB figures a child that runs
the hub with the logjam service and feeds it prebuilt batches of 1000 logjam records with
``fsync = off``, so the output is measured rather than ingest). Agents and subscribers are
further processes. Beside each wall-clock rate the bench prints messages per CPU-second of the
hub (or publisher) process: on a shared machine that figure moves far less than wall time.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import zmq

from .common import Figure

# A ~300-byte logjam request body.
BODY = orjson.dumps(
    {
        "action": "Users#show",
        "code": 200,
        "total_time": 12.5,
        "started_at": "2026-11-22T08:00:00+00:00",
        "request_id": "5f0c2a1e9b7d4c3a8e6f1d2b3c4a5e6f",
        "host": "web-1.example",
        "lines": [[1, "2026-11-22T08:00:00", "Completed 200 OK in 12ms" + " " * 60]],
    }
)
APP_ENV = b"shop-production"
TOPIC = b"logs.shop.production"
_CTX = mp.get_context("spawn")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _meta(seq: int) -> bytes:
    from taproom.protocols.logjam import encode_meta

    return encode_meta(0, 0, 1_700_000_000_000, seq)


# --- ingest -----------------------------------------------------------------------------------


def _config_text(journal: str, **logjam: Any) -> str:
    lines = [
        f'[journal]\ndir = "{journal}"\nfsync = "always"\n',
        "[web]\nport = 0\n",
        "[lumberjack]\nenabled = false\n[logtk]\nenabled = false\n",
        "[eventbus]\nenabled = false\n[lager]\nenabled = false\n",
        "[logjam]\nrouter_port = 0\npull_port = 0\npub_port = 0\nreplay_port = 0\n",
        "heartbeat_interval_s = 3600.0\n",
    ]
    lines += [f"{k} = {orjson.dumps(v).decode()}\n" for k, v in logjam.items()]
    return "".join(lines)


class _Serve:
    def __init__(self, tmp: str) -> None:
        self.tmp = Path(tmp)
        cfg = self.tmp / "taproom.toml"
        cfg.write_text(_config_text(str(self.tmp / "journal")))
        ready = self.tmp / "ready.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "taproom", "serve", "-c", str(cfg), "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "serve.log", "wb"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((self.tmp / "serve.log").read_text()[-2000:])
            time.sleep(0.05)
        self.addresses = orjson.loads(ready.read_bytes())["listeners"]

    def committed(self) -> int:
        text = urllib.request.urlopen(f"http://{self.addresses['web']}/metrics").read().decode()
        m = re.search(r"^taproom_journal_appended_events_total ([0-9.e+]+)$", text, re.M)
        return int(float(m.group(1))) if m else 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _push_agent(endpoint: str, n: int, started: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.connect(endpoint)
    time.sleep(0.2)
    metas = [_meta(i + 1) for i in range(n)]
    started.value = time.time()
    send = sock.send
    more = zmq.SNDMORE
    for meta in metas:
        send(APP_ENV, more)
        send(TOPIC, more)
        send(BODY, more)
        send(meta)
    sock.close(linger=-1)
    ctx.term()


def _dealer_agent(endpoint: str, n: int, started: Any, finished: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.connect(endpoint)
    time.sleep(0.2)
    metas = [_meta(i + 1) for i in range(n)]
    send, recv = sock.send, sock.recv
    more = zmq.SNDMORE
    replies = 0
    started.value = time.time()
    for i, meta in enumerate(metas):
        send(b"", more)
        send(APP_ENV, more)
        send(TOPIC, more)
        send(BODY, more)
        send(meta)
        if i % 512 == 0:  # read replies as they come: the 202s are the measurement
            while True:
                try:
                    recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                recv(), recv()
                replies += 1
    while replies < n:
        recv()
        recv()
        recv()
        replies += 1
    finished.value = time.time()
    sock.close(linger=0)
    ctx.term()


def _ingest(quick: bool) -> list[Figure]:
    n = 60_000 if quick else 600_000
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        serve = _Serve(tmp)
        try:
            started = _CTX.Value("d", 0.0)
            base = serve.committed()
            cpu0 = _cpu_seconds(serve.proc.pid)
            agent = _CTX.Process(
                target=_push_agent, args=("tcp://" + serve.addresses["logjam_pull"], n, started)
            )
            agent.start()
            while serve.committed() < base + n:
                time.sleep(0.1)  # each scrape costs the hub CPU: not too often
            done = time.time()
            cpu = _cpu_seconds(serve.proc.pid) - cpu0
            agent.join()
            push_rate = n / (done - started.value)
            figures.append(
                Figure("ingest PUSH, 300 B JSON, fsync=always", push_rate, "msg/s", ">= 150000")
            )
            # Wall-clock rates on a shared machine undersell; the hub's own CPU time does not.
            figures.append(Figure("  per hub CPU-second (all hub threads)", n / cpu, "msg/s"))
            cpu0 = _cpu_seconds(serve.proc.pid)
            finished = _CTX.Value("d", 0.0)
            agent = _CTX.Process(
                target=_dealer_agent,
                args=("tcp://" + serve.addresses["logjam_router"], n, started, finished),
            )
            agent.start()
            agent.join()
            cpu = _cpu_seconds(serve.proc.pid) - cpu0
            dealer_rate = n / (finished.value - started.value)
            figures.append(
                Figure(
                    "ingest DEALER with 202 after commit, fsync=always",
                    dealer_rate,
                    "msg/s",
                    ">= 150000",
                )
            )
            figures.append(Figure("  per hub CPU-second (all hub threads)", n / cpu, "msg/s"))
        finally:
            serve.stop()
    raw = _raw_push_pull(n)
    figures.append(Figure("  raw pyzmq PUSH->PULL loop, same frames (ceiling)", raw, "msg/s"))
    figures.append(Figure("  ingest PUSH / raw ceiling", push_rate / raw, "ratio"))
    return figures


def _raw_pull(endpoint_q: Any, n: int, result: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint_q.put(f"tcp://127.0.0.1:{port}")
    got = 0
    recv = sock.recv
    while got < n:
        sock.poll()
        while True:  # the same burst-drain a server does, without the work
            try:
                recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            recv(), recv(), recv()
            got += 1
    result.value = time.time()
    sock.close()
    ctx.term()


def _raw_push_pull(n: int) -> float:
    q = _CTX.Queue()
    done = _CTX.Value("d", 0.0)
    started = _CTX.Value("d", 0.0)
    receiver = _CTX.Process(target=_raw_pull, args=(q, n, done))
    receiver.start()
    endpoint = q.get(timeout=30)
    sender = _CTX.Process(target=_push_agent, args=(endpoint, n, started))
    sender.start()
    receiver.join()
    sender.join()
    return n / (done.value - started.value)


# --- PUB output -------------------------------------------------------------------------------


def _subscriber(endpoint: str, n: int, ready: Any, results: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    ready.release()
    got = 0
    last = 0.0
    recv = sock.recv
    while got < n and sock.poll(5000):
        while True:
            try:
                recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            recv(), recv(), recv()
            got += 1
        last = time.time()
    results.put((got, last))
    sock.close()
    ctx.term()


def _pub_hub(journal: str, n: int, addr_q: Any, go: Any, started: Any) -> None:
    from taproom.app import App
    from taproom.config import load_config
    from taproom.records import BatchBuilder

    async def main() -> None:
        config = load_config(
            text=_config_text(journal, snd_hwm=1_000_000)
            .replace("[web]\nport = 0", "[web]\nenabled = false")
            .replace('fsync = "always"', 'fsync = "off"'),
            env={},
        )
        app = App(config, only=["logjam"])
        await app.start()
        addr_q.put(app.addresses["logjam_pub"])
        builder = BatchBuilder()
        for i in range(1000):
            builder.add(
                "logjam",
                BODY,
                stream="shop-production",
                topic="logs.shop.production",
                producer="0",
                seq=i + 1,
                ts_ns=1_700_000_000_000_000_000,
                content_type="json",
            )
        batch = builder.build()
        await asyncio.to_thread(go.wait)
        service = app.services["logjam"]
        started.value = time.time()
        futures = []
        for _ in range(n // 1000):
            await app.hub.wait_capacity()
            futures.append(app.hub.submit(batch))
            await asyncio.sleep(0)
        await asyncio.gather(*futures)
        while service.published < n:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # let libzmq flush to the subscribers before closing
        await app.stop()

    asyncio.run(main())


def _raw_pub(n: int, addr_q: Any, go: Any, started: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    addr_q.put(f"127.0.0.1:{port}")
    metas = [_meta(i + 1) for i in range(n)]
    go.wait()
    started.value = time.time()
    send = sock.send
    more = zmq.SNDMORE
    for meta in metas:
        send(APP_ENV, more)
        send(TOPIC, more)
        send(BODY, more)
        send(meta)
    time.sleep(1.0)
    sock.close(linger=-1)
    ctx.term()


def _pub_run(target: Any, args: tuple[Any, ...], n: int, subscribers: int) -> tuple[float, int]:
    addr_q, results = _CTX.Queue(), _CTX.Queue()
    go, ready = _CTX.Event(), _CTX.Semaphore(0)
    started = _CTX.Value("d", 0.0)
    hub = _CTX.Process(target=target, args=(*args, n, addr_q, go, started))
    hub.start()
    endpoint = "tcp://" + addr_q.get(timeout=60)
    subs = [
        _CTX.Process(target=_subscriber, args=(endpoint, n, ready, results))
        for _ in range(subscribers)
    ]
    for p in subs:
        p.start()
    for _ in subs:
        ready.acquire(timeout=30)
    time.sleep(0.5)  # subscriptions travel to the publisher
    assert hub.pid is not None
    cpu0 = _cpu_seconds(hub.pid)
    go.set()
    outcome = [results.get(timeout=300) for _ in subs]
    cpu = _cpu_seconds(hub.pid) - cpu0
    for p in subs:
        p.join()
    hub.join(60)
    delivered = sum(got for got, _ in outcome)
    last = max(t for _, t in outcome)
    return delivered / (last - started.value), delivered, n / cpu


def _pub(quick: bool) -> list[Figure]:
    n = 40_000 if quick else 300_000
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for subscribers in (1, 8):
            journal = os.path.join(tmp, f"j{subscribers}")
            rate, delivered, per_cpu = _pub_run(_pub_hub, (journal,), n, subscribers)
            raw, _raw_delivered, raw_per_cpu = _pub_run(_raw_pub, (), n, subscribers)
            goal = ">= 300000" if subscribers == 1 else ">= 1000000"
            unit = "msg/s" if subscribers == 1 else "deliveries/s"
            figures += [
                Figure(f"PUB output to {subscribers} subscriber(s)", rate, unit, goal),
                Figure(
                    f"  delivered of {n * subscribers}",
                    delivered,
                    "messages",
                    f"= {n * subscribers}",
                ),
                Figure("  messages per publisher CPU-second", per_cpu, "msg/s"),
                Figure("  raw pyzmq PUB loop, same frames (ceiling)", raw, unit),
                Figure("  raw: messages per publisher CPU-second", raw_per_cpu, "msg/s"),
                Figure("  taproom / raw ceiling", rate / raw, "ratio"),
            ]
    return figures


def run(quick: bool) -> list[Figure]:
    return _ingest(quick) + _pub(quick)
