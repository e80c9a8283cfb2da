"""The Lumberjack server against real peers (pylogbeat, npm lumberjack-protocol) and raw sockets.

Every peer sends >= 10,000 events; each one must be in the journal, byte-exact, and acked. The
zlib bomb and SIGKILL tests run the hub as a real child process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import ssl
import struct
import threading
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import orjson
import pylogbeat
import pytest

from taproom import cli
from taproom.app import App
from taproom.clients.lumberjack import LumberjackClient, client_ssl_context
from taproom.journal import JournalReader
from taproom.protocols.lumberjack import (
    CompressedFrame,
    DataFrame,
    JsonFrame,
    Version,
    WindowSizeFrame,
)
from tests.support import HubProcess, free_port, load, running_app, slow_commits, write_config
from tests.tlsutil import make_tls

PEERS = Path(__file__).resolve().parents[1] / "peers"
NODE = shutil.which("node") or "/usr/bin/node"

V1, V2 = Version.V1, Version.V2


def addr(app: App) -> tuple[str, int]:
    host, port = app.addresses["lumberjack"].rsplit(":", 1)
    return host, int(port)


def W(size: int, v: Version = V2) -> bytes:
    return WindowSizeFrame(size, v).serialize()


def J(seq: int, obj: object, v: Version = V2) -> bytes:
    return JsonFrame(seq, orjson.dumps(obj), v).serialize()


def C(frames: bytes, level: int = 6) -> bytes:
    return CompressedFrame.compress(frames, level)


def D(seq: int, pairs: dict[str, str]) -> bytes:
    return DataFrame.from_mapping(seq, pairs, V1).serialize()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def ack(v: Version, seq: int) -> bytes:
    return struct.pack(">BBI", v, 0x41, seq)


def records(app: App) -> list[Any]:
    return [r for r in app.hub.journal.read(0) if r.protocol == "lumberjack"]


def pylogbeat_send(
    host: str, port: int, total: int, window: int, **kw: Any
) -> list[dict[str, Any]]:
    """Send ``total`` events with pylogbeat; every ``send`` returns only once acked."""
    sent: list[dict[str, Any]] = []
    with pylogbeat.PyLogBeatClient(host, port, timeout=None, **kw) as client:
        for start in range(0, total, window):
            batch = [
                {"message": f"event {i} \u00e9", "id": i, "fields": {"app": "peer"}, "type": "t"}
                for i in range(start, min(total, start + window))
            ]
            client.send(batch)
            sent += batch
    return sent


# --- real peers --------------------------------------------------------------------------------


class TestPylogbeat:
    """pylogbeat 2.1.0 (v2 J frames in one C per window, counting seq per connection)."""

    async def test_plain_10k(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            host, port = addr(app)
            sent = await asyncio.to_thread(pylogbeat_send, host, port, 10_000, 1000)
            recs = records(app)
        assert len(recs) == len(sent) == 10_000
        for rec, event in zip(recs, sent, strict=True):
            # pylogbeat encodes with json.dumps: the journal holds exactly those bytes.
            assert rec.payload == json.dumps(event).encode()
            assert (rec.content_type, rec.attrs, rec.stream, rec.topic) == (
                "json",
                {"v": "2"},
                "peer",
                "t",
            )
        assert [r.seq for r in recs] == list(range(1, 10_001))
        assert recs[0].producer.startswith("127.0.0.1:")

    async def test_tls_10k_pkcs8(self, tmp_path: Path) -> None:
        tls = make_tls(tmp_path)
        cfg = {"tls_cert": str(tls.cert), "tls_key": str(tls.key_pkcs8)}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)
            sent = await asyncio.to_thread(
                pylogbeat_send,
                host,
                port,
                10_000,
                2000,
                ssl_enable=True,
                ssl_verify=True,
                ca_certs=str(tls.ca),
            )
            recs = records(app)
        assert [r.payload for r in recs] == [json.dumps(e).encode() for e in sent]
        assert len(recs) == 10_000


class TestNpmLumberjackProtocol:
    """npm lumberjack-protocol 1.0.7: v1 over TLS, one W then an endless stream of D frames."""

    async def test_tls_10k_pkcs1(self, tmp_path: Path) -> None:
        script = PEERS / "lj_v1_send.js"
        module = PEERS / "node_modules" / "lumberjack-protocol"
        if not Path(NODE).exists() or not module.exists():
            pytest.fail(
                f"node peer missing (node at {NODE}, module at {module}): run "
                "`npm install --prefix tests/peers --no-audit --no-fund` (make test does)"
            )
        tls = make_tls(tmp_path)
        cfg = {"tls_cert": str(tls.cert), "tls_key": str(tls.key_pkcs1)}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)
            proc = await asyncio.create_subprocess_exec(
                NODE,
                str(script),
                host,
                str(port),
                str(tls.ca),
                "10000",
                "1000",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 90)
            assert proc.returncode == 0, err.decode()
            result = orjson.loads(out)
            recs = records(app)
        # The peer saw the ack of its last sequence number: everything is durable.
        assert result == {"sent": 10_000, "lastAck": 10_000, "dropped": 0}
        assert len(recs) == 10_000
        for i, rec in enumerate(recs):
            expected = {
                "line": f"node event {i} \u00e9\u6f22",
                "n": str(i),
                "type": "nodetest",
                "host": "node-peer",
            }
            assert rec.payload == orjson.dumps(expected)
            assert (rec.seq, rec.content_type, rec.attrs, rec.topic) == (
                i + 1,
                "kv",
                {"v": "1"},
                "nodetest",
            )


# --- TLS configuration ------------------------------------------------------------------------


class TestTLS:
    async def test_client_auth_required_producer_is_subject_cn(self, tmp_path: Path) -> None:
        tls = make_tls(tmp_path, client_cn="shipper-7")
        cfg = {
            "tls_cert": str(tls.cert),
            "tls_key": str(tls.key_pkcs8),
            "tls_ca": str(tls.ca),
            "tls_client_auth": "required",
        }
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)
            ctx = client_ssl_context(str(tls.ca), str(tls.client_cert), str(tls.client_key))

            def with_cert() -> int:
                with LumberjackClient(
                    host, port, ssl_context=ctx, server_hostname="localhost"
                ) as c:
                    return c.send([{"m": i} for i in range(100)])

            assert await asyncio.to_thread(with_cert) == 100

            def without_cert() -> None:
                bare = client_ssl_context(str(tls.ca))
                with LumberjackClient(
                    host, port, ssl_context=bare, server_hostname="localhost", reconnect_attempts=0
                ) as c:
                    c.send([{"m": "never"}])

            with pytest.raises((ssl.SSLError, OSError)):
                await asyncio.to_thread(without_cert)
            recs = records(app)
        assert len(recs) == 100 and {r.producer for r in recs} == {"shipper-7"}

    async def test_failed_handshakes_are_counted_and_cost_nothing(self, tmp_path: Path) -> None:
        tls = make_tls(tmp_path)
        cfg = {"tls_cert": str(tls.cert), "tls_key": str(tls.key_pkcs8), "handshake_timeout_s": 0.5}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)
            # plain Lumberjack on the TLS port, and a peer that connects and says nothing
            _, plain = await asyncio.open_connection(host, port)
            plain.write(b"2W\x00\x00\x00\x01")
            await plain.drain()
            _, silent = await asyncio.open_connection(host, port)
            registry = app.hub.metrics.registry
            name = "taproom_access_refused_connections_total"
            causes = ("tls_plaintext", "tls_handshake_timeout")
            labels = [{"listener": "lumberjack", "reason": cause} for cause in causes]
            deadline = time.monotonic() + 10
            while [registry.get_sample_value(name, label) for label in labels] != [1, 1]:
                assert time.monotonic() < deadline, "failed handshakes were not counted"
                await asyncio.sleep(0.1)
            plain.close()
            silent.close()
            # a good client is served meanwhile and afterwards
            ctx = client_ssl_context(str(tls.ca))

            def good() -> int:
                with LumberjackClient(
                    host, port, ssl_context=ctx, server_hostname="localhost"
                ) as c:
                    return c.send([{"m": i} for i in range(10)])

            assert await asyncio.to_thread(good) == 10
            assert [registry.get_sample_value(name, label) for label in labels] == [1, 1]
            assert app.services["lumberjack"].handshaking == set()

    def test_context_minimum_is_tls_1_2(self, tmp_path: Path) -> None:
        from taproom.servers.lumberjack import server_ssl_context

        tls = make_tls(tmp_path)
        config = load(
            write_config(
                tmp_path, lumberjack={"tls_cert": str(tls.cert), "tls_key": str(tls.key_pkcs1)}
            )
        )
        ctx = server_ssl_context(config.lumberjack)
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2

    @pytest.mark.parametrize(
        ("change", "key"),
        [
            ({"tls_cert": "MISSING", "tls_key": "KEY"}, "tls_cert"),
            ({"tls_key": "KEY"}, "tls_cert"),
            ({"tls_cert": "CERT"}, "tls_key"),
            ({"tls_cert": "CERT", "tls_key": "CA"}, "tls_key"),
            (
                {"tls_cert": "CERT", "tls_key": "KEY", "tls_client_auth": "required"},
                "tls_client_auth",
            ),
            ({"tls_cert": "CERT", "tls_key": "KEY", "tls_ca": "KEY"}, "tls_ca"),
        ],
    )
    def test_misconfiguration_fails_validate(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, str], key: str
    ) -> None:
        tls = make_tls(tmp_path)
        paths = {"CERT": str(tls.cert), "KEY": str(tls.key_pkcs8), "CA": str(tls.ca)}
        values = {
            k: paths.get(v, str(tmp_path / v)) if k != "tls_client_auth" else v
            for k, v in change.items()
        }
        path = write_config(tmp_path, lumberjack=values)
        assert cli.main(["validate", "--config", str(path)]) == 78
        assert f"lumberjack.{key}" in capsys.readouterr().err

    def test_good_tls_config_validates(self, tmp_path: Path) -> None:
        tls = make_tls(tmp_path)
        for key in (tls.key_pkcs1, tls.key_pkcs8):
            values = {
                "tls_cert": str(tls.cert),
                "tls_key": str(key),
                "tls_ca": str(tls.ca),
                "tls_client_auth": "optional",
            }
            path = write_config(tmp_path, lumberjack=values)
            assert cli.main(["validate", "--config", str(path)]) == 0


# --- protocol behaviour over real sockets ------------------------------------------------------


def _metric(app: App, reason: str) -> float:
    return _gauge(app, "taproom_ingest_rejected_items_total", f'reason="{reason}"')


def _refused(app: App, reason: str) -> float:
    """Connections the listener's gate refused (taproom_access_refused_connections_total)."""
    value = app.hub.metrics.registry.get_sample_value(
        "taproom_access_refused_connections_total", {"listener": "lumberjack", "reason": reason}
    )
    return value or 0.0


