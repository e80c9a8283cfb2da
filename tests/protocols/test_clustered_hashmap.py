"""What the two CHP speakers share (protocols/clustered_hashmap.py), and what they do not: the
sequence frame (the Guide's kvmsg: big-endian u64; nasa/lager's registrar: host-order double)."""

from __future__ import annotations

import struct

import pytest

from taproom.protocols import clustered_hashmap
from taproom.protocols.eventbus import EventBusError, Limits, kvmsg
from taproom.protocols.lager import chp as lager_chp


def test_both_use_the_same_words_and_snapshot_request() -> None:
    assert kvmsg.ICANHAZ == lager_chp.ICANHAZ == b"ICANHAZ?"
    assert kvmsg.KTHXBAI == lager_chp.KTHXBAI == b"KTHXBAI"
    assert kvmsg.HUGZ == lager_chp.HUGZ == b"HUGZ"
    request = [b"ICANHAZ?", b"/client/"]
    assert clustered_hashmap.snapshot_subtree(request) == b"/client/"
    assert kvmsg.parse_icanhaz(request, Limits()) == b"/client/"
    assert lager_chp.parse_snapshot_request(request) == "/client/"
    assert clustered_hashmap.snapshot_subtree([b"ICANHAZ?"]) == b""
    for bad in ([b"SYNCSTART", b""], [b"ICANHAZ?", b"", b""], []):
        assert clustered_hashmap.snapshot_subtree(bad) is None
        with pytest.raises(EventBusError):
            kvmsg.parse_icanhaz(bad, Limits())
        with pytest.raises(lager_chp.ChpError):
            lager_chp.parse_snapshot_request(bad)


def test_each_keeps_its_own_sequence_encoding() -> None:
    # The ØMQ Guide's kvmsg: network order integer.
    guide_end = kvmsg.kthxbai_frames(129, b"")
    assert len(guide_end) == clustered_hashmap.FRAMES
    assert guide_end[1] == struct.pack(">Q", 129) == b"\x00" * 7 + b"\x81"
    # nasa/lager's registrar: a C++ double, host byte order.
    lager_end = lager_chp.kthxbai_frames(129)
    assert len(lager_end) == clustered_hashmap.FRAMES
    assert lager_end[1] == struct.pack("=d", 129.0)
    assert guide_end[1] != lager_end[1]
    assert kvmsg.parse_kvmsg(guide_end).sequence == 129
    assert lager_chp.decode_sequence(lager_end[1]) == 129
