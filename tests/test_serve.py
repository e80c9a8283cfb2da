"""`taproom serve` as a real process under real load: SIGTERM loses no acknowledged event.

The load comes from pylogbeat (a Beats client nobody here wrote): each ``send`` returns only
once the hub has acknowledged the window. The hub is told to stop in the middle of the stream.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import orjson
import pylogbeat

from taproom.journal import JournalReader
from tests.support import HubProcess, write_config


def stream(host: str, port: int, first: int, acked: list[int], stop: threading.Event) -> None:
    i = first
    try:
        with pylogbeat.PyLogBeatClient(host, port, timeout=10) as client:
            while not stop.is_set():
                window = [{"message": f"event {n}", "id": n} for n in range(i, i + 200)]
                client.send(window)  # returns once acknowledged
                acked.extend(range(i, i + 200))
                i += 200
    except Exception:
        pass  # the hub went away mid-window: that window was never acknowledged


def test_sigterm_under_load_exits_zero_and_keeps_every_acked_event(tmp_path):
    hub = HubProcess(write_config(tmp_path, enable=["lumberjack"])).start()
    host, port = hub.address("lumberjack")
    acked: list[int] = []
    stop = threading.Event()
    senders = [
        threading.Thread(target=stream, args=(host, port, k * 10**9, acked, stop)) for k in range(2)
    ]
    try:
        for t in senders:
            t.start()
        deadline = time.monotonic() + 30
        while len(acked) < 5000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(acked) >= 5000, hub.log()
        assert hub.proc is not None
        hub.proc.send_signal(signal.SIGTERM)
        code = hub.proc.wait(30)
        stop.set()
        for t in senders:
            t.join(30)
    finally:
        hub.kill()
    assert code == 0, hub.log()
    assert "stopped cleanly" in hub.log()
    stored = Counter(
        orjson.loads(r.payload)["id"] for r in JournalReader(tmp_path / "journal").read(0)
    )
    missing = [n for n in acked if stored[n] != 1]
    assert missing == []
