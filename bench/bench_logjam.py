"""Logjam figures (issues 5, 15): ingest through PUSH and DEALER agents with ``fsync = always``,
and the PUB output to 1 and to 8 subscribers, each beside a raw libzmq C loop of the same
message sizes on the same machine (the ceiling, bench/zmqloops.c; the ratio says how much of
it taproom keeps). The agents and subscribers are C loops too (bench/zmqloops.c), so on two
cores they are not what a figure measures.

The hub is a child process (``taproom serve`` through tests/hubprocess.py for ingest; for the PUB figures a child that runs
the hub with the logjam service and feeds it prebuilt batches of 1000 logjam records with
``fsync = off``, so the output is measured rather than ingest). Agents and subscribers are
further processes.

On a 2-core machine the hub, the agent (or subscribers) and libzmq's I/O threads share the
cores, and other work on the machine takes its part too, so beside each wall-clock rate the
bench prints what is comparable across runs: messages per CPU-second of the hub (all its
threads: event loop, commit thread, libzmq I/O), the cores the hub actually got during the run,
how busy the whole machine was, and the same per-CPU figure for the raw loop (its receiving or
sending process), so the per-CPU ratio is taproom's cost against pyzmq's alone.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import zmq
from tests.hubprocess import HubProcess

from . import zmqloops
from .common import Figure, percentile

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


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (Linux /proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


class _Usage:
    """CPU taken by one process, and by the whole machine, between start and stop."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cpu0 = _cpu_seconds(pid)
        self.machine0 = _machine_jiffies()
        self.wall0 = time.monotonic()

    def stop(self) -> tuple[float, float, float]:
        """(process CPU-seconds, cores the process used, cores the whole machine used)."""
        cpu = _cpu_seconds(self.pid) - self.cpu0
        wall = time.monotonic() - self.wall0
        busy0, total0 = self.machine0
        busy1, total1 = _machine_jiffies()
        cores = os.cpu_count() or 1
        machine = (busy1 - busy0) / max(1, total1 - total0) * cores
        return cpu, cpu / wall, machine


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


def _serve(tmp: str) -> HubProcess:
    cfg = Path(tmp) / "taproom.toml"
    cfg.write_text(_config_text(str(Path(tmp) / "journal")))
    return HubProcess(cfg).start()


def _committed(hub: HubProcess) -> int:
    return int(hub.metric("taproom_journal_appended_events_total"))


def _push_agent(endpoint: str, n: int, started: Any, curve: tuple[str, str] | None = None) -> None:
    """The PUSH agent: its sends are C (bench/zmqloops.c), or on two cores a Python agent
    would be what the figure measures. ``curve``: (server key, client key file) for a CURVE
    listener (bench_access)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    if curve is not None:
        from taproom.zmqaccess import curve_client

        curve_client(sock, *curve)
    sock.connect(endpoint)
    zmqloops.lib()
    time.sleep(0.2)
    started.value = time.time()
    zmqloops.agent(sock, n, False, APP_ENV, TOPIC, BODY)
    sock.close(linger=-1)
    ctx.term()


def _dealer_agent(endpoint: str, n: int, started: Any, finished: Any) -> None:
    """The DEALER agent, in C too: sends with the empty frame, reads the 202s as they come
    (they are the measurement: the last one is the end)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)
    sock.connect(endpoint)
    zmqloops.lib()
    time.sleep(0.2)
    started.value = time.time()
    replies = zmqloops.agent(sock, n, True, APP_ENV, TOPIC, BODY)
    finished.value = time.time() if replies == n else float("nan")
    sock.close(linger=0)
    ctx.term()


