"""``taproom serve`` SIGKILLed at random moments while it takes Event BUS, LogTK and Lager
traffic, on a journal of every protocol: each start reads no more of the journal than the
first one did (which read all of it, having no checkpoint), and rebuilds exactly the state a
full read of the journal gives (issue 25 part 5).

After each kill the journal directory is copied twice: the copy with the services' checkpoints
is rebuilt as a start does (checkpoint plus what came after it); the other, without checkpoints
or the journal's index, is read whole; the two states must be equal. The restarted hub's Event
BUS snapshot must equal the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import shutil
import time
import urllib.request
from pathlib import Path

import msgpack
import orjson
import zmq
import zmq.asyncio

from taproom.clients.eventbus import EventBusClient
from taproom.clients.lager.tap import Tap
from taproom.clients.logtk import LogTKClient
from taproom.protocols.eventbus import SyncEnd, parse_snapshot_reply, syncstart_frames
from taproom.servers.eventbus.state import FRAMES, SEQ
from taproom.servers.logtk import hash_token
from tests.mixedjournal import MixedEvents
from tests.servers.rebuilt import checkpoint_paths, open_host, states
from tests.support import SOAK, HubProcess, fuzz_examples, write_config

TOKEN = bytes(range(64))
SEGMENT = 1 << 20
SERVICES = ("eventbus", "logtk", "lager")
FORMAT = (
    '<format version="BEERR01"><item name="a" type="uint32_t" size="4" offset="0"/>'
    '<item name="b" type="double" size="8" offset="4"/></format>'
)


def _replayed(hub: HubProcess) -> dict[str, int]:
    """Records each service read from the journal at its last start (/metrics)."""
    with urllib.request.urlopen(f"http://{hub.addresses['web']}/metrics", timeout=30) as r:
        text = r.read().decode()
    found = dict(
        re.findall(r'^taproom_restart_replayed_events\{kind="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    )
    return {kind: int(float(found[kind])) for kind in SERVICES}


async def _traffic(hub: HubProcess, cycle: int, rng: random.Random, stop: asyncio.Event) -> None:
    """Bus updates, LogTK entries and a tap registration, until ``stop`` or the hub dies."""
    url = "tcp://" + hub.addresses["eventbus_snapshot"]
    host, port = hub.addresses["logtk_tcp"].rsplit(":", 1)

    async def bus() -> None:
        async with EventBusClient([url], producer=f"crash-{cycle}", server_timeout=5) as client:
            i = 0
            while not stop.is_set():
                await client.publish(f"/crash/{rng.randrange(40)}", [cycle, i])
                i += 1
                await asyncio.sleep(0.005)  # a few hundred a second: far less than the journal

    async def logtk() -> None:
        client = LogTKClient("tcp", host, int(port), token=TOKEN, app="crash", client_id=cycle)
        async with client:
            i = 0
            while not stop.is_set():
                await client.send(orjson.dumps({"cycle": cycle, "i": i}))
                i += 1
                await asyncio.sleep(0.002)

    def register() -> None:
        Tap(
            f"/crash/{cycle}/", FORMAT, registrar=hub.addresses["lager_registrar_snapshot"]
        ).register(5)

    tasks = [asyncio.create_task(bus()), asyncio.create_task(logtk())]
    tasks.append(asyncio.create_task(asyncio.to_thread(register)))
    await stop.wait()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def _bus_snapshot(hub: HubProcess) -> tuple[dict[str, tuple[int, object]], int]:
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect("tcp://" + hub.addresses["eventbus_snapshot"])
    try:
        await dealer.send_multipart(syncstart_frames((), 0))
        topics: dict[str, tuple[int, object]] = {}
        while True:
            assert await dealer.poll(30_000), "no snapshot reply"
            reply = parse_snapshot_reply(await dealer.recv_multipart())
            if isinstance(reply, SyncEnd):
                return topics, reply.sequence
            topics[reply.topic] = (
                reply.sequence,
                msgpack.unpackb(reply.data) if reply.data else None,
            )
    finally:
        ctx.destroy(0)


def _compare(journal: Path, work: Path, now: float) -> dict[str, tuple[int, object]]:
    """Checkpoint plus tail (as a start rebuilds) == a full read, on copies of the journal.
    Returns the bus topics (sequence, value) the next start must serve."""
    with_checkpoints, whole = work / "a", work / "b"
    for copy in (with_checkpoints, whole):
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(journal, copy)
    for path in checkpoint_paths(str(whole)).values():
        Path(path).unlink(missing_ok=True)
    shutil.rmtree(whole / "index")  # the full read's reference does without the index too
    a, b = open_host(str(with_checkpoints), SEGMENT), open_host(str(whole), SEGMENT)
    try:
        got = states(a, now, checkpoints=True, bus_window=100_000)
        expected = states(b, now, checkpoints=False, bus_window=100_000)
        assert got["eventbus"] == expected["eventbus"]
        # The same keys (a running hub buckets a key by its commit time, a rebuild by its
        # receive time: a key near a bucket's edge may sit in the next one; both expire it).
        assert got["logtk"].keys() == expected["logtk"].keys()
        assert got["lager"] == expected["lager"]
        hashmap = got["eventbus"][0]
        return {
            topic.decode(): (e[SEQ], msgpack.unpackb(e[FRAMES][5]) if e[FRAMES][5] else None)
            for topic, e in hashmap.items()
        }
    finally:
        a.journal.close()
        b.journal.close()


async def test_sigkill_crash_loop(tmp_path: Path) -> None:
    rng = random.Random(25)
    journal = tmp_path / "journal"
    events = 400_000 if SOAK else 60_000
    MixedEvents(events, seed=25).write(str(journal), events, segment_bytes=SEGMENT)
    config = write_config(
        tmp_path,
        enable=["eventbus", "logtk", "lager"],
        journal={"segment_bytes": SEGMENT},
        eventbus={"checkpoint_after_events": 500, "max_keys": 20_000},
        logtk={"apps": {"crash": {"token_sha256": hash_token(TOKEN)}},
               "dedup_checkpoint_after_events": 2_000},
        lager={"checkpoint_interval_s": 0.2},
    )  # fmt: skip
    hub = HubProcess(config)
    first: dict[str, int] = {}
    expected: dict[str, tuple[int, object]] = {}
    try:
        for cycle in range(fuzz_examples(5, 20)):
            hub.start(120)
            replayed = _replayed(hub)
            if cycle == 0:
                first = replayed
                assert all(first.values()), first  # no checkpoint: each read all its records
            else:
                for kind in SERVICES:  # the journal only grew; the reads did not
                    assert replayed[kind] <= first[kind], (cycle, kind, replayed, first)
                # Progress: the bus and LogTK read their tails, not their whole history.
                assert replayed["eventbus"] < first["eventbus"] / 2, (cycle, replayed, first)
                assert replayed["logtk"] < first["logtk"] / 2, (cycle, replayed, first)
                topics, sequence = await _bus_snapshot(hub)
                assert topics == expected, "the restarted bus serves the state rebuilt"
                assert sequence == max((seq for seq, _ in topics.values()), default=sequence)
            stop = asyncio.Event()
            traffic = asyncio.create_task(_traffic(hub, cycle, rng, stop))
            await asyncio.sleep(rng.uniform(0.2, 2.5))  # then SIGKILL at a random moment
            hub.kill()
            stop.set()
            await traffic
            expected = _compare(journal, tmp_path / "copies", time.time())
    finally:
        hub.kill()
