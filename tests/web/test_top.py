"""``taproom top`` against a running hub's /api/overview."""

from __future__ import annotations

import asyncio
import re
import sys

from tests.support import running_app
from tests.web.console_support import send_lumberjack


async def top(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "taproom", "top", "--once", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_top_prints_the_overview(tmp_path):
    async with running_app(tmp_path, enable=["lumberjack"], web={"token": "tok"}) as app:
        await send_lumberjack(app.addresses["lumberjack"], [{"message": "x" * 100}])
        await asyncio.sleep(1.2)  # one stats sample after the event
        url = f"http://{app.addresses['web']}"
        code, out, err = await top("--url", url, "--token", "tok")
        assert code == 0, err
        assert "state      READY" in out
        assert "offsets 0..1" in out
        protocols = out.split("PROTOCOL")[1].split("LISTENER")[0].splitlines()
        assert "BYTES/S" in protocols[0]
        assert any(re.fullmatch(r"lumberjack +[\d.,]+ +[\d.,]+ (B|KiB)", row) for row in protocols)
        assert "lumberjack" in out.split("LISTENER")[1]  # its listener's connections
        code, _, err = await top("--url", url)  # no token: 401
        assert code == 1 and "401" in err


async def test_top_says_when_the_hub_is_unreachable(tmp_path):
    code, _, err = await top("--url", "http://127.0.0.1:9")
    assert code == 1 and "127.0.0.1:9" in err
