"""The Lager forwarder's compiled row kernel (zmqburst/lager.c: lg_run) against its Python twin.

A burst goes through the forwarder twice, with no socket: once the compiled way (lg_run takes
the rows it is sure of, every other message goes through the Python path, in order) and once
all through the Python path. Both must journal the same record bytes, forward the same wire
bytes to both outputs (as received; split per item for a real Mug), count the same rows per
tap, refuse the same messages for the same reasons, hold the same rows and count the same
out-of-range times. Bursts are fuzzed: registered taps of random formats (short and long
items), both framings, versions and flags, mutated header and item sizes, unknown uuids,
timestamps past 2^63 and messages over the frame limit (whose extra frames a burst does not
keep). The forwarder on both burst paths end to end is tests/servers/test_lager*.py.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from taproom import zmqburst
from taproom.config import load_config
from taproom.hub import Hub
from taproom.protocols.lager.chp import Registrar, Registration
from taproom.protocols.lager.formats import parse_format_xml
from taproom.servers.lager.batch import Batch, KernelRows, PyRows
from taproom.servers.lager.forwarder import Forwarder
from taproom.servers.lager.kernel import RowKernel
from tests.support import fuzz_examples

MAX_FRAMES = 12
_TYPES = [("uint8_t", 1), ("uint16_t", 2), ("float", 4), ("double", 8), ("string", 3),
          ("string", 300)]  # fmt: skip


def _format_xml(rng: random.Random) -> str:
    items, offset = [], 0
    for k in range(rng.choice([1, 1, 2, 4, MAX_FRAMES - 4])):
        name, size = rng.choice(_TYPES)
        items.append(f'<item name="i{k}" type="{name}" size="{size}" offset="{offset}"/>')
        offset += size
    return '<format version="BEERR01">' + "".join(items) + "</format>"


def _forwarder(hub: Hub, registrar: Registrar, rejects: list[tuple[str, str]]) -> Forwarder:
    config = load_config(text=f"[lager]\nmax_message_frames = {MAX_FRAMES}\n", env={}).lager
    return Forwarder(
        hub,
        config,
        lambda: registrar,
        lambda reason, detail: rejects.append((reason, detail)),
        touch=lambda _uuids, _now: None,
    )


def _compiled_burst(messages: list[list[bytes]]) -> Any:
    """Messages laid out as the ZMTP reader lays out a burst: MAX_FRAMES kept a message."""
    ffi, _lib = zmqburst.ffi_lib()
    frames = [f for m in messages for f in m[:MAX_FRAMES]]
    ends, pos = [], 0
    for f in frames:
        pos += len(f)
        ends.append(pos)
    data = b"".join(frames)
    reader = SimpleNamespace(
        buf=ffi.new("char[]", data or b"\0"),
        frame_end=ffi.new("size_t[]", ends or [0]),
        counts=ffi.new("int[]", [len(m) for m in messages] or [0]),
        max_frames=MAX_FRAMES,
    )
    return zmqburst._ExtBurst(reader, len(messages), len(frames), len(data))  # type: ignore[arg-type]


def _message(
    rng: random.Random, taps: list[tuple[bytes, Any]], strangers: list[bytes]
) -> list[bytes]:
    raw_uuid, fmt = rng.choice(taps)
    if rng.random() < 0.08:
        raw_uuid = rng.choice(strangers)  # no registration names it: held
    sizes = [item.size for item in fmt.items]
    if rng.random() < 0.5:  # nasa/lager's framing: one frame per item
        version, flags = b"BEERR01", rng.choice([b"\x00", b"\x03"])
        items = [rng.randbytes(size) for size in sizes]
    else:  # the seed's: one payload frame
        version, flags = bytes([1, rng.randrange(2)]), rng.choice([b"\x00\x00", b"\x01\x05"])
        items = [rng.randbytes(fmt.row_size)]
    ts = rng.choice([rng.randrange(2**63), rng.randrange(2**63, 2**64), 0, 2**63 - 1, 2**63])
    frames = [raw_uuid, version, flags, ts.to_bytes(8, "big"), *items]
    for _ in range(rng.choice([0] * 8 + [1, 2])):  # mutations
        kind = rng.randrange(8)
        k = rng.randrange(len(frames))
        if kind == 0:  # a frame one byte longer or shorter
            frames[k] = frames[k] + b"x" if rng.random() < 0.5 else frames[k][:-1]
        elif kind == 1:  # an item moved between frames: same row size, other item sizes
            if len(frames) > 5 and len(frames[4]) > 1:
                frames[5] = frames[4][-1:] + frames[5]
                frames[4] = frames[4][:-1]
        elif kind == 2:
            frames = frames[: rng.randrange(1, len(frames) + 1)]
        elif kind == 3:  # over the frame limit (the burst keeps MAX_FRAMES)
            frames += [b"\x01"] * rng.randrange(1, 6)
        elif kind == 4 and len(frames) > 1:
            frames[1] = rng.choice([b"BEERR99", b"\x02\x00", b"", b"123456789", b"\x01"])
        elif kind == 5 and len(frames) > 2:
            frames[2] = rng.choice([b"", b"\x00\x00\x00", b"\x07", b"\x00\x01"])
        elif kind == 6:  # an empty item frame
            frames.append(b"")
        elif kind == 7:
            frames[0] = rng.choice([frames[0][:15], frames[0] + b"\x00", uuid.uuid4().bytes])
    return frames


def _outcome(fwd: Forwarder, batch: Batch, rejects: list[tuple[str, str]]) -> dict[str, Any]:
    batch.close_chunk()
    counted, plain = batch.burst(plain=False), batch.burst(plain=True)
    return {
        "records": b"".join(batch.parts),
        "rows": batch.rows,
        "counted": (bytes(counted.wire), list(counted.ends), counted.topics),
        "plain": (bytes(plain.wire), list(plain.ends), plain.topics),
        "per_tap": dict(batch.per_tap),
        "rejects": list(rejects),
        "held": {u: h.messages for u, h in fwd._held.items()},
        "out_of_range": fwd._times.take(),
    }


@pytest.fixture(autouse=True)
def ext() -> Iterator[None]:
    """The compiled path; fails (never skips) when the compiled module is not built."""
    before = zmqburst.active()
    zmqburst.select("ext")
    yield
    zmqburst.select(before)


async def test_kernel_takes_what_python_takes_byte_for_byte(tmp_path: Path) -> None:
    config = load_config(text=f'[journal]\ndir = "{tmp_path}"\n', env={})
    async with Hub(config) as hub:
        taken = await _fuzz(hub)
    assert taken > 1000  # the kernel took most rows, not none


async def _fuzz(hub: Hub) -> int:
    rng = random.Random(32)
    registrar = Registrar()
    taps = []
    for i in range(40):  # past the C table's first 64 slots: it grows and rehashes
        xml = _format_xml(rng)
        fmt = parse_format_xml(xml)
        raw_uuid = uuid.UUID(int=rng.getrandbits(128)).bytes
        # a long key makes records far bigger than rows: runs stop with the buffer full
        key = f"/Fuzz/T{i}/" + "k" * rng.choice([0, 0, 20_000])
        registrar.apply(Registration(key, raw_uuid, xml, fmt))
        taps.append((raw_uuid, fmt))
    strangers = [uuid.UUID(int=rng.getrandbits(128)).bytes for _ in range(2)]
    rejects_c: list[tuple[str, str]] = []
    rejects_py: list[tuple[str, str]] = []
    compiled = _forwarder(hub, registrar, rejects_c)
    python = _forwarder(hub, registrar, rejects_py)
    kernel = RowKernel.create(64, 8)  # runs of 8 at most: bursts of up to 40 go on
    assert kernel is not None
    compiled._kernel = kernel
    taken = 0
    for example in range(fuzz_examples(300, 30_000)):
        if example % 50 == 49:  # a registration changed the map: both caches start over
            compiled.formats_changed()
            python.formats_changed()
        messages = [_message(rng, taps, strangers) for _ in range(rng.randrange(1, 60))]
        burst = _compiled_burst(messages)
        received_ns = rng.randrange(2**62)
        batch_c, batch_py = Batch(), Batch()
        rejects_c.clear()
        rejects_py.clear()
        compiled._take_burst(kernel, burst, batch_c, received_ns)
        python._take_messages(burst.messages(), batch_py, received_ns)
        taken += sum(rows for chunk in batch_c.chunks if isinstance(chunk, KernelRows)
                     for _uuid, rows in chunk.runs)  # fmt: skip
        got, want = _outcome(compiled, batch_c, rejects_c), _outcome(python, batch_py, rejects_py)
        assert got == want, (example, messages)
    return taken


def test_kernel_leaves_a_tap_it_cannot_keep_to_python() -> None:
    """A full table keeps no more taps; parts not DataRecords' shape are not kept either."""
    kernel = RowKernel.create(1, 16)
    assert kernel is not None
    lib = kernel.lib
    items = kernel.ffi.new("uint32_t[]", [4])
    tail = b"t" * 30
    assert lib.lg_taps_add(kernel.taps, b"k" * 18, 18, tail, 30, 16 + 30 + 4, 4, items, 1) == 0
    assert lib.lg_taps_add(kernel.taps, b"j" * 18, 18, tail, 30, 16 + 30 + 4, 4, items, 1) == -1
    kernel.clear()
    # length must be the head after it, the tail and the row; the items must add up to the row
    assert lib.lg_taps_add(kernel.taps, b"j" * 18, 18, tail, 30, 16 + 30 + 5, 4, items, 1) == -1
    assert lib.lg_taps_add(kernel.taps, b"j" * 18, 18, tail, 30, 16 + 30 + 8, 8, items, 1) == -1
    assert lib.lg_taps_add(kernel.taps, b"j" * 28, 28, tail, 30, 16 + 30 + 4, 4, items, 1) == -1
    # a table grows with its taps (from 64 slots) up to its limit, and starts small again
    big = RowKernel.create(1000, 16)
    assert big is not None
    keys = [i.to_bytes(18, "big") for i in range(1001)]
    added = [lib.lg_taps_add(big.taps, k, 18, tail, 30, 16 + 30 + 4, 4, items, 1) for k in keys]
    assert added == [0] * 1000 + [-1]
    assert lib.lg_taps_add(big.taps, keys[5], 18, tail, 30, 16 + 30 + 4, 4, items, 1) == -1
    big.clear()
    assert lib.lg_taps_add(big.taps, keys[1000], 18, tail, 30, 16 + 30 + 4, 4, items, 1) == 0


