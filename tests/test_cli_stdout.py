"""Every `taproom` command that writes to stdout stops promptly and quietly when its reader
goes away (issue 16 defect 3: `taproom tail --eventbus URL | head -1` ran 30-55 s, printed
tracebacks and exited 1).

The reader is gone before the first write: the command's stdout is a pipe whose read end is
already closed, so the first write (or flush) fails with EPIPE whatever the buffering. One
test also runs the real `| head -1` pipeline of the issue.
"""

from __future__ import annotations

import os
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from taproom.journal import Journal
from taproom.protocols.lager.formats import parse_format_xml
from taproom.protocols.lager.keg import KegFileWriter
from taproom.protocols.logjam import Compression, encode_message
from taproom.records import BatchBuilder
from tests.support import HubProcess, write_config
from tests.test_cli import TAPROOM

# Far above what a command needs to notice EPIPE; the defect took 30-55 s.
DEADLINE_S = 20


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPROOM_")}
    try:
        return subprocess.run(
            [TAPROOM, *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=DEADLINE_S,
            env=env,
        )
    finally:
        os.close(write_end)


def _assert_quiet_exit(result: subprocess.CompletedProcess[str]) -> None:
    assert result.stderr == ""
    assert result.returncode == 0


def _journal(path: Path, events: int) -> Path:
    journal = Journal(path)
    builder = BatchBuilder()
    for i in range(events):
        builder.add("logtk", b"line %d" % i, stream="web", topic="x", content_type="raw")
    journal.commit([builder.build()])
    journal.close()
    return path


def test_tail_journal(tmp_path: Path) -> None:
    _assert_quiet_exit(_into_closed_pipe("tail", "--journal", str(_journal(tmp_path / "j", 50))))


def test_journal_stats(tmp_path: Path) -> None:
    journal = str(_journal(tmp_path / "j", 5))
    _assert_quiet_exit(_into_closed_pipe("journal", "stats", "--journal", journal))


def test_keg_dump(tmp_path: Path) -> None:
    fmt = parse_format_xml(
        '<format version="BEERR01"><item name="x" type="double" size="8" offset="0"/></format>'
    )
    tap = uuid.UUID(int=7)
    path = tmp_path / "k.lgr"
    with KegFileWriter(path, {str(tap): fmt}, fsync=False) as writer:
        for i in range(2000):
            writer.write(tap.bytes, 1000 + i, fmt.encode_row({"x": i / 2}))
    _assert_quiet_exit(_into_closed_pipe("keg", "dump", str(path)))


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[HubProcess]:
    config = write_config(tmp_path, enable=["eventbus"], eventbus={"heartbeat_ms": 100})
    with HubProcess(config) as hub:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 1000)
        dealer.connect("tcp://" + hub.addresses["eventbus_collector"])
        for i in range(20):
            dealer.send_multipart(
                [
                    b"/cli/%d" % i,
                    struct.pack(">Q", 0),
                    b"test",
                    b"2026-11-22T08:00:00+00:00",
                    str(uuid.uuid4()).encode(),
                    msgpack.packb(i),
                ]
            )
        dealer.close()
        ctx.term()
        yield hub


def _wait_for_snapshot(url: str, topics: int) -> None:
    """Until the bus has committed ``topics`` topics (a raw SYNCSTART)."""
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(url)
            dealer.send_multipart([b"SYNCSTART", b"", bytes(8)])
            seen = 0
            while dealer.poll(5000):
                if dealer.recv_multipart()[0] == b"SYNCEND":
                    break
                seen += 1
            dealer.close()
            if seen >= topics:
                return
            time.sleep(0.1)
        raise AssertionError("the bus never had the events")
    finally:
        ctx.term()


def test_tail_eventbus(bus: HubProcess) -> None:
    url = "tcp://" + bus.addresses["eventbus_snapshot"]
    _wait_for_snapshot(url, 20)
    _assert_quiet_exit(_into_closed_pipe("tail", "--eventbus", url))
    _assert_quiet_exit(_into_closed_pipe("tail", "--eventbus", url, "--follow"))


def test_tail_eventbus_follow_into_head(bus: HubProcess) -> None:
    """The issue's own pipeline; a producer keeps publishing so that writes continue after
    `head` has gone."""
    url = "tcp://" + bus.addresses["eventbus_snapshot"]
    _wait_for_snapshot(url, 20)
    stop = threading.Event()

    def publish() -> None:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect("tcp://" + bus.addresses["eventbus_collector"])
        i = 0
        while not stop.is_set():
            i += 1
            frames = [b"/live/x", bytes(8), b"p", b"2026-11-22T08:00:00Z"]
            dealer.send_multipart([*frames, str(uuid.uuid4()).encode(), msgpack.packb(i)])
            time.sleep(0.01)
        dealer.close()
        ctx.term()

    producer = threading.Thread(target=publish)
    producer.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPROOM_")}
    try:
        result = subprocess.run(
            f"set -o pipefail; '{TAPROOM}' tail --eventbus {url} --follow | head -1",
            shell=True,
            executable="/bin/bash",
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            env=env,
        )
    finally:
        stop.set()
        producer.join()
    assert result.stderr == ""
    assert result.returncode == 0
    assert result.stdout.count("\n") == 1 and '"topic"' in result.stdout


def test_tail_logjam() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def publish() -> None:
        sequence = 0
        while not stop.is_set():
            sequence += 1
            frames = encode_message(
                b"app-production",
                b"logs.app.x",
                b'{"n": 1}',
                compression=Compression.NONE,
                device=1,
                created_ms=1_700_000_000_000,
                sequence=sequence,
            )
            pub.send_multipart(frames)
            time.sleep(0.01)

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        result = _into_closed_pipe("tail", "--logjam", f"tcp://127.0.0.1:{port}")
    finally:
        stop.set()
        publisher.join()
        pub.close()
        ctx.term()
    _assert_quiet_exit(result)


def test_tail_eventbus_to_a_bus_that_never_answers() -> None:
    """Issue 16 defect 4: one line, not a TimeoutError traceback."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # takes the SYNCSTART and never replies
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPROOM_")}
    try:
        result = subprocess.run(
            [TAPROOM, "tail", "--eventbus", f"tcp://127.0.0.1:{port}", "--eventbus-timeout", "2"],
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            env=env,
        )
    finally:
        router.close()
        ctx.term()
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"taproom tail --eventbus: no snapshot from tcp://127.0.0.1:{port} within 2 s"
    ]
