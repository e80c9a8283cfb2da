"""Lager figures (issue 7): tap -> bartender (journal, fsync=always) -> mug rows/s with 32-byte
rows (four doubles: the Tap sends nasa/lager's framing, 8 frames; a shorter run with the seed's
5-frame messages shows what the framing costs); keg write and read rows/s; registrar snapshot
time for 10,000 taps.

The bartender is a child process (``taproom serve``, one core); the tap is another child
process and the mug runs here, so the three do not share a GIL.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.backend
from tests.hubprocess import HubProcess

from taproom.clients.lager import Mug, Tap
from taproom.journal.reader import JournalReader
from taproom.protocols.lager.chp import parse_update, registration_frames
from taproom.protocols.lager.formats import parse_format_xml
from taproom.protocols.lager.keg import KegFileWriter, read_keg
from taproom.zmqframes import recv_frames

from . import zmqloops
from .common import Figure, cpu_seconds_of_pid

# 32-byte row: 4 doubles.
XML = (
    '<format version="BEERR01">'
    + "".join(f'<item name="v{i}" type="double" size="8" offset="{8 * i}"/>' for i in range(4))
    + "</format>"
)
FORMAT = parse_format_xml(XML)
_CTX = multiprocessing.get_context("spawn")


class _Serve:
    def __init__(self, tmp: Path) -> None:
        cfg = tmp / "taproom.toml"
        cfg.write_text(
            f'[journal]\ndir = "{tmp / "journal"}"\nfsync = "always"\n'
            "[web]\nport = 0\n"
            "[lumberjack]\nenabled = false\n[logtk]\nenabled = false\n"
            "[eventbus]\nenabled = false\n[logjam]\nenabled = false\n"
            "[lager]\nenabled = true\nregistrar_port = 0\nforwarder_port = 0\n"
            "max_taps = 20000\n"
        )
        self.hub = HubProcess(cfg).start()
        self.proc = self.hub.proc
        a = self.hub.addresses
        self.registrar = a["lager_registrar_snapshot"]
        self.forwarder = a["lager_forwarder_in"]
        self.collector = a["lager_registrar_collector"]
        self.publisher = a["lager_registrar_publisher"]

    def stop(self) -> None:
        self.hub.stop(60)


def _tap_process(
    registrar: str,
    forwarder: str,
    n: int,
    go: Any,
    done: Any,
    cpu: Any,
    drained: Any,
    mode: str,
) -> None:
    """``mode``: "tap" (taproom's Tap, ``log_rows``), "log_row" (the Tap a row a call), "seed"
    (the seed's 5 frames from a raw socket) or "c" (bench/zmqloops.c's C tap: the same 8
    frames as the Tap, zero items)."""
    tap = Tap("/Bench/Tap/", XML, registrar=registrar, forwarder=forwarder, watch=False,
              send_hwm=1_000_000).register()  # fmt: skip
    row = FORMAT.encode_row({f"v{i}": float(i) for i in range(4)})
    log = tap.log_row
    seed_framing = mode == "seed"
    if mode == "c":  # the registered uuid from a C loop on its own XPUB
        ctx = zmq.Context()
        raw = ctx.socket(zmq.XPUB)
        raw.setsockopt(zmq.SNDHWM, 1_000_000)
        raw.setsockopt(zmq.XPUB_NODROP, 1)
        raw.connect(f"tcp://{forwarder}")
        zmqloops.lib()  # built before the clock starts
        go.wait(60)
        c0, t0 = time.process_time(), time.thread_time()
        # waits for the forwarder's subscription, then sends blocking: push-back, no drops
        zmqloops.lager_tap(raw, n, tap.uuid, 4)
        cpu[0], cpu[1] = time.process_time() - c0, time.thread_time() - t0
        done.set()
        drained.wait(180)
        tap.close()
        raw.close()
        ctx.term()
        return
    if seed_framing:  # the seed's 5 frames (one payload frame) from a raw socket, same uuid
        ctx = zmq.Context()
        raw = ctx.socket(zmq.XPUB)
        raw.setsockopt(zmq.SNDHWM, 1_000_000)
        raw.setsockopt(zmq.XPUB_NODROP, 1)
        raw.connect(f"tcp://{forwarder}")
        raw.recv()  # the forwarder's subscription: the path is up
        send, more = zmq.backend.Socket.send, int(zmq.SNDMORE)

        def log(row: bytes, i: int | None = None) -> bool:
            try:
                send(raw, tap.uuid, more | int(zmq.NOBLOCK))
            except zmq.Again:
                return False
            send(raw, b"\x01\x00", more)
            send(raw, b"\x00\x00", more)
            send(raw, (i or 0).to_bytes(8, "big"), more)
            send(raw, row, 0)
            return True

    go.wait(60)
    c0, t0 = time.process_time(), time.thread_time()
    if mode == "tap":  # Tap.log_rows: batches of rows back to back, timestamps 0..n-1
        chunk = 1024
        rows, stamps = row * chunk, np.arange(n, dtype=np.uint64)
        i = 0
        while i < n:
            k = min(chunk, n - i)
            sent = tap.log_rows(rows[: k * len(row)], stamps[i : i + k])
            i += sent
            if sent < k:
                time.sleep(0.0005)  # the bartender pushes back: wait, never drop
    else:  # Tap.log_row, a call a row (or the seed framing's raw socket)
        for i in range(n):
            while not log(row, i):
                time.sleep(0.0005)  # the bartender pushes back: wait, never drop
    # the process (with libzmq's I/O thread, which encodes and writes) and the sending thread
    cpu[0], cpu[1] = time.process_time() - c0, time.thread_time() - t0
    done.set()
    # The tap may be far ahead (its send queue holds up to 1M rows): closing now would
    # discard what the bartender has not read yet. Wait until the mug has accounted for all.
    drained.wait(180)
    tap.close()
    if seed_framing:
        raw.close()
        ctx.term()


def _journal_rows(journal_dir: Path) -> int:
    """Data rows in the journal (batches without the one registration)."""
    reader = JournalReader(journal_dir)
    return sum(
        count for _base, count, body in reader.read_batches(0) if b"lager-registration" not in body
    )


def _pipeline(tmp: Path, n: int, mode: str = "tap") -> list[Figure]:
    """tap (``mode``, see _tap_process) -> bartender -> taproom's Mug (``recv_rows``)."""
    serve = _Serve(tmp)
    try:
        go, done, drained = _CTX.Event(), _CTX.Event(), _CTX.Event()
        tap_cpu = _CTX.Array("d", 2)
        proc = _CTX.Process(
            target=_tap_process,
            args=(serve.registrar, serve.forwarder, n, go, done, tap_cpu, drained, mode),
        )
        proc.start()
        gaps: list[int] = []
        mug = Mug(registrar=serve.registrar, forwarder=serve.forwarder,
                  on_gap=lambda _key, missed: gaps.append(missed))  # fmt: skip
        deadline = time.monotonic() + 30
        while "/Bench/Tap/" not in mug.taps and time.monotonic() < deadline:
            mug.sync() if not mug.taps else mug.poll_registrar()
            time.sleep(0.05)
        mug.subscribe("/Bench/Tap/")
        hub0 = cpu_seconds_of_pid(serve.proc.pid)
        mug0, mug_t0 = time.process_time(), time.thread_time()
        go.set()
        received = 0
        first = last = 0.0
        stalled = time.monotonic() + 30
        # Until every row is received or counted lost (marks repeat once a HUGZ round).
        while received + mug.lost < n and time.monotonic() < stalled:
            got = sum(map(len, mug.recv_rows(8192, timeout=0.2)))
            if got:
                now = time.perf_counter()
                first = first or now
                received += got
                last = now
                stalled = time.monotonic() + 10
        hub_cpu = cpu_seconds_of_pid(serve.proc.pid) - hub0
        mug_cpu, mug_thread = time.process_time() - mug0, time.thread_time() - mug_t0
        drained.set()
        proc.join(30)
        mug.close()
    finally:
        serve.stop()
    forwarded = received + mug.lost
    rate = forwarded / (last - first) if last > first else 0.0
    journal = _journal_rows(tmp / "journal")
    if mode == "c":  # the bartender's own ceiling: a C tap, so only the mug is Python
        return [
            Figure("C tap -> bartender (fsync=always) -> mug, 8 frames", rate, "rows/s"),
            Figure("  bartender CPU per row (C tap)", hub_cpu / max(forwarded, 1) * 1e6, "us"),
            Figure("  C tap CPU per row / mug CPU per row", tap_cpu[0] / n * 1e6,
                   f"us / {mug_cpu / max(received, 1) * 1e6:.2f} us"),
            Figure("  rows in the journal; received + counted lost", journal, "rows",
                   f"= {n}; {received} + {mug.lost}"),
        ]  # fmt: skip
    if mode == "log_row":  # the Tap's per-row call
        return [
            Figure("  same through Tap.log_row (a call a row)", rate, "rows/s"),
            Figure("    tap CPU per row / its own thread", tap_cpu[0] / n * 1e6,
                   f"us / {tap_cpu[1] / n * 1e6:.2f} us"),
            Figure("    rows received + counted lost", received + mug.lost, "rows", f"= {n}"),
        ]  # fmt: skip
    if mode == "seed":  # the same path with the seed's 5-frame messages: the framing's cost
        return [
            Figure("  same, seed framing (5 frames): bartender CPU per row",
                   hub_cpu / max(forwarded, 1) * 1e6, "us"),
            Figure("  same, seed framing: rows received + counted lost", received + mug.lost,
                   "rows", f"= {n}"),
        ]  # fmt: skip
    return [
        Figure("tap -> bartender (fsync=always) -> mug, 32 B rows (8 frames)", rate, "rows/s",
               ">= 250000"),
        Figure("  bartender: rows per hub CPU-second", forwarded / hub_cpu if hub_cpu else 0.0,
               "rows/cpu-s", ">= 200000"),
        Figure("  bartender CPU per row", hub_cpu / max(forwarded, 1) * 1e6, "us"),
        Figure("  tap CPU per row / mug CPU per row", tap_cpu[0] / n * 1e6,
               f"us / {mug_cpu / max(received, 1) * 1e6:.2f} us"),
        Figure("    their own threads (the rest: libzmq's I/O threads)", tap_cpu[1] / n * 1e6,
               f"us / {mug_thread / max(received, 1) * 1e6:.2f} us"),
        Figure("  rows sent by the tap", n, "rows"),
        Figure("  rows in the journal", journal, "rows", f"= {n}"),
        Figure("  rows received by the mug", received, "rows"),
        Figure("  rows the mug counted lost (marks)", mug.lost, "rows",
               f"received + lost = {received + mug.lost}"),
    ]  # fmt: skip


def _ceiling_sender(address: str, n: int) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 1_000_000)
    pub.setsockopt(zmq.XPUB_NODROP, 1)
    pub.connect(address)
    pub.recv()  # the subscription: the path is up
    items = [bytes(8)] * 4  # the bench row's four doubles, one frame each, as a Tap sends them
    uuid_bytes = uuid.uuid4().bytes
    send = zmq.backend.Socket.send
    more, last_frame = int(zmq.SNDMORE), 0
    for i in range(n):
        while True:
            try:
                send(pub, uuid_bytes, more | int(zmq.NOBLOCK))
                break
            except zmq.Again:
                time.sleep(0.0005)
        send(pub, b"BEERR01", more)
        send(pub, b"\x00", more)
        send(pub, i.to_bytes(8, "big"), more)
        for item in items[:-1]:
            send(pub, item, more)
        send(pub, items[-1], last_frame)
    pub.close(linger=5000)
    ctx.term()


