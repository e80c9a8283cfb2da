"""The Event BUS's CHP dialect (the ØMQ Guide's Clone model 5/6 wire) over real ZeroMQ sockets,
driven by tests/servers/clone_peer.py, a Clone client written from the protocol.

One bus for both dialects: one hashmap, one sequence, one journal. Issue 16, "What to build".
"""

from __future__ import annotations

import asyncio
import gc
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from taproom.clients.eventbus import EventBusClient
from taproom.journal import JournalReader
from tests.servers.clone_peer import CloneClient
from tests.servers.test_eventbus import start_pair
from tests.slowcommits import slow_commits
from tests.support import HubProcess, running_app, write_config

SEQ = struct.Struct(">q")
StartClone = Callable[..., Awaitable[CloneClient]]


def _group(addresses: dict[str, str], name: str = "eventbus_chp_snapshot") -> tuple[str, int]:
    host, port = addresses[name].rsplit(":", 1)
    return host, int(port)


def _metric(app: object, name: str, labels: dict[str, str] | None = None) -> float:
    value = app.hub.metrics.registry.get_sample_value(name, labels or {})  # type: ignore[attr-defined]
    return value or 0.0


async def _until(predicate, timeout: float, what: str, *clients: CloneClient) -> None:  # type: ignore[no-untyped-def]
    """Wait for ``predicate``; a timeout says what each of ``clients`` had heard."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            heard = "; ".join(client.describe() for client in clients)
            raise AssertionError(f"timed out waiting for {what}" + (f" ({heard})" if heard else ""))
        await asyncio.sleep(0.02)


@pytest.fixture
async def start_clone() -> AsyncIterator[StartClone]:
    """``await start_clone(servers, ...)``: a started CloneClient, stopped at teardown also when the
    test failed or timed out half-way (each holds a ZeroMQ context: tests/zmqleaks.py)."""
    made: list[CloneClient] = []

    async def start(*args: Any, **kwargs: Any) -> CloneClient:
        client = CloneClient(*args, **kwargs)
        made.append(client)
        return await client.start()

    yield start
    for client in made:
        await client.stop()


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)
    yield context
    context.destroy(0)


def _chp(collector: str, **more: object) -> dict[str, object]:
    return {"chp": True, "chp_collector": collector, "heartbeat_ms": 100, **more}


class TestCloneFlows:
    """clonecli5 (PUSH) and clonecli6 (PUB) against one taproom bus, with seed clients on it."""

    @pytest.mark.usefixtures("zmq_path")
    @pytest.mark.parametrize(("collector", "model"), [("pull", 5), ("sub", 6)])
    async def test_snapshot_subtree_and_updates_both_ways(
        self, tmp_path: Path, collector: str, model: int, start_clone: StartClone
    ) -> None:
        async with running_app(tmp_path, enable=["eventbus"], eventbus=_chp(collector)) as app:
            chp = _group(app.addresses)
            seed_url = "tcp://" + app.addresses["eventbus_snapshot"]
            # state from both dialects before the Clone client joins
            async with EventBusClient([seed_url], producer="seed") as seed:
                await (await seed.publish("/client/seed", {"from": "seed"}))
            writer = await start_clone([chp], model=model)
            await writer.set(b"/client/1", b"one")
            await writer.set(b"/other/1", b"elsewhere")
            await _until(lambda: len(writer.kvmap) == 3, 30, "the writer's own updates", writer)
            # a client of the /client/ subtree: snapshot, then live updates of both dialects
            reader = await start_clone([chp], subtree=b"/client/", model=model)
            assert set(reader.kvmap) == {b"/client/seed", b"/client/1"}
            assert reader.sequence == 3  # KTHXBAI carries the bus's sequence
            one = reader.kvmap[b"/client/1"]
            assert (one.sequence, one.body) == (2, b"one")
            assert "timestamp" in one.properties
            from_seed = reader.kvmap[b"/client/seed"]
            assert msgpack.unpackb(from_seed.body) == {"from": "seed"}
            assert from_seed.properties["producer"] == "seed"
            async with EventBusClient([seed_url], producer="seed2") as seed:
                await (await seed.publish("/client/seed", "again"))
                await writer.set(b"/client/2", b"two")
                await _until(lambda: b"/client/2" in reader.kvmap, 10, "the kvmsg update", reader)
                await _until(lambda: "/client/2" in seed.state, 10, "the seed client")
                event = seed.state["/client/2"]
                # a kvmsg body reaches seed clients as a MessagePack bin
                assert msgpack.unpackb(event.data) == b"two" and event.producer == ""
            assert msgpack.unpackb(reader.kvmap[b"/client/seed"].body) == "again"
            assert [s for s, _ in reader.received] == [4, 5]  # one sequence for both dialects
            await reader.stop()
            await writer.stop()
            stored = [(r.topic, r.seq, r.content_type) for r in app.hub.journal.read(0)]
            assert stored == [
                ("/client/seed", 1, "msgpack"),
                ("/client/1", 2, "raw"),
                ("/other/1", 3, "raw"),
                ("/client/seed", 4, "msgpack"),
                ("/client/2", 5, "raw"),
            ]

    @pytest.mark.usefixtures("zmq_path")
    async def test_a_snapshot_holds_every_update_accepted_before_its_request(
        self, tmp_path: Path, start_clone: StartClone
    ) -> None:
        """An update accepted but not yet committed when an ICANHAZ? arrives is in the snapshot
        (the snapshot waits for the commit), as in the Guide's server, whose hashmap takes an
        update at once. Served without it, a client whose SUB joined after the update's
        broadcast never saw it: the CI failure of the Binary Star takeover test below."""
        async with running_app(tmp_path, enable=["eventbus"], eventbus=_chp("pull")) as app:
            chp = _group(app.addresses)
            writer = await start_clone([chp], model=5)
            slow_commits(app.hub, 1.0)  # a commit takes a second to be reported durable
            await writer.set(b"/s/1", b"one")
            accepted = {"protocol": "eventbus"}
            await _until(
                lambda: _metric(app, "taproom_ingest_accepted_events_total", accepted) == 1,
                10,
                "the update accepted",
            )
            # not committed yet: nothing broadcast (the gauge exists: None would fail)
            assert app.hub.metrics.registry.get_sample_value("taproom_eventbus_sequence_count") == 0
            reader = await start_clone([chp], model=5)
            assert {k: v.body for k, v in reader.kvmap.items()} == {b"/s/1": b"one"}
            assert reader.sequence == 1

    async def test_a_snapshot_waits_for_a_commit_no_longer_than_snapshot_settle(
        self, tmp_path: Path, start_clone: StartClone, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A journal that does not commit within ``snapshot_settle_ms`` does not hold a
        snapshot longer: it is served as it stands, logged, and the update follows live."""
        settings = _chp("pull", snapshot_settle_ms=300)
        async with running_app(tmp_path, enable=["eventbus"], eventbus=settings) as app:
            chp = _group(app.addresses)
            writer = await start_clone([chp], model=5)
            slow_commits(app.hub, 6.0)  # far longer than the snapshot waits
            await writer.set(b"/s/1", b"one")
            accepted = {"protocol": "eventbus"}
            await _until(
                lambda: _metric(app, "taproom_ingest_accepted_events_total", accepted) == 1,
                10,
                "the update accepted",
            )
            reader = await start_clone([chp], model=5, server_ttl=10.0)
            assert reader.kvmap == {} and reader.sequence == 0  # served before the commit
            assert "snapshot served before the journal committed" in caplog.text
            await _until(lambda: b"/s/1" in reader.kvmap, 20, "the update, live", reader)
            assert reader.kvmap[b"/s/1"].sequence == 1

    @pytest.mark.usefixtures("zmq_path")
    async def test_empty_body_deletes_and_ttl_expires(
        self, tmp_path: Path, start_clone: StartClone
    ) -> None:
        settings = _chp("pull", ttl_check_ms=100)
        async with running_app(tmp_path, enable=["eventbus"], eventbus=settings) as app:
            chp = _group(app.addresses)
            seed_url = "tcp://" + app.addresses["eventbus_snapshot"]
            clone = await start_clone([chp], model=5)
            async with EventBusClient([seed_url]) as seed:
                await clone.set(b"/t/kept", b"k")
                await clone.set(b"/t/gone", b"g")
                await clone.set(b"/t/brief", b"b", ttl=1)
                await _until(lambda: len(clone.kvmap) == 3, 10, "three keys", clone)
                await _until(lambda: len(seed.state) == 3, 10, "three keys (seed)")
                assert clone.kvmap[b"/t/brief"].properties["ttl"] == "1"
                await clone.set(b"/t/gone", b"")  # the Guide's delete
                await _until(lambda: b"/t/gone" not in clone.kvmap, 10, "the delete", clone)
                await _until(lambda: "/t/gone" not in seed.state, 10, "the delete (seed)")
                # the ttl passes: the server deletes the key with a new sequence
                await _until(lambda: b"/t/brief" not in clone.kvmap, 10, "the expiry", clone)
                await _until(lambda: "/t/brief" not in seed.state, 10, "the expiry (seed)")
                assert clone.sequence == 5
                assert _metric(app, "taproom_eventbus_expired_events_total") == 1
            fresh = await start_clone([chp], model=5)
            assert set(fresh.kvmap) == {b"/t/kept"}
            await fresh.stop()
            await clone.stop()
            deletes = [
                (r.topic, r.attrs.get("delete"))
                for r in app.hub.journal.read(0)
                if r.attrs.get("delete")
            ]
            assert deletes == [("/t/gone", True), ("/t/brief", True)]

    @pytest.mark.usefixtures("zmq_path")
    async def test_malformed_kvmsg_is_counted_by_reason_and_never_broadcast(
        self, tmp_path: Path, ctx: zmq.asyncio.Context
    ) -> None:
        async with running_app(tmp_path, enable=["eventbus"], eventbus=_chp("pull")) as app:
            host, port = _group(app.addresses)
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"/")
            sub.connect(f"tcp://{host}:{port + 1}")
            push = ctx.socket(zmq.PUSH)
            push.connect(f"tcp://{host}:{port + 2}")
            await asyncio.sleep(0.2)
            good = [b"/m/ok", bytes(8), uuid.uuid4().bytes, b"", b"fine"]
            bad = {
                "frame_count": good[:4],
                "bad_uuid": [*good[:2], b"0123456789", *good[3:]],
                "bad_properties": [*good[:3], b"no equals sign\n", good[4]],
                "too_large": [b"/" + b"k" * 2000, *good[1:]],
                "bad_topic": [b"no-slash", *good[1:]],
            }
            for frames in bad.values():
                await push.send_multipart(frames)
            await push.send_multipart(good)
            assert await sub.poll(5000)
            key, seq, *_ = await sub.recv_multipart()
            assert (key, SEQ.unpack(seq)[0]) == (b"/m/ok", 1)
            for reason in bad:
                labels = {"protocol": "eventbus", "reason": reason}
                assert _metric(app, "taproom_ingest_rejected_items_total", labels) == 1, reason
            assert [r.topic for r in app.hub.journal.read(0)] == ["/m/ok"]
            # a Clone model 6 client (PUB) on this model 5 (PULL) collector: refused at the
            # handshake by taproom's transport, counted by reason
            wrong = ctx.socket(zmq.PUB)
            wrong.connect(f"tcp://{host}:{port + 2}")
            refused = {"protocol": "eventbus", "reason": "socket_type"}
            await _until(
                lambda: _metric(app, "taproom_ingest_rejected_items_total", refused) >= 1,
                10,
                "the refused handshake",
            )

    async def test_clonecli5_empty_uuid_and_an_unholdable_timestamp_are_kept(
        self, tmp_path: Path, ctx: zmq.asyncio.Context
    ) -> None:
        """The Guide's C clonecli5 sends an empty uuid frame (its clonesrv5 publishes the
        update): taproom gives it a uuid4 and counts it. A timestamp property past 2262 (issue
        25: it stopped the collector for good) leaves the event without a time, counted; the
        updates around both are kept."""
        async with running_app(tmp_path, enable=["eventbus"], eventbus=_chp("pull")) as app:
            host, port = _group(app.addresses)
            push = ctx.socket(zmq.PUSH)
            push.connect(f"tcp://{host}:{port + 2}")
            far = b"timestamp=2426-01-01T00:00:00Z\n"
            for frames in (
                [b"/c/a", bytes(8), uuid.uuid4().bytes, b"", b"before"],
                [b"/c/b", bytes(8), b"", b"ttl=30\n", b"clonecli5"],
                [b"/c/c", bytes(8), uuid.uuid4().bytes, far, b"far future"],
                [b"/c/d", bytes(8), uuid.uuid4().bytes, b"", b"after"],
            ):
                await push.send_multipart(frames)
            journal = app.hub.journal
            await _until(lambda: len(list(journal.read(0))) == 4, 20, "four updates")
            records = {r.topic: r for r in journal.read(0)}
            assert uuid.UUID(records["/c/b"].event_id).version == 4
            assert records["/c/c"].ts_ns == 0
            assert records["/c/c"].attrs["timestamp"] == "2426-01-01T00:00:00Z"
            assert records["/c/a"].ts_ns > 0 and records["/c/d"].payload == b"after"
            odd = "taproom_ingest_odd_events_total"
            labels = {"protocol": "eventbus", "reason": "empty_uuid"}
            assert _metric(app, odd, labels) == 1
            labels = {"protocol": "eventbus", "reason": "time_out_of_range"}
            assert _metric(app, odd, labels) == 1
            assert app.readiness() == []

    async def test_chp_state_survives_sigkill(
        self, tmp_path: Path, start_clone: StartClone
    ) -> None:
        config = write_config(tmp_path, enable=["eventbus"], eventbus=_chp("pull"))
        with HubProcess(config) as hub:
            clone = await start_clone([_group(hub.addresses)], model=5)
            await clone.set(b"/r/a", b"alpha", ttl=3600)
            await clone.set(b"/r/b", b"beta")
            await _until(lambda: len(clone.kvmap) == 2, 10, "two keys", clone)
            before = dict(clone.kvmap)
            await clone.stop()
            hub.restart()  # SIGKILL; the state comes back from the journal
            after = await start_clone([_group(hub.addresses)], model=5)
            assert after.kvmap == before  # bodies, properties, uuids and sequences
            assert after.sequence == 2
            await after.stop()


