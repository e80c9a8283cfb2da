"""clients/lager/: a mug that falls behind loses rows inside ZeroMQ, and now knows exactly
how many (issue 7): every row logged after ``subscribe()`` is received or counted as lost, for
a tap that had no rows at subscribe time and for one that had (the hello-time baseline)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from taproom.clients.lager import Mug, Tap
from tests.clients.test_lager import FORMATS, addresses
from tests.support import running_app

KEY = "/RobotA/Motion/"


def drain(mug: Mug, want: int, timeout: float = 20.0) -> list[int]:
    """Read until every row is received or counted lost (marks repeat every HUGZ round)."""
    timestamps: list[int] = []
    deadline = time.monotonic() + timeout
    while len(timestamps) + mug.lost < want and time.monotonic() < deadline:
        for frames in mug.recv_frames(4096, timeout=0.05):
            timestamps.append(int.from_bytes(frames[3], "big"))
    return timestamps


def log_rows(tap: Tap, first: int, n: int) -> None:
    for i in range(first, first + n):
        while not tap.log(ts_ns=i, x=i / 2, n=i):
            time.sleep(0.001)  # the bartender pushes back: wait, never drop


async def test_slow_mug_counts_what_it_lost(tmp_path: Path) -> None:
    # Tiny queues between the bartender and the mugs so that a mug that does not read loses:
    # 50 rows queued for it in the bartender, 50 in its libzmq, small kernel buffers.
    lager = {"hugz_interval_s": 0.05, "forward_hwm": 50}
    zmtp = {"subscriber_send_buffer_bytes": 4096}
    async with running_app(tmp_path, enable=["lager"], lager=lager, zmtp=zmtp) as app:
        where = addresses(app)
        gaps: list[tuple[str, int]] = []

        def run() -> None:
            tap = Tap(KEY, FORMATS[KEY], **where, watch=False).register()
            early = Mug(
                **where,
                recv_hwm=50,
                recv_buffer_bytes=4096,
                on_gap=lambda k, n: gaps.append((k, n)),
            )
            early.sync()
            early.subscribe(KEY)
            assert early.lost == 0
            log_rows(tap, 0, 1000)  # nobody reads: most of these are dropped for `early`
            first = drain(early, 1000)
            assert early.lost > 0 and len(first) + early.lost == 1000
            assert first == sorted(first) and len(set(first)) == len(first)
            assert early.lost_by_tap == {KEY: early.lost}
            assert sum(n for k, n in gaps if k == KEY) == early.lost

            # A mug subscribing to a tap that already has rows: the marks sent before the
            # hello reply are its baseline, so the 1000 earlier rows are not counted lost.
            late = Mug(**where, recv_hwm=50, recv_buffer_bytes=4096)
            late.sync()
            late.subscribe(KEY)
            log_rows(tap, 1000, 3000)
            second = drain(late, 3000)
            assert late.lost > 0 and len(second) + late.lost == 3000
            assert all(ts >= 1000 for ts in second)
            rest = drain(early, 4000 - len(first))  # behind again, and knows by how much
            assert len(first) + len(rest) + early.lost == 4000
            for mug in (early, late):
                mug.close()
            tap.close()

        await asyncio.to_thread(run)
        rows = [r for r in app.hub.journal.read(0) if r.content_type == "lager"]
        assert len(rows) == 4000  # the journal has every row whatever the mugs lost


async def test_mug_that_keeps_up_loses_nothing(tmp_path: Path) -> None:
    async with running_app(tmp_path, enable=["lager"], lager={"hugz_interval_s": 0.05}) as app:
        where = addresses(app)

        def run() -> None:
            tap = Tap(KEY, FORMATS[KEY], **where, watch=False).register()
            mug = Mug(**where)
            mug.sync()
            mug.subscribe(KEY)
            log_rows(tap, 0, 2000)
            got = drain(mug, 2000)
            time.sleep(0.2)  # a few more mark rounds: none may report a loss
            got += [int.from_bytes(f[3], "big") for f in mug.recv_frames(4096, timeout=0.1)]
            assert got == list(range(2000)) and mug.lost == 0 and mug.lost_by_tap == {}
            mug.close()
            tap.close()

        await asyncio.to_thread(run)