def _paced_dealer(endpoint: str, rate: float, seconds: float, out: Any) -> None:
    """A DEALER sending at ``rate`` for ``seconds``: each message's send-to-202 time, sorted
    (ms). A DEALER's replies come back in order (the hub acks batches in commit order)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.connect(endpoint)
    time.sleep(0.2)
    send, recv = sock.send_multipart, sock.recv_multipart
    sent: list[float] = []
    latencies: list[float] = []
    start = time.perf_counter()
    n = int(rate * seconds)
    while len(latencies) < n:
        now = time.perf_counter()
        while len(sent) < n and len(sent) < (now - start) * rate:
            try:  # never blocked in a send: the 202s must be read all along
                send([b"", APP_ENV, TOPIC, BODY, _meta(len(sent) + 1)], zmq.NOBLOCK)
            except zmq.Again:
                break
            sent.append(time.perf_counter())
        # wait for a reply until the next send is due (not a busy loop: 2 cores are shared)
        due = (len(sent) / rate - (time.perf_counter() - start)) * 1000 if len(sent) < n else 10_000
        if not sock.poll(max(0, int(due))):
            if len(sent) == n:
                raise RuntimeError(f"only {len(latencies)} of {n} 202s arrived")
            continue
        while sock.poll(0):
            recv()
            latencies.append((time.perf_counter() - sent[len(latencies)]) * 1000)
            if len(latencies) == n:
                break
    out.put(sorted(latencies))
    sock.close(linger=0)
    ctx.term()


def _ingest_figures(
    name: str,
    n: int,
    wall: float,
    usage: tuple[float, float, float],
    raw: tuple[float, float],
    wall_goal: str,
    cpu_goal: str,
) -> list[Figure]:
    cpu, hub_cores, machine_cores = usage
    raw_rate, raw_per_cpu = raw
    rate = n / wall
    return [
        Figure(name, rate, "msg/s", wall_goal),
        # Wall-clock rates on a shared machine undersell; the hub's own CPU time does not.
        Figure("  per hub CPU-second (all hub threads)", n / cpu, "msg/s", cpu_goal),
        Figure("  cores the hub got (hub CPU-seconds / wall seconds)", hub_cores, "cores"),
        Figure(f"  cores busy on the whole machine, of {os.cpu_count()}", machine_cores, "cores"),
        Figure("  raw libzmq C loop, same frames (ceiling)", raw_rate, "msg/s"),
        Figure("  raw: per receiver CPU-second", raw_per_cpu, "msg/s"),
        Figure("  taproom / raw ceiling, wall", rate / raw_rate, "ratio", ">= 0.5"),
        Figure("  taproom / raw ceiling, per CPU-second", n / cpu / raw_per_cpu, "ratio", ">= 0.5"),
    ]


def _ingest(quick: bool) -> list[Figure]:
    n = 60_000 if quick else 600_000
    with tempfile.TemporaryDirectory() as tmp:
        hub = _serve(tmp)
        try:
            started = _CTX.Value("d", 0.0)
            base = _committed(hub)
            usage = _Usage(hub.pid)
            agent = _CTX.Process(
                target=_push_agent, args=("tcp://" + hub.addresses["logjam_pull"], n, started)
            )
            agent.start()
            while _committed(hub) < base + n:
                time.sleep(0.1)  # each scrape costs the hub CPU: not too often
            done = time.time()
            push_usage = usage.stop()
            agent.join()
            push_wall = done - started.value
            usage = _Usage(hub.pid)
            finished = _CTX.Value("d", 0.0)
            agent = _CTX.Process(
                target=_dealer_agent,
                args=("tcp://" + hub.addresses["logjam_router"], n, started, finished),
            )
            agent.start()
            agent.join()
            dealer_usage = usage.stop()
            dealer_wall = finished.value - started.value
            # commit-to-ack latency at half the DEALER rate just measured, at most 20,000 a
            # second: past that the Python client itself (send and read per message) falls
            # behind on reading the 202s on 2 shared cores, and measures its own backlog
            rate = min(n / dealer_wall / 2, 20_000.0)
            latencies = _CTX.Queue()
            agent = _CTX.Process(
                target=_paced_dealer,
                args=(
                    "tcp://" + hub.addresses["logjam_router"],
                    rate,
                    3.0 if quick else 10.0,
                    latencies,
                ),
            )
            agent.start()
            lat = latencies.get(timeout=300)
            agent.join()
        finally:
            hub.stop()
    raw_push = _raw_ingest(False, n)
    raw_dealer = _raw_ingest(True, n)
    latency = [
        Figure("ingest DEALER at half that rate: 202 latency p50", percentile(lat, 50), "ms"),
        Figure(f"  p99 (at {rate:,.0f} msg/s)", percentile(lat, 99), "ms"),
    ]
    return (
        _ingest_figures(
            "ingest PUSH, 300 B JSON, fsync=always",
            n,
            push_wall,
            push_usage,
            raw_push,
            ">= 250000",
            ">= 400000",
        )
        + _ingest_figures(
            "ingest DEALER with 202 after commit, fsync=always",
            n,
            dealer_wall,
            dealer_usage,
            raw_dealer,
            "",
            ">= 300000",
        )
        + latency
    )


def _raw_receiver(reply: bool, endpoint_q: Any, n: int, result: Any, cpu: Any) -> None:
    """The ceiling: the same messages into a bare C loop on pyzmq's libzmq (bench/zmqloops.c)
    that does nothing with them; for the DEALER shape it answers each with logjam-device's
    202 (routing id, app-env, status)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if reply else zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    zmqloops.lib()
    endpoint_q.put(f"tcp://127.0.0.1:{port}")
    sock.poll()
    cpu0 = time.process_time()
    zmqloops.receiver(sock, n, reply)
    result.value = time.time()
    cpu.value = time.process_time() - cpu0
    time.sleep(0.5)  # let the last replies reach the agent
    sock.close()
    ctx.term()


