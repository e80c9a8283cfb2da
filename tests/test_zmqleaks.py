"""The suite's guard against leaked ZeroMQ contexts (tests/zmqleaks.py), on real contexts.

The leak here is the one that cost the suite 5 minutes a run: a context dropped in a reference
cycle with a PUSH socket whose message can never be sent (nothing listens), LINGER -1. pyzmq's
own finalizer blocks in ``term()`` forever on it; with the guard, the collector's finalizer
returns, the context is termed and the leak is reported with where it was made.
"""

from __future__ import annotations

import gc
import socket
from typing import Any

import pytest
import zmq

from tests import zmqleaks


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leak_in_a_cycle() -> zmq.Socket[Any]:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)  # LINGER -1: pyzmq's and libzmq's default
    push.connect(f"tcp://127.0.0.1:{_unused_port()}")
    push.send(b"never delivered")  # queued for the connection that never comes
    box: dict[str, Any] = {"ctx": ctx, "push": push}
    box["self"] = box  # reached by the cycle collector only, as asyncio's objects are
    return push


def test_a_context_leaked_in_a_cycle_is_termed_and_reported() -> None:
    push = _leak_in_a_cycle()
    assert not push.closed
    del push
    gc.collect()  # pyzmq's own finalizer would block here until pytest-timeout fired
    leaks, reported = zmqleaks.check()
    assert reported == []
    assert len(leaks) == 1, leaks
    assert "1 socket(s) open (PUSH)" in leaks[0]
    assert "still blocked" not in leaks[0]  # termed, not left hanging in its thread
    assert "test_a_context_leaked_in_a_cycle_is_termed_and_reported (call)" in leaks[0]
    assert "in _leak_in_a_cycle" in leaks[0]  # the stack where it was made


def test_a_closed_context_is_no_leak() -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{_unused_port()}")
    push.send(b"never delivered")
    ctx.destroy(linger=0)
    del ctx, push
    gc.collect()
    assert zmqleaks.check() == ([], [])


def test_a_leak_by_a_failed_test_is_reported_not_failed(request: pytest.FixtureRequest) -> None:
    # As if this test had failed already: its leak is not blamed on the next test.
    zmqleaks.failed(request.node.nodeid)
    try:
        _leak_in_a_cycle()
        gc.collect()
        leaks, reported = zmqleaks.check()
    finally:
        zmqleaks.forget_failed(request.node.nodeid)
    assert leaks == []
    assert len(reported) == 1 and "(PUSH)" in reported[0]