class TestCloneFailover:
    """Model 6 across a taproom Binary Star pair: the client publishes every update once to both
    servers; the primary is SIGKILLed; no update is lost (issue 16, defect 1)."""

    async def test_model6_failover_loses_no_update(
        self, tmp_path: Path, start_clone: StartClone
    ) -> None:
        primary, backup = await start_pair(tmp_path, chp=True, chp_collector="sub")
        try:
            servers = [_group(primary.addresses), _group(backup.addresses)]
            client = await start_clone(servers, model=6, server_ttl=1.5)
            await client.subscribed(2)  # both SUB collectors have joined the client's PUB
            sent: dict[bytes, bytes] = {}
            uuids = []
            for i in range(30):
                key, body = b"/f/%d" % (i % 12), b"value %d" % i
                uuids.append(await client.set(key, body))
                sent[key] = body
                if i == 12:
                    primary.kill()
                await asyncio.sleep(0.05)
            await _until(
                lambda: client.current == 1 and client.synced.is_set(),
                30,
                "the client on the backup",
                client,
            )
            await _until(
                lambda: {k: v.body for k, v in client.kvmap.items()} == sent,
                20,
                f"every update ({len(sent)} keys)",
                client,
            )
            await client.stop()
            # the updates sent after the kill reached only the passive backup, which held them
            assert "held updates at takeover" in backup.log()
            # each update once in the backup's journal: replicated or held, never both
            stored = [
                r.event_id
                for r in JournalReader(tmp_path / "b" / "journal").read(0)
                if r.protocol == "eventbus" and r.topic.startswith("/f/")
            ]
            assert sorted(stored) == sorted(str(uuid.UUID(bytes=u)) for u in uuids)
        finally:
            backup.kill()
            primary.kill()


