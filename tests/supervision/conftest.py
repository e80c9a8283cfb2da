"""Fixtures shared by the supervision tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    """A ZeroMQ context whose sockets close at once, destroyed after the test."""
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)
    yield context
    context.destroy(0)
