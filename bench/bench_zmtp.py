"""Reading a bound ZeroMQ socket: libzmq, a ZMQ_STREAM socket, taproom's own transport
(issue 26.2: the measurements behind docs/architecture.md decision 12).

The same load arrives at each candidate: logjam messages (4 frames, a 300-byte JSON body)
from libzmq PUSH sockets run by the benches' C load generator in child processes, so what is
measured is the receiving process alone. Each candidate only receives whole messages (no
ingest), as its burst paths hand them to the protocol kernels:

* ``libzmq PULL``: taproom's compiled burst reader on a libzmq PULL (the path before issue 26);
* ``ZMQ_STREAM``: the raw bytes a STREAM socket hands over (a greeting and READY sent back,
  then only counted: a lower bound, with no ZMTP parsing at all);
* ``taproom ZMTP``: taproom's transport (asyncio, in-place scanning, compiled or Python).

Figures: messages per second of wall time and per CPU-second of the receiving process (its
libzmq I/O thread included), and the receiving process's peak RSS growth.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import zmq

from taproom import zmqburst
from taproom.budget import MemoryBudget
from taproom.config import load_config
from taproom.metrics import Metrics
from taproom.protocols import zmtp as zp
from taproom.servers.zmtp import ZmtpSocket
from taproom.supervise import Supervisor

from .common import Figure, peak_rss_mib

SENDERS = 4
BODY = b'{"action":"Shop#show","code":200,"total_time":12.5,"pad":"' + b"x" * 240 + b'"}'
MESSAGE_BYTES = len(b"app-prod") + len(b"logs.shop") + len(BODY) + 24

_SENDER = """
import sys, zmq
from bench import zmqloops
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.setsockopt(zmq.LINGER, -1)
sock.connect(sys.argv[1])
zmqloops.agent(sock, int(sys.argv[2]), False, b"app-prod", b"logs.shop", bytes.fromhex(sys.argv[3]))
sock.close()
zmq.Context.instance().term()  # LINGER -1: every message is sent before the process exits
"""


def _senders(address: str, n: int) -> list[subprocess.Popen[bytes]]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [
        subprocess.Popen(
            [sys.executable, "-c", _SENDER, address, str(n // SENDERS), BODY.hex()], cwd=root
        )
        for _ in range(SENDERS)
    ]


def _measure(name: str, n: int, run: object) -> list[Figure]:
    before_rss = peak_rss_mib()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    got = run()  # type: ignore[operator]
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert got == n, f"{name}: {got} of {n} messages"
    return [
        Figure(f"{name}: messages/s", n / wall, "msg/s"),
        Figure(f"{name}: messages per receiver CPU-second", n / cpu, "msg/cpu-s"),
        Figure(f"{name}: receiver peak RSS growth", peak_rss_mib() - before_rss, "MiB"),
    ]


def _libzmq(n: int) -> int:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    senders = _senders(f"tcp://127.0.0.1:{port}", n)
    reader = zmqburst.reader(pull, 6)
    got = 0
    while got < n:
        if pull.poll(10_000):
            got += reader.recv(4096, 4 << 20).n
        else:
            break
    for s in senders:
        s.wait()
    ctx.destroy(0)
    return got


def _stream(n: int) -> int:
    """Whole messages are not cut out here: the byte count says when all arrived."""
    ctx = zmq.Context()
    stream = ctx.socket(zmq.STREAM)
    port = stream.bind_to_random_port("tcp://127.0.0.1")
    senders = _senders(f"tcp://127.0.0.1:{port}", n)
    hello = zp.Greeting(3, 1, b"NULL", True).serialize() + zp.encode_command(
        b"READY", zp.encode_metadata({b"Socket-Type": b"PULL"})
    )
    per_message = sum(len(zp.encode_frame(b"x" * k)) for k in (8, 9, len(BODY), 24))
    peer_handshake = 64 + len(
        zp.encode_command(b"READY", zp.encode_metadata({b"Socket-Type": b"PUSH"}))
    )
    total = n * per_message + SENDERS * peer_handshake
    received = 0
    greeted: set[bytes] = set()
    recv = stream.recv
    while received < total:
        if not stream.poll(10_000):
            break
        peer = recv(copy=False)
        data = recv(copy=False)
        if peer.bytes not in greeted:  # a new peer (libzmq says so with an empty message)
            greeted.add(peer.bytes)
            stream.send_multipart([peer.bytes, hello])
        received += len(data)
    for s in senders:
        s.wait()
    ctx.destroy(0)
    return n if received >= total else received // per_message


def _taproom(n: int) -> int:
    class Hub:
        config = load_config()
        metrics = Metrics()
        budget = MemoryBudget(config, metrics)
        supervisor = Supervisor(config.hub, metrics)

    async def main() -> int:
        sock = ZmtpSocket(
            "PULL", hub=Hub(), protocol="bench", name="logjam_pull", max_message_bytes=1 << 20
        )  # type: ignore[arg-type]
        address = await sock.bind("127.0.0.1", 0)
        senders = _senders("tcp://" + address, n)
        reader = sock.reader(6)
        got = 0
        while got < n:
            await asyncio.wait_for(sock.wait_readable(), 10)
            got += reader.recv(4096, 4 << 20).n
        for s in senders:
            await asyncio.to_thread(s.wait)
        sock.close()
        return got

    return asyncio.run(main())


def run(quick: bool) -> list[Figure]:
    n = 200_000 if quick else 2_000_000
    figures = [Figure("message size (4 frames)", MESSAGE_BYTES, "bytes")]
    figures += _measure("libzmq PULL + compiled burst reader", n, lambda: _libzmq(n))
    figures += _measure("ZMQ_STREAM, bytes only", n, lambda: _stream(n))
    for path in ("ext", "py"):
        if path == "ext" and zmqburst.ext_status() != "compiled":
            continue
        before = zmqburst.active()
        zmqburst.select(path)
        try:
            figures += _measure(f"taproom ZMTP ({path})", n, lambda: _taproom(n))
        finally:
            zmqburst.select(before)
    return figures