@pytest.mark.usefixtures("zmq_path")
async def test_the_cyclic_gc_untracks_every_hashmap_entry(
    tmp_path: Path, start_clone: StartClone
) -> None:
    """An entry is a plain tuple of ints, bytes, None and plain tuples of those: after a
    collection the GC no longer tracks it, so a full collection does not walk the hashmap.
    Entries of both dialects (seed PUB, kvmsg with and without ttl and properties), as the
    collectors make them and as a restart reads them back from the checkpoint and journal."""

    def untracked(app: Any) -> None:
        hashmap = app.services["eventbus"].hashmap
        assert set(hashmap) == {b"/gc/seed", b"/gc/kv", b"/gc/ttl"}
        # a tuple is untracked once its items are: an entry checked before its own frames
        # (younger objects are checked first) goes at the next collection
        gc.collect()
        gc.collect()
        for topic, entry in hashmap.items():
            assert type(entry) is tuple and len(entry) == 5, topic
            assert entry[4] is not None, topic  # its kvmsg (the CHP dialect is on)
            assert not gc.is_tracked(entry), topic

    cfg = _chp("pull", checkpoint_interval_s=0.3)
    async with running_app(tmp_path, enable=["eventbus"], eventbus=cfg) as app:
        seed_url = "tcp://" + app.addresses["eventbus_snapshot"]
        async with EventBusClient([seed_url], producer="seed") as seed:
            await (await seed.publish("/gc/seed", {"v": 1}))
        writer = await start_clone([_group(app.addresses)], model=5)
        await writer.set(b"/gc/gone", b"x")
        await writer.set(b"/gc/gone", b"")  # a deletion
        await writer.set(b"/gc/kv", b"one")
        await writer.set(b"/gc/ttl", b"two", ttl=3600)
        await _until(lambda: b"/gc/ttl" in writer.kvmap, 30, "the writer's updates", writer)
        await writer.stop()
        untracked(app)
    async with running_app(tmp_path, enable=["eventbus"], eventbus=cfg) as app:
        untracked(app)