def _ceiling(n: int) -> list[Figure]:
    """Raw pyzmq on this machine now: the Tap's 8-frame message (nasa/lager framing of the bench
    row: header + 4 items) PUB -> SUB, Python at both ends, no bartender.
    The bartender receives each row like this and sends it again, so half this rate is about
    what a Python forwarder can reach before doing any work of its own."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1_000_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    address = sub.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
    proc = _CTX.Process(target=_ceiling_sender, args=(address, n))
    proc.start()
    got = 0
    sub.poll(30_000)  # the sender's start (a spawned interpreter)
    first = time.perf_counter()
    c0 = time.process_time()
    while got < n and sub.poll(10_000):
        while True:
            try:
                recv_frames(sub, 8)
            except zmq.Again:
                break
            got += 1
    last = time.perf_counter()
    cpu = time.process_time() - c0
    proc.join(30)
    ctx.destroy(linger=0)
    return [
        Figure("raw pyzmq ceiling: 8-frame PUB -> SUB, Python both ends",
               got / (last - first) if last > first else 0.0, "msgs/s"),
        Figure("  receiver CPU per message", cpu / max(got, 1) * 1e6, "us"),
    ]  # fmt: skip


def _c_tap(address: str, n: int) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 1_000_000)
    pub.setsockopt(zmq.XPUB_NODROP, 1)
    pub.connect(address)
    zmqloops.lager_tap(pub, n, uuid.uuid4().bytes, 4)
    pub.close(linger=60_000)
    ctx.term()


def _c_ceiling(n: int) -> float:
    """The raw C ceiling of the pipeline's shape: a C tap's 8-frame rows (XPUB) -> a C loop
    forwarding each message as it is (SUB -> XPUB, as the bartender's sockets) -> a C loop
    counting them on a SUB. No journal, no checks: rows/s from the first row to the last."""
    ctx = zmq.Context()
    sub_in, out, mug = ctx.socket(zmq.SUB), ctx.socket(zmq.XPUB), ctx.socket(zmq.SUB)
    for sock in (sub_in, mug):
        sock.setsockopt(zmq.RCVHWM, 1_000_000)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    out.setsockopt(zmq.SNDHWM, 1_000_000)
    out.setsockopt(zmq.XPUB_NODROP, 1)
    sub_in.bind("tcp://127.0.0.1:*")
    out.bind("tcp://127.0.0.1:*")
    mug.connect(out.getsockopt(zmq.LAST_ENDPOINT).decode())  # type: ignore[union-attr]
    time.sleep(0.3)
    address = sub_in.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
    proc = _CTX.Process(target=_c_tap, args=(address, n))
    proc.start()
    relay = threading.Thread(target=zmqloops.forward, args=(sub_in, out, n))
    relay.start()
    got = zmqloops.count(mug, 1)  # the first row: the spawned tap is up
    first = time.perf_counter()
    got += zmqloops.count(mug, n - 1)
    elapsed = time.perf_counter() - first
    relay.join()
    proc.join(60)
    ctx.destroy(linger=0)
    if got < n:
        raise RuntimeError(f"raw C ceiling: only {got} of {n} rows arrived")
    return (n - 1) / elapsed


def _keg(tmp: Path, n: int) -> list[Figure]:
    path = tmp / "bench.lgr"
    u1, u2 = uuid.uuid4(), uuid.uuid4()
    rows = np.random.default_rng(1).random((n, 4)).astype(">f8").tobytes()
    row = rows[:32]
    ts = np.arange(n, dtype=np.uint64)
    figures = []
    # Per-record writes (what a keg writer does with live rows).
    t0 = time.perf_counter()
    with KegFileWriter(path, {str(u1): FORMAT, str(u2): FORMAT}, fsync=True) as w:
        write = w.write
        b1 = u1.bytes
        for i in range(n):
            write(b1, i, row)
    figures.append(Figure("keg write, one record per call", n / (time.perf_counter() - t0),
                          "rows/s", ">= 1000000"))  # fmt: skip
    t0 = time.perf_counter()
    with KegFileWriter(path, {str(u1): FORMAT, str(u2): FORMAT}, fsync=True) as w:
        chunk = 65536
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            w.write_many(u1.bytes, ts[start:end], rows[start * 32 : end * 32])
    figures.append(Figure("keg write, write_many batches", n / (time.perf_counter() - t0),
                          "rows/s", ">= 1000000"))  # fmt: skip
    t0 = time.perf_counter()
    keg = read_keg(path)
    table = keg.table(str(u1))
    elapsed = time.perf_counter() - t0
    assert len(table["v0"]) == n
    figures.append(Figure("keg read + decode to columns", n / elapsed, "rows/s", ">= 1000000"))
    # Mixed row sizes: the record walk cannot use a fixed stride.
    other = parse_format_xml('<format version="BEERR01"><item name="a" type="uint8" size="1" '
                             'offset="0"/></format>')  # fmt: skip
    with KegFileWriter(path, {str(u1): FORMAT, str(u2): other}, fsync=False) as w:
        half = n // 2
        w.write_many(u1.bytes, ts[:half], rows[: half * 32])
        w.write_many(u2.bytes, ts[:half], b"\x01" * half)
    t0 = time.perf_counter()
    keg = read_keg(path)
    keg.table(str(u1))
    keg.table(str(u2))
    figures.append(Figure("keg read, two taps of different row sizes",
                          keg.record_count / (time.perf_counter() - t0), "rows/s", ">= 1000000"))  # fmt: skip
    # The same taps interleaved row by row (what a keg writer recording both produces).
    with KegFileWriter(path, {str(u1): FORMAT, str(u2): other}, fsync=False) as w:
        write = w.write
        b1, b2 = u1.bytes, u2.bytes
        for i in range(n // 2):
            write(b1, i, row)
            write(b2, i, b"\x01")
    t0 = time.perf_counter()
    keg = read_keg(path)
    keg.table(str(u1))
    keg.table(str(u2))
    figures.append(Figure("keg read, two taps of different row sizes, interleaved",
                          keg.record_count / (time.perf_counter() - t0), "rows/s", ">= 1000000"))  # fmt: skip
    return figures


def _snapshot(tmp: Path, taps: int) -> list[Figure]:
    serve = _Serve(tmp)
    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.connect(f"tcp://{serve.collector}")
        pub.recv()  # the collector's subscription: the path is up
        updates = ctx.socket(zmq.SUB)
        updates.setsockopt(zmq.SUBSCRIBE, b"/")
        updates.setsockopt(zmq.RCVHWM, 0)
        updates.connect(f"tcp://{serve.publisher}")
        time.sleep(0.3)
        t0 = time.perf_counter()
        for i in range(taps):
            # A distinct format per tap (item names differ): no parse is shared by a cache.
            xml = XML.replace('name="v0"', f'name="t{i}"')
            pub.send_multipart(
                registration_frames(f"/Fleet{i % 100}/Tap{i}/", uuid.uuid4().bytes, xml)
            )
        seen = 0
        while seen < taps and updates.poll(20_000):
            updates.recv_multipart()
            seen += 1
        register_rate = seen / (time.perf_counter() - t0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://{serve.registrar}")
        t0 = time.perf_counter()
        dealer.send_multipart([b"ICANHAZ?", b""])
        messages = []
        while True:
            frames = dealer.recv_multipart()
            messages.append(frames)
            if frames[0] == b"KTHXBAI":
                break
        received = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = sum(parse_update(m).registration is not None for m in messages)
        parsed = time.perf_counter() - t0
        return [
            Figure(f"registrar snapshot of {got} taps (ICANHAZ? -> KTHXBAI)", received, "s",
                   "< 1"),
            Figure("  + validating every format XML on the mug side", parsed, "s"),
            Figure("registrations committed + published", register_rate, "taps/s"),
        ]  # fmt: skip
    finally:
        ctx.destroy(linger=0)
        serve.stop()


def run(quick: bool) -> list[Figure]:
    root = Path(tempfile.mkdtemp(prefix="taproom-bench-lager-", dir=os.environ.get("BENCH_DIR")))
    try:
        figures = []
        for name, fn, arg in (
            ("pipe", _pipeline, 100_000 if quick else 1_000_000),
            ("log_row", lambda tmp, k: _pipeline(tmp, k, "log_row"), 30_000 if quick else 300_000),
            ("ctap", lambda tmp, k: _pipeline(tmp, k, "c"), 100_000 if quick else 1_000_000),
            ("seed", lambda tmp, k: _pipeline(tmp, k, "seed"), 30_000 if quick else 300_000),
            ("ceiling", lambda _tmp, k: _ceiling(k), 100_000 if quick else 500_000),
            ("keg", _keg, 300_000 if quick else 3_000_000),
            ("snap", _snapshot, 2_000 if quick else 10_000),
        ):
            sub = root / name
            sub.mkdir()
            figures += fn(sub, arg)
        cpu = {f.name.strip(): f.value for f in figures}
        raw_c = _c_ceiling(100_000 if quick else 1_000_000)
        figures.append(Figure("raw C ceiling: C tap -> C forward (SUB -> XPUB) -> C count",
                              raw_c, "rows/s"))  # fmt: skip
        pipe = cpu.get("tap -> bartender (fsync=always) -> mug, 32 B rows (8 frames)")
        if pipe:
            figures.append(Figure("  taproom pipeline / raw C ceiling, wall", pipe / raw_c,
                                  "ratio", ">= 0.5"))  # fmt: skip
        c_pipe = cpu.get("C tap -> bartender (fsync=always) -> mug, 8 frames")
        if c_pipe:
            figures.append(Figure("  same with the C tap / raw C ceiling, wall", c_pipe / raw_c,
                                  "ratio"))  # fmt: skip
        hub, raw = cpu.get("bartender CPU per row"), cpu.get("receiver CPU per message")
        if hub and raw:  # both measured in this run, on this (shared) machine
            figures.append(Figure("bartender CPU per row / raw pyzmq receive CPU per message",
                                  hub / raw, "x (receive+send+journal vs receive only)"))  # fmt: skip
        return figures
    finally:
        shutil.rmtree(root, ignore_errors=True)
