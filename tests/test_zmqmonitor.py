"""Refused ZeroMQ handshakes counted from monitor events (taproom/zmqmonitor.py)."""

from __future__ import annotations

import zmq

from taproom.zmqmonitor import HandshakeTracker

ACCEPTED, DISCONNECTED = zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED
SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED


def _refusals(events: list[tuple[int, int]]) -> int:
    tracker = HandshakeTracker()
    return sum(bool(tracker.event(kind, value)) for kind, value in events)


def test_a_peer_that_closes_before_its_handshake_is_refused() -> None:
    # what libzmq 4.3 reports for a PUSH on a ROUTER: accepted, then disconnected
    assert _refusals([(ACCEPTED, 7), (DISCONNECTED, 7)]) == 1


def test_a_peer_that_shook_hands_and_left_is_not() -> None:
    assert _refusals([(ACCEPTED, 7), (SUCCEEDED, 0), (DISCONNECTED, 7)]) == 0


def test_interleaved_good_and_bad_peers_and_reused_descriptors() -> None:
    events = [
        (ACCEPTED, 7),  # good
        (ACCEPTED, 8),  # refused
        (SUCCEEDED, 0),
        (DISCONNECTED, 8),
        (ACCEPTED, 8),  # the refused peer reconnects on the same descriptor
        (DISCONNECTED, 8),
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0),  # a garbage greeting on a third
        (DISCONNECTED, 7),
    ]
    assert _refusals(events) == 3