def _raw_ingest(reply: bool, n: int) -> tuple[float, float]:
    """(wall rate, messages per receiver CPU-second) of the raw loop with the bench's agent."""
    q = _CTX.Queue()
    done, cpu = _CTX.Value("d", 0.0), _CTX.Value("d", 0.0)
    started, finished = _CTX.Value("d", 0.0), _CTX.Value("d", 0.0)
    proc = _CTX.Process(target=_raw_receiver, args=(reply, q, n, done, cpu))
    proc.start()
    endpoint = q.get(timeout=60)
    if reply:
        sender = _CTX.Process(target=_dealer_agent, args=(endpoint, n, started, finished))
    else:
        sender = _CTX.Process(target=_push_agent, args=(endpoint, n, started))
    sender.start()
    proc.join()
    sender.join()
    end = finished.value if reply else done.value
    return n / (end - started.value), n / cpu.value


# --- PUB output -------------------------------------------------------------------------------


def _subscriber(endpoint: str, n: int, ready: Any, results: Any) -> None:
    """Counts whole messages in C (bench/zmqloops.c): eight Python subscribers on two cores
    would be what the figure measures."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    zmqloops.lib()
    ready.release()
    got = zmqloops.receiver(sock, n, False)
    last = time.time() - (5.0 if got < n else 0.0)  # a short count ended by the timeout
    results.put((got, last))
    sock.close()
    ctx.term()


def _pub_hub(
    journal: str, ingested: bool, n: int, addr_q: Any, go: Any, started: Any, finished: Any
) -> None:
    from taproom.app import App
    from taproom.config import load_config
    from taproom.protocols.logjam import IngestParser
    from taproom.records import BatchBuilder

    async def main() -> None:
        # The hub publishes as fast as it commits, faster than subscribers on the same two
        # cores read: queues that hold the whole run (as snd_hwm = 1,000,000 let libzmq's
        # PUB queue it, unbounded in bytes) measure throughput rather than the bound. With the
        # defaults (4 MiB a subscriber) what does not fit is dropped and counted, and
        # "delivered" shows it (docs/protocols/logjam.md).
        config = load_config(
            text=_config_text(journal, snd_hwm=1_000_000)
            .replace("[web]\nport = 0", "[web]\nenabled = false")
            .replace('fsync = "always"', 'fsync = "off"')
            + "[hub]\nmemory_budget_bytes = 1207959552\noutput_queue_bytes = 1073741824\n"
            + "[zmtp]\nmax_subscriber_bytes = 1073741824\n",
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
        if ingested:
            # As the logjam ingest builds it (same bytes, marked as logjam-only): the hot path
            # of logjam in, PUB out. Otherwise plain bytes, as batches read back from the
            # journal are: each record's protocol is checked.
            parser = IngestParser(max_body=1 << 20, max_decompressed=1 << 20)
            parser.start_batch(builder.received_ns)
            for i in range(1000):
                parser.push(APP_ENV, TOPIC, BODY, _meta(i + 1))
            fast = parser.take_batch()
            assert fast == batch
            batch = fast
        await asyncio.to_thread(go.wait)
        service: Any = app.services["logjam"]
        started.value = time.time()
        futures = []
        for _ in range(n // 1000):
            await app.hub.wait_capacity()
            futures.append(app.hub.submit(batch))
            await asyncio.sleep(0)
        await asyncio.gather(*futures)
        while service.pub.published < n:
            await asyncio.sleep(0.01)
        # Closing the publisher drops what is still queued: wait for the subscribers.
        await asyncio.to_thread(finished.wait, 300)
        await app.stop()

    asyncio.run(main())


def _raw_pub(n: int, addr_q: Any, go: Any, started: Any, finished: Any) -> None:
    """The PUB ceiling: the same frames from a bare C loop on pyzmq's libzmq."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    zmqloops.lib()
    addr_q.put(f"127.0.0.1:{port}")
    go.wait()
    started.value = time.time()
    zmqloops.publisher(sock, n, APP_ENV, TOPIC, BODY)
    finished.wait(300)
    sock.close(linger=-1)
    ctx.term()


