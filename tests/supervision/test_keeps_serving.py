"""The server keeps serving after any input (issue 25 part 3), for the protocols whose server
fuzzers live here: Lumberjack (mutated frame streams, one connection each) and logjam
(mutated messages on the ROUTER and the PULL). After the fuzz a valid message is accepted, no
loop died, no message met an internal error, and the hub is ready. ``make soak`` sends more.
(The Event BUS, Lager and LogTK fuzzers in tests/servers/ check the same.)"""

from __future__ import annotations

import asyncio
import random
import struct
from pathlib import Path

import orjson
import pytest
import zmq
import zmq.asyncio

from taproom.protocols import logjam as lj
from tests.supervision.support import internal_errors, until
from tests.support import fuzz_examples, running_app


def _mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        if not out:
            break
        at = rng.randrange(len(out))
        kind = rng.randrange(4)
        if kind == 0:
            out[at : at + 4] = rng.choice([0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 4096]).to_bytes(4, "big")
        elif kind == 1:
            out[at] ^= 1 << rng.randrange(8)
        elif kind == 2:
            del out[at:]
        else:
            out[at:at] = rng.randbytes(rng.randrange(1, 9))
    return bytes(out)


def _serving(app: object, protocol: str) -> None:
    assert internal_errors(app, protocol) == 0  # type: ignore[arg-type]
    hub = app.hub  # type: ignore[attr-defined]
    assert all(s.total_deaths == 0 for s in hub.supervisor.loops.values())
    assert app.readiness() == [] and hub.degraded() == []  # type: ignore[attr-defined]


async def test_lumberjack_keeps_serving_after_fuzzed_streams(tmp_path: Path) -> None:
    rng = random.Random(2501)
    events = [
        {"@timestamp": "2026-01-01T00:00:00.000Z", "message": "m", "fields": {"app": "a"}},
        {"@timestamp": "9999-12-31T23:59:59Z", "message": "far"},
    ]
    window = b"2W" + struct.pack(">I", len(events))
    for seq, doc in enumerate(events, 1):
        payload = orjson.dumps(doc)
        window += b"2J" + struct.pack(">II", seq, len(payload)) + payload
    # One address opens every stream, back to back: the per-address connection rate lifted
    # so that the soak's 5,000 reach the decoder (at 64/s most were refused at accept).
    settings = {
        "idle_timeout_s": 1.0,
        "peer_connections_per_s": 1e6,
        "peer_connection_burst": 10**6,
    }
    async with running_app(tmp_path, enable=["lumberjack"], lumberjack=settings) as app:
        host, port = app.addresses["lumberjack"].rsplit(":", 1)
        for _ in range(fuzz_examples(100, 5_000)):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(_mutate(rng, window))
                # the hub may have closed already on what it read: then the EOF cannot go
                writer.write_eof()
                # whatever it answers, until it closes (or the idle timeout does)
                while await asyncio.wait_for(reader.read(4096), 10):
                    pass
            except (OSError, TimeoutError):
                pass
            writer.close()
        refused = app.hub.metrics.registry.get_sample_value(
            "taproom_access_refused_connections_total",
            {"listener": "lumberjack", "reason": "peer_connection_rate"},
        )
        assert not refused, f"{refused} streams refused at accept never reached the decoder"
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(window)
        assert await asyncio.wait_for(reader.readexactly(6), 20) == b"2A" + struct.pack(">I", 2)
        writer.close()
        _serving(app, "lumberjack")


@pytest.mark.usefixtures("zmq_path")
async def test_logjam_keeps_serving_after_fuzzed_messages(tmp_path: Path) -> None:
    rng = random.Random(2502)
    good = lj.encode_message(
        b"app-production",
        b"logs.app",
        b'{"started_at": "2426-01-01T00:00:00Z"}',
        compression=lj.Compression.ZLIB,
        device=1,
        created_ms=1 << 62,
        sequence=1,
    )
    ctx = zmq.asyncio.Context()
    try:
        async with running_app(
            tmp_path, enable=["logjam"], logjam={"heartbeat_interval_s": 3600.0}
        ) as app:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect("tcp://" + app.addresses["logjam_pull"])
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect("tcp://" + app.addresses["logjam_router"])
            for i in range(fuzz_examples(500, 50_000)):
                frames = [_mutate(rng, f) if rng.random() < 0.4 else f for f in good]
                if rng.random() < 0.2:
                    frames = frames[: rng.randrange(len(frames) + 1)] or [b""]
                if i % 2:
                    await push.send_multipart(frames)
                else:
                    await dealer.send_multipart([b"", *frames])
            fence = lj.encode_message(
                b"app-production", b"logs.fence", b"{}", compression=0, device=1,
                created_ms=1, sequence=2,
            )  # fmt: skip
            await dealer.send_multipart([b"", *fence])
            await push.send_multipart(fence)  # each socket's fuzz is read before its fence
            await until(
                lambda: sum(r.topic == "logs.fence" for r in app.hub.journal.read(0)) == 2,
                60,
                "the messages after the fuzz",
            )
            _serving(app, "logjam")
    finally:
        ctx.destroy(0)
