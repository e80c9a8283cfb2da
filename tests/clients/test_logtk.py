"""taproom's LogTK client: both transports, disk cache replay, logging handler, CLI, and
exactly-once delivery while the hub is SIGKILLed and restarted."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import socket
from collections import Counter

import orjson
import pytest

from taproom.cli import main as cli_main
from taproom.clients.logtk import LogTKClient, LogTKHandler, load_token
from taproom.journal.reader import JournalReader
from taproom.payloads import decode_payload
from taproom.protocols.logtk import Data, ServerConnection, ServerSettings
from taproom.servers.logtk import hash_token
from tests.support import HubProcess, free_ports, fuzz_examples, running_app, write_config

TOKEN = bytes(range(100, 164))
APPS = {"apps": {"myapp": {"token_sha256": hash_token(TOKEN)}}}


def addr(app, name):
    host, port = app.addresses[name].rsplit(":", 1)
    return host, int(port)


def logtk_records(app):
    return [r for r in app.hub.journal.read(0) if r.protocol == "logtk"]


@pytest.mark.parametrize("transport", ["ws", "tcp"])
async def test_client_sends_and_every_event_is_acked_once(tmp_path, transport):
    async with running_app(tmp_path, enable=["logtk"], logtk=APPS) as app:
        host, port = addr(app, f"logtk_{transport}")
        client = LogTKClient(transport, host, port, token=TOKEN, app="myapp", client_id=7)
        async with client:
            for i in range(2000):
                await client.send(orjson.dumps({"n": i}))
            await client.flush(30)
            assert client.acked == 2000 and not client.unacked
        stored = logtk_records(app)
        assert sorted(orjson.loads(r.payload)["n"] for r in stored) == list(range(2000))
        assert len({r.event_id for r in stored}) == 2000
        assert all(r.producer == "00000007" for r in stored)


@pytest.mark.parametrize("transport", ["ws", "tcp"])
async def test_an_oversize_entry_never_blocks_the_stream(tmp_path, transport):
    """Issue 17 item 6: the client resends an unacked entry forever, so a hub that refused an
    entry over max_data_bytes blocked everything after it. It is stored cut and acked."""
    big = orjson.dumps({"blob": "x" * (600 * 1024)})  # over the 512 KiB default, under 1 MiB
    async with running_app(tmp_path, enable=["logtk"], logtk=APPS) as app:
        host, port = addr(app, f"logtk_{transport}")
        client = LogTKClient(transport, host, port, token=TOKEN, app="myapp", client_id=9)
        async with client:
            await client.send(orjson.dumps({"n": 0}))
            await client.send(big)
            for i in range(1, 4):
                await client.send(orjson.dumps({"n": i}))
            await client.flush(30)
            assert client.acked == 5 and not client.unacked
        cut, *normal = sorted(logtk_records(app), key=lambda r: len(r.payload), reverse=True)
        assert sorted(orjson.loads(r.payload)["n"] for r in normal) == [0, 1, 2, 3]
        assert cut.payload == big[: 512 * 1024]
        assert cut.attrs["truncated_from"] == str(len(big))
        registry = app.hub.metrics.registry
        assert (
            registry.get_sample_value(
                "taproom_ingest_rejected_items_total",
                {"protocol": "logtk", "reason": "data_truncated"},
            )
            == 1
        )
        assert registry.get_sample_value("taproom_logtk_truncated_bytes_total") == len(big) - (
            512 * 1024
        )


async def test_unacked_data_is_resent_every_second_with_the_same_idem():
    """A peer that swallows the first copy of every data frame: the client resends it after
    the resend interval with the same idem, and stops once acked."""
    seen: list[tuple[int, bytes]] = []

    async def swallowing_server(reader, writer):
        conn = ServerConnection(ServerSettings(), now=0, authenticate={TOKEN: "myapp"}.get)
        while not conn.closed:
            data = await reader.read(65536)
            if not data:
                break
            acks = []
            for event in conn.receive_data(data, now=0):
                if isinstance(event, Data):
                    if any(idem == event.idem for idem, _ in seen):
                        acks.append(event.idem)
                    seen.append((event.idem, event.data))
            conn.ack(acks)
            writer.write(conn.data_to_send())
        writer.close()

    server = await asyncio.start_server(swallowing_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = LogTKClient("tcp", "127.0.0.1", port, token=TOKEN, resend_interval=0.5)
        async with client:
            started = asyncio.get_running_loop().time()
            idems = [await client.send(b"event-%d" % i) for i in range(5)]
            await client.flush(10)
            elapsed = asyncio.get_running_loop().time() - started
        assert elapsed >= 0.5 and client.acked == 5
        assert sorted(seen) == sorted([(i, b"event-%d" % n) for n, i in enumerate(idems)] * 2)
    finally:
        server.close()
        await server.wait_closed()


async def test_disk_cache_replayed_after_restart_with_same_tokens(tmp_path):
    cache = str(tmp_path / "client.cache")
    # No server yet: everything stays unacked and lands in the cache.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    client = LogTKClient("tcp", "127.0.0.1", dead_port, token=TOKEN, cache_path=cache)
    await client.start()
    idems = [await client.send(orjson.dumps({"n": i})) for i in range(50)]
    client_id = client.client_id
    await client.close(timeout=0)
    async with running_app(tmp_path, enable=["logtk"], logtk=APPS) as app:
        host, port = addr(app, "logtk_tcp")
        again = LogTKClient("tcp", host, port, token=TOKEN, cache_path=cache)
        assert again.client_id == client_id and sorted(again.unacked) == sorted(idems)
        async with again:
            await again.flush(10)
            # New data after the replay never reuses an idem of the cache.
            new = await again.send(b'{"n": 50}')
            assert new not in idems
            await again.flush(10)
        stored = logtk_records(app)
        assert sorted(r.seq for r in stored) == sorted([*idems, new])
    # Everything was acked: the cache replays nothing next time.
    assert LogTKClient("tcp", "127.0.0.1", 1, token=TOKEN, cache_path=cache).unacked == {}


async def test_logging_handler_ships_log_entries(tmp_path):
    async with running_app(tmp_path, enable=["logtk"], logtk=APPS) as app:
        host, port = addr(app, "logtk_tcp")
        handler = await asyncio.to_thread(LogTKHandler, "tcp", host, port, token=TOKEN, app="myapp")
        logger = logging.getLogger("taproom.test.logtk_handler")
        logger.propagate = False
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            for i in range(20):
                logger.warning("disk %d%% full", 90 + i % 10)
            await asyncio.to_thread(handler.flush)
        finally:
            logger.removeHandler(handler)
            await asyncio.to_thread(handler.close)
        stored = logtk_records(app)
        assert len(stored) == 20 and {r.content_type for r in stored} == {"protobuf"}
        entry = decode_payload("protobuf", stored[0].payload)
        assert entry["level"] == logging.WARNING and entry["message"].startswith("disk 9")
        assert entry["fields"]["logger"] == "taproom.test.logtk_handler"
        assert entry["trace"]["file"].endswith("test_logtk.py")
        # the record's event time is the entry's own (ms resolution), not the receive time
        assert stored[0].ts_ns == entry["time"] * 1_000_000 and stored[0].ts_ns > 0


async def test_cli_send(tmp_path, capsys):
    token_file = tmp_path / "token.b64"
    token_file.write_text(__import__("base64").b64encode(TOKEN).decode() + "\n")
    assert load_token(token_file) == TOKEN
    async with running_app(tmp_path, enable=["logtk"], logtk=APPS) as app:
        for flag, name in (("--ws", "logtk_ws"), ("--tcp", "logtk_tcp")):
            _, port = addr(app, name)
            argv = ["send", "logtk", flag, "--app", "myapp", "--token-file", str(token_file)]
            argv += ["--count", "100", "--port", str(port), "--format", "bson"]
            assert await asyncio.to_thread(cli_main, argv) == 0
        assert "acked 100" in capsys.readouterr().out
        stored = logtk_records(app)
        assert len(stored) == 200 and stored[0].content_type == "bson"
        assert decode_payload("bson", stored[0].payload)["$message"].endswith("#0")
        bad = tmp_path / "bad.token"
        bad.write_bytes(bytes(64))
        argv = ["send", "logtk", "--ws", "--app", "myapp", "--token-file", str(bad)]
        argv += ["--port", str(addr(app, "logtk_ws")[1]), "--timeout", "2"]
        assert await asyncio.to_thread(cli_main, argv) == 1


@pytest.mark.parametrize("transport", ["tcp", "ws"])
async def test_exactly_once_across_two_sigkills(tmp_path, transport):
    """10,000 events; the hub is SIGKILLed and restarted twice mid-stream (same ports); the
    journal holds every event exactly once."""
    ws_port, tcp_port = free_ports(2)
    config = write_config(
        tmp_path,
        enable=["logtk"],
        logtk={"ws_port": ws_port, "tcp_port": tcp_port, **APPS},
    )
    hub = HubProcess(config)
    await asyncio.to_thread(hub.start)
    # `make test`: 10,000 events, two kills; `make soak`: 200,000 events, ten kills.
    total = fuzz_examples(10_000, 200_000)
    kills = fuzz_examples(2, 10)
    try:
        port = tcp_port if transport == "tcp" else ws_port
        client = LogTKClient(
            transport, "127.0.0.1", port, token=TOKEN, app="myapp", client_id=99, max_in_flight=512
        )
        await client.start()

        async def killer():
            for k in range(kills):
                threshold = total * (2 * k + 1) // (2 * kills + 1)
                while client.acked < threshold:
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(hub.restart)

        killing = asyncio.create_task(killer())
        for i in range(total):
            await client.send(b'{"n":%d}' % i)
        await asyncio.wait_for(killing, 60 * kills)
        await client.flush(60)
        assert client.acked == total and client.connects >= kills + 1
        await client.close()
    finally:
        hub.kill()
    assert hub.starts == kills + 1
    # Each restart rebuilt the idempotency index from what the journal already held.
    log = hub.log_path.read_text()
    rebuilt = [int(n) for n in re.findall(r"idempotency index of (\d+) keys from", log)]
    assert len(rebuilt) == kills + 1 and rebuilt[0] == 0 and rebuilt[-1] < total
    assert all(a < b for a, b in itertools.pairwise(rebuilt))
    counts = Counter(r.payload for r in JournalReader(tmp_path / "journal").read(0))
    assert len(counts) == total
    assert set(counts.values()) == {1}, [p for p, c in counts.items() if c > 1][:5]


def test_handler_never_blocks_the_application_when_the_hub_is_down():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    handler = LogTKHandler("tcp", "127.0.0.1", dead_port, token=TOKEN, max_in_flight=2)
    try:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom", None, None)
        for _ in range(100):
            handler.emit(record)  # returns at once although nothing can be delivered
        sync = handler.client
        assert sync.dropped >= 100 - sync.max_queued - 2 and sync.max_queued == 20
    finally:
        handler.client.close(timeout=0)
