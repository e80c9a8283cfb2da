"""A slow disk for tests: a hub's commits are reported durable some time after they are.

Every test that needs a slow disk uses this (``tests.support`` re-exports it). The servers on the
one-request path (issue 32: logjam's 202s, LogTK's acks, the Event BUS's bursts) commit through
``Hub.submit_callback``, whose callback runs from the commit's own delivery: this helper slows
both, so a test holds any server's acknowledgements back whichever way it submits.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["slow_commits"]


def slow_commits(hub: Any, delay: float) -> None:
    """Every commit of ``hub`` submitted from now on is told durable ``delay`` s after it
    really is (it is written and fsynced as usual: only the report waits), to futures of
    ``Hub.submit`` and callbacks of ``Hub.submit_callback`` alike, in commit order."""
    real_submit, real_callback = hub.submit, hub.submit_callback

    def slow_submit(batch: Any, **kw: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        delayed: asyncio.Future[Any] = loop.create_future()

        def later(real: asyncio.Future[Any]) -> None:
            if real.cancelled():
                loop.call_later(delay, delayed.cancel)
            elif real.exception() is not None:
                loop.call_later(delay, delayed.set_exception, real.exception())
            else:
                loop.call_later(delay, delayed.set_result, real.result())

        real_submit(batch, **kw).add_done_callback(later)
        return delayed

    def slow_callback(batch: Any, callback: Any, **kw: Any) -> None:
        loop = asyncio.get_running_loop()
        real_callback(
            batch, lambda commit, error: loop.call_later(delay, callback, commit, error), **kw
        )

    hub.submit = slow_submit
    hub.submit_callback = slow_callback
