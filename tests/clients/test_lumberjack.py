"""taproom's Lumberjack clients against the real server: versions, compression, TLS,
pipelining and backpressure, sequence roll-over, and resend after the hub is killed."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import orjson
import pytest

from taproom.app import App
from taproom.clients.lumberjack import AsyncLumberjackClient, LumberjackClient, client_ssl_context
from taproom.journal import JournalReader
from tests.support import HubProcess, free_port, running_app, write_config
from tests.tlsutil import make_tls


def addr(app: App) -> tuple[str, int]:
    host, port = app.addresses["lumberjack"].rsplit(":", 1)
    return host, int(port)


def payloads(app: App) -> list[dict[str, object]]:
    return [orjson.loads(r.payload) for r in app.hub.journal.read(0)]


class TestSyncClient:
    @pytest.mark.parametrize(("version", "level"), [(1, 0), (1, 9), (2, 0), (2, 3)])
    async def test_versions_and_compression(self, tmp_path: Path, version: int, level: int) -> None:
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            host, port = addr(app)
            events = [{"line": f"l{i}", "n": str(i)} for i in range(3000)]

            def run() -> int:
                with LumberjackClient(
                    host, port, version=version, compression_level=level, window_size=700
                ) as c:
                    sent = c.send(events)
                    assert c.acked_events == sent
                    return sent

            assert await asyncio.to_thread(run) == 3000
            assert payloads(app) == events
            recs = list(app.hub.journal.read(0))
            assert recs[0].attrs == {"v": str(version)}
            assert recs[0].content_type == ("kv" if version == 1 else "json")

    async def test_pipeline_bounds_windows_in_flight(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            host, port = addr(app)
            seen: list[int] = []

            def run() -> None:
                with LumberjackClient(host, port, window_size=100, pipeline=3) as c:
                    encode = c.session.encode_window

                    def spy(events: list[object]) -> object:
                        window = encode(events)
                        seen.append(len(c.session.in_flight))
                        return window

                    c.session.encode_window = spy  # type: ignore[method-assign,assignment]
                    c.send({"i": i} for i in range(2000))

            await asyncio.to_thread(run)
            assert len(seen) == 20 and max(seen) == 3
            assert [p["i"] for p in payloads(app)] == list(range(2000))

    async def test_sequence_rollover_against_server(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            host, port = addr(app)

            def run() -> int:
                with LumberjackClient(host, port, window_size=64) as c:
                    c.session.next_seq = 0xFFFFFFFF - 100
                    return c.send({"i": i} for i in range(300))

            assert await asyncio.to_thread(run) == 300
            seqs = [r.seq for r in app.hub.journal.read(0)]
            assert seqs[:101] == list(range(0xFFFFFFFF - 100, 0x100000000))
            assert seqs[101:] == list(range(1, 200))


class TestAsyncClient:
    async def test_tls_with_verification(self, tmp_path: Path) -> None:
        tls = make_tls(tmp_path)
        cfg = {"tls_cert": str(tls.cert), "tls_key": str(tls.key_pkcs8)}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)
            client = AsyncLumberjackClient(
                host,
                port,
                ssl_context=client_ssl_context(str(tls.ca)),
                server_hostname="localhost",
                window_size=500,
            )
            async with client:
                assert await client.send({"a": i} for i in range(5000)) == 5000
            assert client.acked_events == 5000
            assert [p["a"] for p in payloads(app)] == list(range(5000))

    async def test_v1(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            host, port = addr(app)
            async with AsyncLumberjackClient(host, port, version=1, window_size=10) as client:
                await client.send([{"k": "v", "i": str(i)} for i in range(95)])
            assert len(payloads(app)) == 95


class TestResend:
    def test_resend_unacked_windows_after_hub_is_killed(self, tmp_path: Path) -> None:
        port = free_port()
        path = write_config(tmp_path, enable=["lumberjack"], lumberjack={"port": port})
        client = LumberjackClient(
            "127.0.0.1", port, window_size=250, reconnect_delay=0.1, reconnect_attempts=300
        )
        progress = threading.Event()
        result: list[object] = []

        def events():  # type: ignore[no-untyped-def]
            for i in range(10_000):
                if i == 4000:
                    progress.set()
                yield {"i": i}

        def run() -> None:
            try:
                result.append(client.send(events()))
            except BaseException as exc:
                result.append(exc)

        with HubProcess(path) as hub:
            t = threading.Thread(target=run)
            t.start()
            assert progress.wait(60)
            hub.kill()
            time.sleep(0.5)  # the client retries against a closed port meanwhile
            hub.start()
            t.join(120)
        client.close()
        assert result == [10_000]
        assert client.reconnects >= 1 and client.resent_events > 0
        ids = [orjson.loads(r.payload)["i"] for r in JournalReader(tmp_path / "journal").read(0)]
        assert set(ids) == set(range(10_000))
        # Duplicates come only from resent windows.
        assert len(ids) - 10_000 <= client.resent_events
