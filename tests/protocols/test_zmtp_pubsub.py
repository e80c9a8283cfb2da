"""protocols/zmtp/pubsub: subscriptions in both ZMTP forms, a subscriber's prefix set, and
bursts encoded once and selected per filter (against a per-message reference)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taproom.protocols import zmtp as zp
from taproom.protocols.zmtp.pubsub import (
    Burst,
    Filter,
    Subscription,
    command_subscription,
    message_subscription,
    seal_messages,
)

frames = st.binary(max_size=300)
messages = st.lists(st.lists(frames, min_size=1, max_size=4), max_size=20)
prefixes = st.lists(st.binary(max_size=3), max_size=4)


class TestSubscriptionForms:
    def test_zmtp_3_0_messages(self):
        assert message_subscription(b"\x01abc") == Subscription(b"abc", True)
        assert message_subscription(b"\x00abc") == Subscription(b"abc", False)
        assert message_subscription(b"\x01") == Subscription(b"", True)
        assert message_subscription(b"") is None
        assert message_subscription(b"\x02abc") is None  # not a subscription

    def test_zmtp_3_1_commands(self):
        sub = zp.subscribe_message(b"abc", 1)
        cancel = zp.subscribe_message(b"abc", 1, cancel=True)
        # the frame's body: after the flags and the short size
        assert command_subscription(sub[2:]) == Subscription(b"abc", True)
        assert command_subscription(cancel[2:]) == Subscription(b"abc", False)
        assert command_subscription(zp.ping_command(10, b"x")[2:]) is None
        with pytest.raises(zp.ZmtpError):
            command_subscription(b"\x09SUB")  # a name longer than the body


class TestFilter:
    def test_a_set_per_subscriber(self):
        f = Filter(max_prefixes=8)
        assert f.apply(Subscription(b"b", True)) and f.apply(Subscription(b"a", True))
        assert not f.apply(Subscription(b"a", True))  # again: no change
        assert f.key == (b"a", b"b")
        assert f.takes(b"apple") and f.takes(b"banana") and not f.takes(b"cherry")
        assert f.apply(Subscription(b"a", False))  # one cancel is enough
        assert not f.apply(Subscription(b"a", False))
        assert f.key == (b"b",)
        f.apply(Subscription(b"", True))
        assert f.key == (b"",) and f.takes(b"cherry")

    def test_bounded(self):
        f = Filter(max_prefixes=2)
        f.apply(Subscription(b"a", True))
        f.apply(Subscription(b"b", True))
        with pytest.raises(zp.ZmtpError) as caught:
            f.apply(Subscription(b"c", True))
        assert caught.value.reason == "too_many_subscriptions"
        f.apply(Subscription(b"a", False))
        f.apply(Subscription(b"c", True))  # room again
        assert Filter(1).key == () and not Filter(1).takes(b"")


class TestBurst:
    @given(messages)
    def test_encoded_once_as_every_message_alone(self, msgs):
        burst = Burst.encode(msgs)
        assert burst.wire == b"".join(zp.encode_message(m) for m in msgs)
        assert len(burst) == len(msgs)
        for i, m in enumerate(msgs):
            assert burst.frames(i) == m
            assert burst.topics[i] == m[0]
            assert burst.wire[burst.start(i) : burst.ends[i]] == zp.encode_message(m)
            assert burst.count_before(burst.ends[i]) == i + 1
            assert burst.count_before(burst.ends[i] - 1) == i

    @given(messages, prefixes)
    def test_selection_is_what_the_filter_takes(self, msgs, keys):
        burst = Burst.encode(msgs)
        f = Filter(16)
        for key in keys:
            f.apply(Subscription(key, True))
        wanted = [m for m in msgs if f.takes(m[0])]
        selected = burst.select(f.key)
        if not wanted:
            assert selected is None
        elif len(wanted) == len(msgs):
            assert selected is burst  # the same bytes object for every such subscriber
        else:
            assert selected is not None
            assert selected.wire == Burst.encode(wanted).wire
            assert list(selected.ends) == list(Burst.encode(wanted).ends)

    @given(messages)
    def test_sealed_per_frame(self, msgs):
        burst = Burst.encode(msgs)
        if not msgs:
            return
        sealed, ends = seal_messages(
            burst.wire, 0, burst.ends, lambda flags, body: bytes((flags,)) + body[::-1] + b"|"
        )
        expected = []
        for m in msgs:
            for i, frame in enumerate(m):
                expected.append(bytes((1 if i < len(m) - 1 else 0,)) + frame[::-1] + b"|")
        assert sealed == b"".join(expected)
        per_message = [sum(len(f) + 2 for f in m) for m in msgs]
        assert ends == [sum(per_message[: i + 1]) for i in range(len(msgs))]
