"""Logjam ingest holds to the hub's memory bound while the journal cannot commit (issues 18, 19).

The hub is a real ``taproom serve`` process whose journal sits on a small tmpfs that is filled
to the last byte after start: every commit fails with ENOSPC and nothing is acked. Agents keep
sending; the read loops must stop reading (libzmq's ``rcv_hwm`` then pushes back on the agents)
and a burst of small compressed bodies must not inflate past ``burst_bytes``. The promise: the
hub's peak RSS stays within 2 x ``max_pending_bytes`` + 100 MB, whatever the sender does. An
idle hub took 61 MB when that goal was set, so the tests hold what the sender can add to the
idle hub's RSS to 2 x ``max_pending_bytes`` + 40 MB (what an idle hub takes has since grown
with the web console's pyarrow: see the report). Under ``make soak`` the same runs take the
issue's sizes and the default bound.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import zmq

from taproom.protocols import logjam as lj
from tests.support import SOAK, HubProcess, write_config
from tests.web.test_ops import fill, small_tmpfs

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0, reason="a real full filesystem needs root to mount tmpfs"
    ),
    # on taproom.zmqburst's compiled path and on its pure-Python twin
    pytest.mark.usefixtures("zmq_path"),
]

MiB = 1024 * 1024
# `make test`: a 16 MiB bound; `make soak`: the default 64 MiB and the message counts.
MAX_PENDING = 64 * MiB if SOAK else 16 * MiB
GROWTH_LIMIT = 2 * MAX_PENDING + 40 * 1000 * 1000


def rss(pid: int, field: str = "VmHWM") -> int:
    """The process's peak (VmHWM) or current (VmRSS) resident set, in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


def metric(hub: HubProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://{hub.addresses['web']}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@contextlib.contextmanager
def hub_on_a_full_disk(
    tmp_path: Path, size: str, **logjam
) -> Iterator[tuple[HubProcess, Path, int]]:
    """A hub whose journal's filesystem is full; yields it, the filler and its idle RSS."""
    with small_tmpfs(tmp_path / "mnt", size) as mnt:
        config = write_config(
            tmp_path,
            enable=["logjam"],
            journal={"dir": str(mnt / "journal")},
            hub={"max_pending_bytes": MAX_PENDING},
            logjam=dict({"heartbeat_interval_s": 3600.0}, **logjam),
        )
        with HubProcess(config) as hub:
            filler = fill(mnt)
            time.sleep(0.5)  # settled
            yield hub, filler, rss(hub.proc.pid, "VmRSS")


def push_socket(hub: HubProcess) -> zmq.Socket:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1000)
    push.setsockopt(zmq.LINGER, 0)
    push.connect("tcp://" + hub.addresses["logjam_pull"])
    return push


def send_until_blocked(push: zmq.Socket, messages: Iterator[list[bytes]], stall_s: float) -> int:
    """Send ``messages`` without blocking until they run out or the hub stops taking them
    for ``stall_s``; how many were sent. The one that found the queue full is sent again by
    the next call."""
    sent = 0
    stalled_since = None
    for frames in messages:
        while True:
            try:
                push.send_multipart(frames, zmq.NOBLOCK)
                break
            except zmq.Again:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > stall_s:
                    return sent
                time.sleep(0.01)
        sent += 1
        stalled_since = None
    return sent


def test_8k_messages_against_a_full_disk_stay_within_the_bound_and_are_kept(tmp_path):
    """Issue 18 item 4: 20,000 8 KiB messages with the disk full put 69.8 MB pending (bound
    64 MiB) and +227 MB RSS. Now the sender is pushed back, RSS stays within the bound, and
    once space returns every message libzmq took is committed."""
    count = 20_000 if SOAK else 12_000
    message = [b"app-prod", b"logs", orjson.dumps({"pad": "x" * 8180}), lj.encode_meta(0, 1, 1, 1)]
    with hub_on_a_full_disk(tmp_path, f"{count * 9 // 1024 + 64}m") as (hub, filler, idle):
        push = push_socket(hub)
        sent = send_until_blocked(push, iter([message] * count), 3.0)
        peak = rss(hub.proc.pid)
        held = metric(hub, "taproom_hub_pending_bytes") + metric(
            hub, "taproom_hub_admission_waiting_bytes"
        )
        print(
            f"8 KiB x {sent} taken while full: pending + waiting {held / MiB:.1f} MiB, "
            f"RSS idle {idle / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB"
        )
        assert sent < count, "never pushed back: the hub read without bound"
        assert held <= MAX_PENDING + 2 * 4 * MiB
        assert peak - idle <= GROWTH_LIMIT, f"+{(peak - idle) / MiB:.0f} MiB"
        filler.unlink()
        sent += send_until_blocked(push, iter([message] * (count - sent)), 60.0)
        assert sent == count
        deadline = time.monotonic() + 60
        while metric(hub, "taproom_ingest_accepted_events_total") < count or metric(
            hub, "taproom_hub_pending_bytes"
        ):
            assert time.monotonic() < deadline, "not every message was committed"
            time.sleep(0.2)
        push.close()
        assert rss(hub.proc.pid) - idle <= GROWTH_LIMIT


def test_a_burst_of_compressed_bodies_does_not_inflate_past_the_bound(tmp_path):
    """Issue 19 item 7: 490 KB of zlib bodies took the hub to 1.55 GB. Each body here inflates
    to max_decompressed_bytes; a burst ends at burst_bytes and no burst starts while the hub
    is full, so what waits is the compressed bytes in libzmq."""
    # soak: the most a body may inflate to beside a 4 MiB burst under the default
    # hub.max_inflate_bytes (16 MiB: the configuration refuses more)
    inflated = 12 * MiB if SOAK else 4 * MiB
    body = zlib.compress(b"[" + b" " * (inflated - 2) + b"]", 9)
    count = 490_000 // len(body) + 1
    meta = lj.encode_meta(1, 1, 1_700_000_000_000, 1)
    messages = iter([[b"app-prod", b"logs", body, meta]] * count)
    with hub_on_a_full_disk(tmp_path, "4m", max_decompressed_bytes=inflated) as (hub, _, idle):
        push = push_socket(hub)
        sent = send_until_blocked(push, messages, 3.0)
        assert sent == count  # small on the wire: libzmq takes them all
        deadline = time.monotonic() + 30
        while (
            metric(hub, "taproom_hub_pending_bytes")
            + metric(hub, "taproom_hub_admission_waiting_bytes")
            < MAX_PENDING
        ):
            assert time.monotonic() < deadline, "the hub never filled"
            time.sleep(0.1)
        time.sleep(1.0)  # let the loop read on, if it would
        peak = rss(hub.proc.pid)
        held = metric(hub, "taproom_hub_pending_bytes") + metric(
            hub, "taproom_hub_admission_waiting_bytes"
        )
        print(
            f"{count} zlib bodies of {len(body)} B ({count * len(body) / 1000:.0f} KB, "
            f"{count * inflated / MiB:.0f} MiB inflated): pending + waiting "
            f"{held / MiB:.0f} MiB, RSS idle {idle / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB"
        )
        push.close()
        assert held <= MAX_PENDING + 4 * MiB + inflated
        assert peak - idle <= GROWTH_LIMIT, f"+{(peak - idle) / MiB:.0f} MiB"
