"""LogTK figures (issue 4): events/s over TCP and over WebSocket with 16 connections, 256
unacked data frames in flight each, 200-byte payloads, ``fsync = always``; then ack latency
p50/p99 at half that load.

Restart (issue 17 item 2): seconds from starting ``taproom serve`` to its ready file with 1 M
and 10 M LogTK records in the idempotency window: without a checkpoint (the window is read from
the journal), from the checkpoint written at the previous stop, and from that checkpoint plus
100 k records committed after it (a SIGKILL between checkpoints), next to an empty journal.

The hub runs as a child process (``taproom serve`` with a ready file) pinned to one core; this
process is the load generator (pinned to another core when there is one). The generator keeps
pre-encoded frames and counts acks by their fixed 7-byte size, so it stays cheap next to the
hub it measures.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from tests.hubprocess import HubProcess

from taproom.protocols.logtk import Data, FrameDecoder, Init, encode_frame

from .common import Figure, percentile, rss_of_pid_kib

TOKEN = hashlib.sha512(b"taproom bench logtk").digest()  # 64 bytes
PAYLOAD = b'{"level":"info","msg":"' + b"x" * 170 + b'"}'  # 200 bytes
CONNECTIONS = 16
WINDOW = 256
ACK_SIZE = 7
_IDEM = struct.Struct(">I")


def _start_hub(root: str, logtk_extra: str = "") -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    cfg = Path(root) / "taproom.toml"
    cfg.write_text(
        f'[journal]\ndir = "{root}/journal"\nfsync = "always"\n'
        "[web]\nenabled = false\n"
        '[hub]\nlog_level = "INFO"\ngrace_period_s = 120\n'
        "[lumberjack]\nenabled = false\n[logjam]\nenabled = false\n"
        "[eventbus]\nenabled = false\n[lager]\nenabled = false\n"
        "[logtk]\nenabled = true\nws_port = 0\ntcp_port = 0\nping_enabled = false\n"
        f"{logtk_extra}"
        f'[logtk.apps.bench]\ntoken_sha256 = "{hashlib.sha256(TOKEN).hexdigest()}"\n'
    )
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, {cpus[0]})

    hub = HubProcess(cfg, preexec_fn=pin).start(timeout=600)
    if len(cpus) > 1:
        os.sched_setaffinity(0, set(cpus[1:]))
    assert hub.proc is not None
    return hub.proc, hub.addresses


class _Link:
    """One connection: handshake done, then ``write`` bytes / ``read`` bytes."""

    async def open(self, transport: str, address: str, client_id: int) -> None:
        host, port = address.rsplit(":", 1)
        init = encode_frame(Init("json", client_id, None, False))
        if transport == "tcp":
            self.reader, self.writer = await asyncio.open_connection(host, int(port))
            self.writer.write(b"\x01\x01" + TOKEN + b"\x00" + init)
            decoder = FrameDecoder()
            got: list[object] = []
            while len(got) < 2:  # auth status, init answer
                got += decoder.feed(await self.reader.read(1024))
            self.ws = None
        else:
            from websockets.asyncio.client import connect

            self.ws = await connect(
                f"ws://{host}:{port}/logging/bench",
                subprotocols=["logtk"],  # type: ignore[list-item]
                additional_headers={"X-LogTK-Auth": base64.b64encode(TOKEN).decode()},
                max_size=None,
            )
            await self.ws.send(init)
            await self.ws.recv()

    async def write(self, data: bytes) -> None:
        if self.ws is None:
            self.writer.write(data)
            await self.writer.drain()
        else:
            await self.ws.send(data)

    async def read(self) -> bytes:
        if self.ws is None:
            return await self.reader.read(1 << 20)
        message = await self.ws.recv()
        return message if isinstance(message, bytes) else message.encode()

    async def close(self) -> None:
        if self.ws is None:
            self.writer.close()
        else:
            await self.ws.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux), to normalise rates on a busy machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _throughput(
    transport: str, address: str, seconds: float, base_id: int, hub_pid: int
) -> tuple[float, float]:
    """Every connection keeps WINDOW frames unacked: (events acked per second, events per
    second of hub CPU time)."""
    links = [_Link() for _ in range(CONNECTIONS)]
    await asyncio.gather(
        *(link.open(transport, address, base_id + i) for i, link in enumerate(links))
    )
    acked = 0
    stop = False

    async def drive(link: _Link, conn: int) -> None:
        nonlocal acked
        idem = conn << 24
        frames = [encode_frame(Data(PAYLOAD, (idem + i) & 0xFFFFFFFF)) for i in range(WINDOW)]
        await link.write(b"".join(frames))
        idem += WINDOW
        leftover = 0
        while not stop:
            data = await link.read()
            if not data:
                return
            total = leftover + len(data)
            n, leftover = divmod(total, ACK_SIZE)
            acked += n
            if n and not stop:
                out = [encode_frame(Data(PAYLOAD, (idem + i) & 0xFFFFFFFF)) for i in range(n)]
                idem += n
                await link.write(b"".join(out))

    tasks = [asyncio.create_task(drive(link, i)) for i, link in enumerate(links)]
    await asyncio.sleep(0.5)  # warm-up
    start_acked, t0, cpu0 = acked, time.perf_counter(), _cpu_seconds(hub_pid)
    await asyncio.sleep(seconds)
    done = acked - start_acked
    rate = done / (time.perf_counter() - t0)
    per_cpu = done / max(1e-9, _cpu_seconds(hub_pid) - cpu0)
    stop = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
    return rate, per_cpu


async def _latency(
    transport: str, address: str, rate: float, seconds: float, base_id: int
) -> list[float]:
    """Paced sends at ``rate`` events/s in total; ack latency of each event (seconds)."""
    links = [_Link() for _ in range(CONNECTIONS)]
    await asyncio.gather(
        *(link.open(transport, address, base_id + i) for i, link in enumerate(links))
    )
    latencies: list[float] = []
    per_conn = rate / CONNECTIONS
    tick = 0.005
    stop = False

    async def drive(link: _Link, conn: int) -> None:
        sent: dict[int, float] = {}
        idem = conn << 24

        async def reader() -> None:
            buf = b""
            while True:
                data = await link.read()
                if not data:
                    return
                buf += data
                now = time.perf_counter()
                usable = len(buf) - len(buf) % ACK_SIZE
                for pos in range(0, usable, ACK_SIZE):
                    t = sent.pop(_IDEM.unpack_from(buf, pos + 2)[0], None)
                    if t is not None:
                        latencies.append(now - t)
                buf = buf[usable:]

        read_task = asyncio.create_task(reader())
        owed = 0.0
        while not stop:
            owed += per_conn * tick
            n = int(owed)
            owed -= n
            if n and len(sent) < WINDOW:
                now = time.perf_counter()
                frames = []
                for _ in range(n):
                    idem = (idem + 1) & 0xFFFFFFFF
                    sent[idem] = now
                    frames.append(encode_frame(Data(PAYLOAD, idem)))
                await link.write(b"".join(frames))
            await asyncio.sleep(tick)
        await asyncio.sleep(0.5)
        read_task.cancel()

    tasks = [asyncio.create_task(drive(link, i)) for i, link in enumerate(links)]
    await asyncio.sleep(seconds)
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
    return sorted(latencies)


def _fill_journal(root: str, first: int, count: int) -> None:
    """``count`` LogTK records as the server writes them (received now, 1000 clients), in
    batches of 10,000; fsync once at the end."""
    from taproom.journal import Journal
    from taproom.records import BatchBuilder

    journal = Journal(f"{root}/journal", fsync="off")
    try:
        for start in range(first, first + count, 10_000):
            builder = BatchBuilder()
            for n in range(start, min(start + 10_000, first + count)):
                client, idem = n % 1000, n // 1000
                builder.add(
                    "logtk",
                    b'{"n":%d}' % n,
                    stream="bench",
                    producer=f"{client:08x}",
                    seq=idem,
                    event_id=f"bench:{client:08x}:{idem:08x}",
                    content_type="json",
                )
            journal.commit([builder.build()])
        journal.sync()
    finally:
        journal.close()


def _time_to_ready(root: str, extra: str) -> tuple[float, float, float, float]:
    """Seconds from spawning ``taproom serve`` to its ready file; the seconds its log gives for
    the LogTK index alone; its CPU seconds by then (what a loaded machine distorts least); its
    RSS in MiB. Stopped with SIGTERM, so the LogTK index is checkpointed at stop."""
    started = time.perf_counter()
    proc, _listeners = _start_hub(root, extra)
    elapsed = time.perf_counter() - started
    cpu = _cpu_seconds(proc.pid)
    rss = rss_of_pid_kib(proc.pid) / 1024
    proc.terminate()
    try:
        proc.wait(300)
    except subprocess.TimeoutExpired:
        proc.kill()
    log = (Path(root) / "taproom.log").read_text(errors="replace")  # HubProcess: beside the config
    index = [float(s) for s in re.findall(r"idempotency index of .* in ([0-9.]+) s", log)]
    return elapsed, index[-1] if index else float("nan"), cpu, rss


def _restart_figures(quick: bool) -> list[Figure]:
    figures: list[Figure] = []
    sizes = (100_000,) if quick else (1_000_000, 10_000_000)
    tail = 10_000 if quick else 100_000
    for size in sizes:
        root = tempfile.mkdtemp(prefix="taproom-bench-logtk-", dir=os.environ.get("BENCH_DIR"))
        # An hour's window holding every record, and an index allowed to hold them all.
        extra = f"dedup_max_entries = {size + 2 * tail}\n"
        label = f"{size / 1e6:g} M" if size >= 1e6 else f"{size / 1e3:g} k"
        try:
            runs = {"empty journal": _time_to_ready(root, extra)}
            _fill_journal(root, 0, size)
            # No checkpoint yet: the window is read from the journal; one is written at stop.
            runs["no checkpoint"] = _time_to_ready(root, extra)
            runs["from checkpoint"] = _time_to_ready(root, extra)
            _fill_journal(root, size, tail)  # committed after that checkpoint
            runs[f"checkpoint + {tail // 1000} k tail"] = _time_to_ready(root, extra)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for name, (elapsed, index, cpu, rss) in runs.items():
            goal = "< 2 at 10 M" if name == "from checkpoint" else ""
            figures += [
                Figure(f"restart {label}, {name}: to ready", elapsed, "s", goal),
                Figure(f"restart {label}, {name}: LogTK index (hub log)", index, "s"),
                Figure(f"restart {label}, {name}: hub CPU to ready", cpu, "s"),
                Figure(f"restart {label}, {name}: hub RSS", rss, "MiB"),
            ]
    return figures


def run(quick: bool) -> list[Figure]:
    figures = _restart_figures(quick)
    seconds = 2.0 if quick else 12.0
    root = tempfile.mkdtemp(prefix="taproom-bench-logtk-", dir=os.environ.get("BENCH_DIR"))
    proc, listeners = _start_hub(root)
    try:
        for k, transport in enumerate(("tcp", "ws")):
            address = listeners[f"logtk_{transport}"]
            rate, per_cpu = asyncio.run(
                _throughput(transport, address, seconds, 1000 * (k + 1), proc.pid)
            )
            figures.append(
                Figure(
                    f"{transport}: 16 conns x 256 in flight, 200 B, fsync=always",
                    rate,
                    "events/s",
                    ">= 100,000",
                )
            )
            figures.append(
                Figure(
                    f"{transport}:   events per second of hub CPU time (load-independent)",
                    per_cpu,
                    "events/s",
                    ">= 100,000",
                )
            )
            lat = asyncio.run(_latency(transport, address, rate / 2, seconds, 1000 * (k + 3)))
            figures.append(
                Figure(
                    f"{transport}: ack latency p50 at half load", percentile(lat, 50) * 1000, "ms"
                )
            )
            figures.append(
                Figure(
                    f"{transport}: ack latency p99 at half load", percentile(lat, 99) * 1000, "ms"
                )
            )
        figures.append(Figure("hub RSS after the runs", rss_of_pid_kib(proc.pid) / 1024, "MiB"))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    return figures