def _pub_run(
    target: Any, args: tuple[Any, ...], n: int, subscribers: int
) -> tuple[float, int, float, float]:
    """(deliveries per second, deliveries, messages per publisher CPU-second, machine cores)."""
    addr_q, results = _CTX.Queue(), _CTX.Queue()
    go, ready, finished = _CTX.Event(), _CTX.Semaphore(0), _CTX.Event()
    started = _CTX.Value("d", 0.0)
    hub = _CTX.Process(target=target, args=(*args, n, addr_q, go, started, finished))
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
    usage = _Usage(hub.pid)
    go.set()
    outcome = [results.get(timeout=300) for _ in subs]
    cpu, _cores, machine = usage.stop()
    finished.set()
    for p in subs:
        p.join()
    hub.join(60)
    delivered = sum(got for got, _ in outcome)
    last = max(t for _, t in outcome)
    return delivered / (last - started.value), delivered, n / cpu, machine


def _pub(quick: bool) -> list[Figure]:
    n = 40_000 if quick else 300_000
    figures = []
    runs = [(1, True), (1, False), (8, True)]
    raws = {subscribers: _pub_run(_raw_pub, (), n, subscribers) for subscribers in (1, 8)}
    with tempfile.TemporaryDirectory() as tmp:
        for subscribers, ingested in runs:
            journal = os.path.join(tmp, f"j{subscribers}{ingested}")
            rate, delivered, per_cpu, machine = _pub_run(
                _pub_hub, (journal, ingested), n, subscribers
            )
            raw, _raw_delivered, raw_per_cpu, _ = raws[subscribers]
            goal = ">= 600000" if subscribers == 1 else ">= 1500000"
            unit = "msg/s" if subscribers == 1 else "deliveries/s"
            kind = "batches from logjam ingest" if ingested else "plain batches (read-back)"
            figures += [
                Figure(f"PUB output to {subscribers} subscriber(s), {kind}", rate, unit, goal),
                Figure(
                    f"  delivered of {n * subscribers}",
                    delivered,
                    "messages",
                    f"= {n * subscribers}",
                ),
                Figure("  messages per publisher CPU-second", per_cpu, "msg/s"),
                Figure(f"  cores busy on the whole machine, of {os.cpu_count()}", machine, "cores"),
                Figure("  raw libzmq C PUB loop, same frames (ceiling)", raw, unit),
                Figure("  raw: messages per publisher CPU-second", raw_per_cpu, "msg/s"),
                Figure("  taproom / raw ceiling, wall", rate / raw, "ratio", ">= 0.5"),
                Figure(
                    "  taproom / raw ceiling, per CPU-second",
                    per_cpu / raw_per_cpu,
                    "ratio",
                    ">= 0.5",
                ),
            ]
    return figures


def run(quick: bool) -> list[Figure]:
    return _ingest(quick) + _pub(quick)