def _gauge(app: App, name: str, label: str = "") -> float:
    """The value of metric ``name`` (with ``label`` among its labels) in /metrics; 0 if absent."""
    for line in app.hub.metrics.render().decode().splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _until(condition: Any, timeout: float = 20.0) -> None:
    """Wait for ``condition()`` with a generous deadline (the machine may be loaded)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


class TestAcks:
    async def test_pipelined_windows_acked_in_order(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            host, port = addr(app)

            def run() -> bytes:
                # go-lumber style: seq restarts at 1 in every window; three windows at once.
                data = b"".join(
                    W(n)
                    + CompressedFrame.compress(b"".join(J(s, {"w": n}) for s in range(1, n + 1)))
                    for n in (2, 3, 1)
                )
                with socket.create_connection((host, port)) as s:
                    s.sendall(data)
                    return recv_exact(s, 18)

            assert await asyncio.to_thread(run) == ack(V2, 2) + ack(V2, 3) + ack(V2, 1)
            assert len(records(app)) == 6

    async def test_window_zero_and_idle_ack_for_streaming_v1(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            host, port = addr(app)

            def run() -> tuple[bytes, bytes, bytes]:
                with socket.create_connection((host, port)) as s:
                    s.sendall(W(0, V1))
                    zero = recv_exact(s, 6)
                    # npm-style: one W of 1000, then only 5 D frames: acked when idle.
                    s.sendall(W(1000, V1) + b"".join(D(i, {"line": str(i)}) for i in range(1, 6)))
                    first = recv_exact(s, 6)
                    s.sendall(b"".join(D(i, {"line": str(i)}) for i in range(6, 9)))
                    return zero, first, recv_exact(s, 6)

            zero, first, second = await asyncio.to_thread(run)
            assert zero == ack(V1, 0)
            assert first == ack(V1, 5) and second == ack(V1, 8)
            assert [r.seq for r in records(app)] == list(range(1, 9))

    async def test_keepalive_on_v2_only(self, tmp_path: Path) -> None:
        async with running_app(
            tmp_path, enable=["lumberjack"], lumberjack={"keepalive_s": 0.2}
        ) as app:
            host, port = addr(app)
            slow_commits(app.hub, 1.2)

            def run(v: Version) -> list[bytes]:
                frame = J(1, {"a": 1}, v)
                got = []
                with socket.create_connection((host, port)) as s:
                    s.sendall(W(1, v) + frame)
                    while True:
                        a = recv_exact(s, 6)
                        got.append(a)
                        if a != ack(v, 0):
                            return got

            v2 = await asyncio.to_thread(run, V2)
            v1 = await asyncio.to_thread(run, V1)
        assert v2[-1] == ack(V2, 1) and len(v2) >= 2 and set(v2[:-1]) == {ack(V2, 0)}
        assert v1 == [ack(V1, 1)]

    async def test_first_keepalive_one_interval_after_the_window(self, tmp_path: Path) -> None:
        # Issue 18 item 7: keepalives rode a shared 1 s tick, so the first came anywhere from
        # 0 to keepalive_s + 1 s after the window was read. It is timed per connection now;
        # a keepalive can come late on a loaded machine, never early.
        keepalive = 0.5
        async with running_app(
            tmp_path, enable=["lumberjack"], lumberjack={"keepalive_s": keepalive}
        ) as app:
            host, port = addr(app)
            slow_commits(app.hub, 3 * keepalive)

            def first_keepalive_after(stagger: float) -> float:
                time.sleep(stagger)  # different phases against any shared tick
                with socket.create_connection((host, port)) as s:
                    started = time.monotonic()
                    s.sendall(W(1) + J(1, {"a": 1}))
                    assert recv_exact(s, 6) == ack(V2, 0)
                    waited = time.monotonic() - started
                    while recv_exact(s, 6) == ack(V2, 0):
                        pass
                    return waited

            waits = [await asyncio.to_thread(first_keepalive_after, i * 0.13) for i in range(4)]
        assert min(waits) >= keepalive, waits


class TestLimits:
    async def test_violation_closes_only_that_connection(self, tmp_path: Path) -> None:
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            host, port = addr(app)

            def run() -> tuple[bytes, bytes, bytes]:
                good = socket.create_connection((host, port))
                bad = socket.create_connection((host, port))
                try:
                    good.sendall(W(2) + J(1, {"g": 1}))
                    # A complete window, then garbage in the same segment: the window is still
                    # committed and acked, then the connection is closed.
                    bad.sendall(W(1) + J(1, {"b": 1}) + b"2Zjunk")
                    bad_reply = recv_exact(bad, 12)
                    good.sendall(J(2, {"g": 2}))
                    return bad_reply, recv_exact(good, 6), b""
                finally:
                    good.close()
                    bad.close()

            bad_reply, good_ack, _ = await asyncio.to_thread(run)
            assert bad_reply == ack(V2, 1)  # then EOF: recv_exact stopped short
            assert good_ack == ack(V2, 2)
            assert _metric(app, "bad_frame_type") == 1
            assert sorted(r.payload for r in records(app)) == [
                b'{"b":1}',
                b'{"g":1}',
                b'{"g":2}',
            ]

    async def test_window_too_large_and_max_connections(self, tmp_path: Path) -> None:
        cfg = {"max_window": 100, "max_connections": 2}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)

            def run() -> tuple[bytes, bytes]:
                a = socket.create_connection((host, port))
                b = socket.create_connection((host, port))
                time.sleep(0.2)
                c = socket.create_connection((host, port))
                try:
                    refused = c.recv(10)
                    a.sendall(W(101))
                    return refused, a.recv(10)
                finally:
                    for s in (a, b, c):
                        s.close()

            refused, too_large = await asyncio.to_thread(run)
            assert refused == b"" and too_large == b""
            assert _refused(app, "max_connections") == 1
            assert _metric(app, "window_too_large") == 1

    async def test_idle_timeout(self, tmp_path: Path) -> None:
        cfg = {"idle_timeout_s": 0.3}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)

            def run() -> tuple[bytes, float]:
                with socket.create_connection((host, port)) as s:
                    s.settimeout(10)
                    started = time.monotonic()
                    return s.recv(10), time.monotonic() - started

            data, waited = await asyncio.to_thread(run)
            assert data == b"" and waited < 9
            assert _metric(app, "idle_timeout") == 1

    async def test_idle_tls_connection_closed_once_and_at_once(self, tmp_path: Path) -> None:
        # Issue 18 item 6: the sweep closed an idle TLS connection every second for 30 s
        # (TLS close waits for a close_notify shippers never send), counting it each time.
        tls = make_tls(tmp_path)
        cfg = {"tls_cert": str(tls.cert), "tls_key": str(tls.key_pkcs8), "idle_timeout_s": 0.5}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)
            ctx = client_ssl_context(ca=str(tls.ca))
            raw = await asyncio.to_thread(socket.create_connection, (host, port))
            conn = await asyncio.to_thread(ctx.wrap_socket, raw, server_hostname="localhost")
            try:
                open_now = lambda: _gauge(app, "taproom_ingest_open_connections", "lumberjack")  # noqa: E731
                await _until(lambda: open_now() == 1)
                await _until(lambda: _metric(app, "idle_timeout") >= 1)
                await _until(lambda: open_now() == 0, timeout=10)  # not after 30 s
                await asyncio.sleep(2.5)  # several more sweeps
                assert _metric(app, "idle_timeout") == 1
            finally:
                conn.close()

    async def test_a_trickle_of_bytes_is_idle(self, tmp_path: Path) -> None:
        # Issue 19 item 9: one byte every 2 s kept a connection past idle_timeout_s. Idle now
        # means no complete frame.
        cfg = {"idle_timeout_s": 1.0}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)

            def trickle() -> float:
                frame = W(1) + J(1, {"slow": "x" * 100})
                with socket.create_connection((host, port)) as s:
                    started = time.monotonic()
                    for byte in frame[:-1]:
                        try:
                            s.sendall(bytes([byte]))
                        except OSError:
                            break
                        s.settimeout(0.3)
                        try:
                            if s.recv(10) == b"":
                                break
                        except TimeoutError:
                            continue
                    return time.monotonic() - started

            lasted = await asyncio.to_thread(trickle)
            assert lasted < 30  # the frame would take ~35 s to trickle in
            assert _metric(app, "idle_timeout") == 1

    async def test_connections_per_peer_are_capped(self, tmp_path: Path) -> None:
        # Issue 19 item 9: 4,096 idle sockets from one host locked out every other shipper.
        cfg = {"max_connections_per_peer": 3}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
            host, port = addr(app)

            def run() -> tuple[bytes, bytes, bytes]:
                held = [socket.create_connection((host, port)) for _ in range(3)]
                try:
                    with socket.create_connection((host, port)) as fourth:
                        fourth.settimeout(10)
                        refused = fourth.recv(10)
                    # Another host (127.0.0.2 is loopback too) still gets in and is acked.
                    with socket.create_connection(
                        (host, port), source_address=("127.0.0.2", 0)
                    ) as other:
                        other.sendall(W(1) + J(1, {"other": 1}))
                        other_ack = recv_exact(other, 6)
                    held[0].sendall(W(1) + J(1, {"held": 1}))
                    return refused, other_ack, recv_exact(held[0], 6)
                finally:
                    for s in held:
                        s.close()

            refused, other_ack, held_ack = await asyncio.to_thread(run)
            assert refused == b"" and other_ack == ack(V2, 1) and held_ack == ack(V2, 1)
            assert _refused(app, "max_connections_per_peer") == 1

    async def test_incomplete_frames_share_the_connection_buffers(self, tmp_path: Path) -> None:
        # Issue 19 item 9: 20 connections each holding 15 MiB of an unfinished frame took
        # 369 MB. Large incomplete frames reserve their size from the process budget's
        # connection_buffers holder (shared with every listener); the rest wait without
        # reading, in turn, and small windows still flow.
        frame_len = 1 << 20
        cfg = {"max_event_bytes": frame_len}
        hub_cfg = {"connection_buffer_bytes": 3 * frame_len + 100}
        async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg, hub=hub_cfg) as app:
            host, port = addr(app)
            big = J(1, {"pad": "p" * (frame_len - 20)})
            assert frame_len - 100 < len(big) <= frame_len
            attackers = [
                await asyncio.to_thread(socket.create_connection, (host, port)) for _ in range(5)
            ]
            buffers = app.hub.budget.holder("connection_buffers")
            try:
                for s in attackers:
                    s.sendall(W(1) + big[: 600 << 10])
                await _until(lambda: buffers.used == 3 * len(big) and buffers.waiting == 2)

                def small_window() -> bytes:
                    with socket.create_connection((host, port)) as s:
                        s.sendall(W(2) + J(1, {"small": 1}) + J(2, {"small": 2}))
                        return recv_exact(s, 6)

                assert await asyncio.to_thread(small_window) == ack(V2, 1 + 1)
                # One attacker finishes its frame: its reservation goes to a waiting one.
                attackers[0].sendall(big[600 << 10 :])
                assert await asyncio.to_thread(recv_exact, attackers[0], 6) == ack(V2, 1)
                await _until(lambda: buffers.used == 3 * len(big) and buffers.waiting == 1)
                assert buffers.peak <= buffers.bound
            finally:
                for s in attackers:
                    s.close()
            await _until(lambda: buffers.used == 0 and buffers.waiting == 0)

    async def test_one_read_of_compressed_frames_stays_within_the_pending_bytes(
        self, tmp_path: Path
    ) -> None:
        # Issue 19 item 6: what one read inflated was all submitted at once (520 MB pending
        # against 64 MiB). Journal room is reserved before events are made: the pending bytes
        # never pass the bound (one event larger than it goes alone).
        inflated = 100 << 10
        hub_cfg = {"max_pending_bytes": 256 << 10}
        async with running_app(tmp_path, enable=["lumberjack"], hub=hub_cfg) as app:
            host, port = addr(app)
            frame = W(1) + C(J(1, {"pad": "q" * (inflated - 100)}))
            data = frame * 40
            assert len(data) < 64 << 10  # one read on the server

            def run() -> bytes:
                with socket.create_connection((host, port)) as s:
                    s.sendall(data)
                    return recv_exact(s, 6 * 40)

            assert await asyncio.to_thread(run) == ack(V2, 1) * 40
            assert len(records(app)) == 40
            pending = app.hub.budget.holder("pending")
            assert pending.peak <= pending.bound, pending.peak
            await _until(lambda: pending.used == 0)

    async def test_backpressure_stops_reading_and_loses_nothing(self, tmp_path: Path) -> None:
        async with running_app(
            tmp_path, enable=["lumberjack"], hub={"max_pending_bytes": 65536}
        ) as app:
            host, port = addr(app)

            def run() -> int:
                with LumberjackClient(host, port, window_size=1000, pipeline=4) as c:
                    return c.send({"m": "x" * 200, "i": i} for i in range(12_000))

            assert await asyncio.to_thread(run) == 12_000
            # The connection waited: for the hub's capacity, or (not reading) for journal room.
            registry = app.hub.metrics.registry
            waits = (
                registry.get_sample_value("taproom_hub_backpressure_waits_calls_total") or 0
            ) + (
                registry.get_sample_value("taproom_budget_waits_calls_total", {"holder": "pending"})
                or 0
            )
            assert waits > 0
            pending = app.hub.budget.holder("pending")
            assert pending.peak <= pending.bound
            assert [orjson.loads(r.payload)["i"] for r in records(app)] == list(range(12_000))


# --- child-process tests: zlib bomb, SIGKILL ---------------------------------------------------


def zlib_bomb(levels: int = 3, inflated: int = 1 << 30) -> bytes:
    """A C frame nested ``levels`` deep whose innermost content inflates to ``inflated`` zeros."""
    comp = zlib.compressobj(9)
    block = bytes(1 << 20)
    head = comp.compress(block) + comp.flush(zlib.Z_FULL_FLUSH)
    middle = comp.compress(block) + comp.flush(zlib.Z_FULL_FLUSH)  # same bytes for every MiB
    final = comp.flush()[:-4]
    # Adler-32 of n zero bytes: A stays 1, B = n mod 65521.
    adler = ((inflated % 65521) << 16) | 1
    stream = head + middle * ((inflated >> 20) - 1) + final + struct.pack(">I", adler)
    frame = CompressedFrame(stream).serialize()
    for _ in range(levels - 1):
        frame = CompressedFrame.compress(frame, 9)
    return frame


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


class TestZlibBomb:
    def test_bomb_rejected_within_bound_others_flow(self, tmp_path: Path) -> None:
        bound = 16 << 20  # the inflate holder's default share of the budget
        bomb = W(1) + zlib_bomb()
        assert len(bomb) < 1024  # 1 KiB on the wire ...
        path = write_config(tmp_path, enable=["lumberjack"])
        with HubProcess(path) as hub:
            assert hub.proc is not None
            host, port = hub.address("lumberjack")
            pylogbeat_send(host, port, 2000, 1000)  # warm up every code path
            baseline = vm_kib(hub.proc.pid, "VmRSS")
            others: list[Any] = []
            t = threading.Thread(
                target=lambda: others.extend(pylogbeat_send(host, port, 10_000, 500))
            )
            t.start()
            for _ in range(3):
                with socket.create_connection((host, port)) as s:
                    s.settimeout(30)
                    s.sendall(bomb)
                    assert s.recv(10) == b""  # closed, nothing acked
            t.join(60)
            assert len(others) == 10_000
            peak = vm_kib(hub.proc.pid, "VmHWM")
            # ... 1 GiB inflated would need 1 GiB; the hub grew by less than the bound + slack.
            assert (peak - baseline) * 1024 < bound + (48 << 20), (peak, baseline)
            web = hub.addresses["web"]
            metrics = urllib.request.urlopen(f"http://{web}/metrics", timeout=10).read().decode()
            # ... refused at its first inflated byte (zeros are no frame), whatever its size.
            assert 'reason="bad_version"} 3.0' in metrics
        payloads = {r.payload for r in JournalReader(tmp_path / "journal").read(0)}
        assert all(json.dumps(e).encode() in payloads for e in others)


def _crash_run(tmp_path: Path, kills: int, total: int) -> None:
    """pylogbeat streams ``total`` events while the hub is SIGKILLed ``kills`` times."""
    port = free_port()
    path = write_config(tmp_path, enable=["lumberjack"], lumberjack={"port": port})
    window = 500
    acked_ids: set[int] = set()
    unacked_windows: list[range] = []
    stop_error: list[BaseException] = []

    def sender() -> None:
        try:
            client: pylogbeat.PyLogBeatClient | None = None
            start = 0
            while start < total:
                ids = range(start, min(total, start + window))
                try:
                    if client is None:
                        client = pylogbeat.PyLogBeatClient("127.0.0.1", port, timeout=None)
                    client.send([{"id": i, "message": f"crash {i}"} for i in ids])
                except (OSError, pylogbeat.ConnectionException):
                    # Killed mid-window: not acked, so resend it after the restart.
                    if not unacked_windows or unacked_windows[-1] != ids:
                        unacked_windows.append(ids)
                    if client is not None:
                        client.close()
                    client = None
                    time.sleep(0.1)
                    continue
                acked_ids.update(ids)
                start += window
            if client is not None:
                client.close()
        except BaseException as exc:  # surfaced to the test below
            stop_error.append(exc)

    with HubProcess(path) as hub:
        assert hub.address("lumberjack")[1] == port
        t = threading.Thread(target=sender)
        t.start()
        for k in range(1, kills + 1):
            deadline = time.monotonic() + 60
            while len(acked_ids) < k * total // (kills + 1) and time.monotonic() < deadline:
                if stop_error:
                    break
                time.sleep(0.005)
            hub.kill()  # SIGKILL while pylogbeat is streaming
            hub.start()
        t.join(120)
        assert not t.is_alive() and not stop_error, stop_error
    ids = [orjson.loads(r.payload)["id"] for r in JournalReader(tmp_path / "journal").read(0)]
    assert acked_ids == set(range(total)) and acked_ids <= set(ids)
    counts: dict[int, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    duplicates = {i for i, n in counts.items() if n > 1}
    resent = {i for r in unacked_windows for i in r}
    assert unacked_windows, "no kill hit a window in flight"
    # Duplicates only from windows that were never acknowledged (committed, then killed).
    assert duplicates <= resent
    print(f"unacked windows {len(unacked_windows)}, duplicated events {len(duplicates)}")


class TestCrash:
    def test_sigkill_mid_stream_acked_events_survive(self, tmp_path: Path) -> None:
        _crash_run(tmp_path, kills=1, total=10_000)

    @pytest.mark.soak
    def test_sigkill_loop_soak(self, tmp_path: Path) -> None:
        _crash_run(tmp_path, kills=10, total=100_000)


def test_stdin_and_count_cli(tmp_path: Path) -> None:
    """Runs here because it needs a server: ``taproom send lumberjack`` both ways."""
    import subprocess
    import sys

    path = write_config(tmp_path, enable=["lumberjack"])
    with HubProcess(path) as hub:
        host, port = hub.address("lumberjack")
        base = [sys.executable, "-m", "taproom", "send", "lumberjack", "--host", host]
        base += ["--port", str(port)]
        done = subprocess.run(
            [*base, "--v1", "--count", "300", "--window", "128"],
            capture_output=True,
            timeout=60,
            env={**os.environ},
        )
        assert done.returncode == 0, done.stderr
        lines = b'{"message": "json line"}\nplain line\n'
        done = subprocess.run(
            [*base, "--field", "app=cli"], input=lines, capture_output=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert b"acked 2 of 2" in done.stderr
    recs = list(JournalReader(tmp_path / "journal").read(0))
    assert len(recs) == 302
    assert [orjson.loads(r.payload) for r in recs[-2:]] == [
        {"message": "json line", "fields": {"app": "cli"}},
        {"message": "plain line", "fields": {"app": "cli"}},
    ]
    assert recs[-1].stream == "cli" and recs[0].attrs == {"v": "1"}


class TestEventTime:
    async def test_timestamp_is_the_event_time_and_out_of_range_is_counted(
        self, tmp_path: Path
    ) -> None:
        """Issue 25 part 4: @timestamp in year 9999 or 0001 was silently stored as 0; it is
        stored absent and counted (odd event time_out_of_range), the events all kept."""
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            stamps = ["2026-01-01T00:00:00.250Z", "9999-12-31T23:59:59Z", "0001-01-01T00:00:00Z"]
            data = W(3) + b"".join(
                J(i + 1, {"@timestamp": stamp, "message": "m"}) for i, stamp in enumerate(stamps)
            )
            with socket.create_connection(addr(app)) as sock:
                sock.sendall(data)
                assert await asyncio.to_thread(recv_exact, sock, 6) == ack(V2, 3)
            assert [r.ts_ns for r in records(app)] == [1_767_225_600_250_000_000, 0, 0]
            labels = {"protocol": "lumberjack", "reason": "time_out_of_range"}
            odd = app.hub.metrics.registry.get_sample_value(
                "taproom_ingest_odd_events_total", labels
            )
            assert odd == 2