@pytest.mark.parametrize("size", [1, 255, 256, 70_000])
def test_kernel_grows_its_records_buffer_for_a_big_row(tmp_path: Path, size: int) -> None:
    """A record bigger than the records buffer (a 60,000-byte key: the buffer is sized by the
    burst's bytes): the run stops with nothing taken, the buffer grows, the rows go through
    (records and wire as Python writes them)."""
    import asyncio

    async def main() -> None:
        config = load_config(text=f'[journal]\ndir = "{tmp_path}"\n', env={})
        async with Hub(config) as hub:
            xml = (f'<format version="BEERR01"><item name="s" type="string" size="{size}" '
                   'offset="0"/></format>')  # fmt: skip
            registrar = Registrar()
            u = uuid.uuid4().bytes
            registrar.apply(Registration("/Big/" + "k" * 60_000, u, xml, parse_format_xml(xml)))
            rejects: list[tuple[str, str]] = []
            compiled, python = (_forwarder(hub, registrar, rejects) for _ in range(2))
            kernel = RowKernel.create(4, 16)
            assert kernel is not None
            compiled._kernel = kernel
            row = [u, b"BEERR01", b"\x00", (5).to_bytes(8, "big"), b"r" * size]
            burst = _compiled_burst([row, row, row])
            batch_c, batch_py = Batch(), Batch()
            compiled._take_burst(kernel, burst, batch_c, 77)
            python._take_messages(burst.messages(), batch_py, 77)
            # the first row is Python's (it hands the tap's parts to the kernel), then the kernel's
            first, *kernel_chunks = batch_c.chunks
            assert isinstance(first, PyRows)
            assert sum(n for chunk in kernel_chunks for _u, n in getattr(chunk, "runs", [])) == 2
            assert _outcome(compiled, batch_c, rejects) == _outcome(python, batch_py, rejects)

    asyncio.run(main())
