"""Event BUS codec (seeds/event-bus.txt) and the Binary Star state machine, without sockets."""

from __future__ import annotations

import struct
import uuid

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.eventtime import MAX_NS, EventTimes
from taproom.protocols.eventbus import (
    BinaryStar,
    BStarState,
    Event,
    EventBusError,
    Heartbeat,
    Limits,
    SyncEnd,
    SyncStart,
    broadcast_frames,
    hugz_frames,
    kvmsg,
    matches,
    parse_broadcast,
    parse_pub,
    parse_replicate,
    parse_replicated,
    parse_snapshot_reply,
    parse_subtrees,
    parse_syncstart,
    parse_timestamp,
    pub_frames,
    replicate_frames,
    replicated_frames,
    sync_frames,
    syncend_frames,
    syncstart_frames,
)
from tests.support import fuzz_examples

UUID = "0b7e5c1e-3f0a-4c51-9a57-2d5c3b1e8f00"
TS = "2026-11-22T08:00:00.123456+00:00"
DATA = msgpack.packb({"price": 1.5, "qty": 3})


def _frames(**over: bytes) -> list[bytes]:
    base = {
        "topic": b"/orders/eu/1",
        "seq": struct.pack(">Q", 7),
        "producer": b"prod-1",
        "ts": TS.encode(),
        "uuid": UUID.encode(),
        "data": DATA,
    }
    base.update(over)
    return list(base.values())


class TestServerToClientUpdates:
    """Seed: "Server-to-Client Updates" (BROADCAST) and "Client-to-Server Updates" (PUB)."""

    def test_pub_parses_every_frame(self) -> None:
        event = parse_pub(_frames())
        assert event.topic == "/orders/eu/1"
        assert event.sequence == 7
        assert event.producer == "prod-1"
        assert event.timestamp == TS
        assert event.uuid == UUID
        assert msgpack.unpackb(event.data) == {"price": 1.5, "qty": 3}
        assert event.ts_ns == 1795334400123456000

    def test_broadcast_round_trip(self) -> None:
        event = Event("/a/b", 2**40 + 3, "p", TS, UUID, DATA, parse_timestamp(TS))
        frames = broadcast_frames(event)
        assert len(frames) == 6
        assert frames[1] == struct.pack(">Q", 2**40 + 3)
        assert parse_broadcast(frames) == event

    def test_hugz_round_trip(self) -> None:
        frames = hugz_frames(42, "taproom", TS, UUID, BStarState.PASSIVE, True)
        assert frames[0] == b"HUGZ"
        beat = parse_broadcast(frames)
        assert beat == Heartbeat(42, "taproom", TS, int(BStarState.PASSIVE), True)

    def test_pub_round_trip(self) -> None:
        event = Event("/a/b", 0, "p", TS, UUID, DATA, parse_timestamp(TS))
        frames = pub_frames(event)
        assert frames == _frames(topic=b"/a/b", seq=b"\x00" * 8, producer=b"p")
        assert parse_pub(frames) == event

    def test_uuid_is_normalised_to_lower_case(self) -> None:
        assert parse_pub(_frames(uuid=UUID.upper().encode())).uuid == UUID


class TestStateSynchronization:
    """Seed: "State Synchronization" (SYNCSTART, SYNC, SYNCEND)."""

    def test_syncstart_round_trip(self) -> None:
        frames = syncstart_frames(("/a/", "/b/c/"), 99)
        assert frames == [b"SYNCSTART", b"/a/;/b/c/", struct.pack(">Q", 99)]
        assert parse_syncstart(frames) == SyncStart(("/a/", "/b/c/"), 99)

    def test_syncstart_empty_subtree_means_everything(self) -> None:
        request = parse_syncstart([b"SYNCSTART", b"", struct.pack(">Q", 0)])
        assert request == SyncStart((), 0)
        assert matches("/anything", request.subtrees)

    def test_comma_separator_and_two_frame_form(self) -> None:
        # micro-toolkit joins subtrees with ','; the seed's prose says "two frames".
        assert parse_syncstart([b"SYNCSTART", b"/a/,/b/"]) == SyncStart(("/a/", "/b/"), 0)

    def test_decimal_text_sequence_is_accepted(self) -> None:
        assert parse_syncstart([b"SYNCSTART", b"/a/", b"1234"]).sequence == 1234

    def test_sync_and_syncend_round_trip(self) -> None:
        event = Event("/a/b", 5, "p", TS, UUID, DATA, parse_timestamp(TS))
        assert parse_snapshot_reply(sync_frames(event)) == event
        end = syncend_frames(("/a/",), 5)
        assert end[0] == b"SYNCEND"
        assert parse_snapshot_reply(end) == SyncEnd(("/a/",), 5)

    def test_subtree_matching_is_a_prefix_match(self) -> None:
        assert matches("/a/b/c", ("/x/", "/a/b/"))
        assert not matches("/a/bc", ("/a/b/",))


class TestMalformedCommands:
    """Every malformed command raises EventBusError with the documented reason."""

    @pytest.mark.parametrize(
        ("frames", "reason"),
        [
            (_frames()[:5], "frame_count"),
            ([*_frames(), b"extra"], "frame_count"),
            (_frames(topic=b"orders"), "bad_topic"),
            (_frames(topic=b"/\xff\xfe"), "bad_topic"),
            (_frames(topic=b"/" + b"x" * 2000), "too_large"),
            (_frames(seq=b"\x00\x01\x02"), "bad_sequence"),
            (_frames(seq=b"12a"), "bad_sequence"),
            (_frames(producer=b"\xc3\x28"), "bad_producer"),
            (_frames(ts=b"yesterday"), "bad_timestamp"),
            (_frames(ts=b"2026-11-22"), "bad_timestamp"),
            (_frames(ts=b"2026-13-40T00:00:00Z"), "bad_timestamp"),
            (_frames(ts="2026-11-22T08:00:00\u00e9".encode()), "bad_timestamp"),
            (_frames(uuid=str(uuid.uuid1()).encode()), "bad_uuid"),
            (_frames(uuid=UUID.replace("-", "").encode()), "bad_uuid"),
            (_frames(uuid=b"not-a-uuid"), "bad_uuid"),
            (_frames(data=b"\x92\x01"), "bad_msgpack"),
            (_frames(data=DATA + b"\x01"), "bad_msgpack"),
            (_frames(data=b"\xc1"), "bad_msgpack"),
        ],
    )
    def test_pub(self, frames: list[bytes], reason: str) -> None:
        with pytest.raises(EventBusError) as info:
            parse_pub(frames)
        assert info.value.reason == reason
        assert info.value.reply is None  # the bus has no error reply: drop and count

    def test_data_over_the_limit(self) -> None:
        with pytest.raises(EventBusError) as info:
            parse_pub(_frames(data=msgpack.packb(b"x" * 100)), Limits(max_data_bytes=64))
        assert info.value.reason == "too_large"

    @pytest.mark.parametrize(
        ("frames", "reason"),
        [
            ([b"SYNCSTART"], "frame_count"),
            ([b"SYNCSTART", b"", b"\x00" * 8, b""], "frame_count"),
            ([b"SYNCSTARX", b"", b"\x00" * 8], "bad_command"),
            ([b"SYNCSTART", b"a/", b"\x00" * 8], "bad_subtree"),
            ([b"SYNCSTART", b"/a/;b/", b"\x00" * 8], "bad_subtree"),
            ([b"SYNCSTART", b"/a/", b"\x00\x01"], "bad_sequence"),
        ],
    )
    def test_syncstart(self, frames: list[bytes], reason: str) -> None:
        with pytest.raises(EventBusError) as info:
            parse_syncstart(frames)
        assert info.value.reason == reason

    def test_too_many_subtrees(self) -> None:
        with pytest.raises(EventBusError) as info:
            parse_subtrees(b";".join(b"/a%d/" % i for i in range(5)), Limits(max_subtrees=4))
        assert info.value.reason == "too_large"

    def test_snapshot_reply_errors(self) -> None:
        for frames, reason in [
            ([], "frame_count"),
            ([b"HELLO"], "bad_command"),
            ([b"SYNCEND", b""], "frame_count"),
            ([b"SYNC", *_frames()[:4]], "frame_count"),
        ]:
            with pytest.raises(EventBusError) as info:
                parse_snapshot_reply(frames)
            assert info.value.reason == reason

    def test_broadcast_sequence_must_be_present(self) -> None:
        with pytest.raises(EventBusError) as info:
            parse_broadcast(_frames(seq=b""))
        assert info.value.reason == "bad_sequence"


class TestCompatibility:
    """Forms real peers send (docs/protocols/eventbus.md, "Compatibility")."""

    def test_pub_sequence_may_be_empty_or_decimal(self) -> None:
        assert parse_pub(_frames(seq=b"")).sequence == 0
        assert parse_pub(_frames(seq=b"17")).sequence == 17

    def test_eight_ascii_digits_are_a_decimal_sequence(self) -> None:
        # Issue 16 defect 5: "00000001" as big-endian u64 is 0x3030303030303031 (3.5e18), far
        # above any real sequence; real peers that write 8 decimal digits mean 1.
        assert parse_syncstart([b"SYNCSTART", b"", b"00000001"]).sequence == 1
        assert parse_syncstart([b"SYNCSTART", b"", b"12345678"]).sequence == 12345678
        assert parse_pub(_frames(seq=b"00000042")).sequence == 42
        assert parse_syncstart([b"SYNCSTART", b"", struct.pack(">Q", 7)]).sequence == 7

    def test_empty_data_is_nil(self) -> None:
        assert parse_pub(_frames(data=b"")).data == b"\xc0"

    def test_empty_data_from_the_server_is_a_deletion(self) -> None:
        assert parse_broadcast(_frames(data=b"")).data == b""
        assert parse_snapshot_reply([b"SYNC", *_frames(data=b"")]).data == b""

    def test_javascript_and_naive_timestamps(self) -> None:
        js = parse_pub(_frames(ts=b"2026-11-22T08:00:00.123Z"))
        assert js.ts_ns == 1795334400123000000
        naive = parse_pub(_frames(ts=b"2026-11-22T08:00:00.123"))
        assert naive.ts_ns == js.ts_ns

    @pytest.mark.parametrize(
        "ts", [b"2426-01-01T00:00:00Z", b"0001-01-01T00:00:00Z", b"9999-12-31T23:59:59.999999"]
    )
    def test_a_timestamp_the_journal_cannot_hold_is_kept_with_no_time(self, ts: bytes) -> None:
        """Issue 25: years 1..9999 parse, but only 1677..2262 fit the journal's i64 ns. The
        event is valid (the seed's frame is a date-time); its time is absent and counted."""
        times = EventTimes()
        event = parse_pub(_frames(ts=ts), Limits(), times)
        assert event.ts_ns == 0 and event.timestamp == ts.decode()
        assert times.take() == 1 and times.take() == 0
        assert parse_pub(_frames(ts=b"2262-04-11T23:47:16Z"), Limits(), times).ts_ns > 0
        assert times.take() == 0


class TestReplication:
    def test_round_trip(self) -> None:
        events = [Event(f"/t/{i}", 10 + i, "p", TS, UUID, DATA, 5) for i in range(3)]
        assert parse_replicate(replicate_frames(events)) == events
        assert parse_replicated(replicated_frames(12)) == 12

    def test_out_of_order_rows_are_refused(self) -> None:
        events = [Event("/t", s, "p", TS, UUID, DATA, 5) for s in (3, 2)]
        with pytest.raises(EventBusError):
            parse_replicate(replicate_frames(events))

    def test_garbage(self) -> None:
        for frames in ([b"REPLICATE", b"\xc1"], [b"REPLICATE", msgpack.packb([[1, 2]])], [b"X"]):
            with pytest.raises(EventBusError):
                parse_replicate(frames)
        with pytest.raises(EventBusError):
            parse_replicated([b"REPLICATED", b"\x01"])


class TestBinaryStar:
    """zguide bstar: never two actives; a passive takes over only if the peer is silent and a
    client asks."""

    def test_primary_and_backup_settle_active_passive(self) -> None:
        primary = BinaryStar("primary", 1.0, now=0.0)
        backup = BinaryStar("backup", 1.0, now=0.0)
        assert primary.on_peer(backup.state, 0.1) is BStarState.ACTIVE
        assert backup.on_peer(primary.state, 0.1) is BStarState.PASSIVE
        assert primary.on_client_request(0.2)
        assert not backup.on_client_request(0.2)

    def test_passive_takes_over_only_when_peer_silent_and_asked(self) -> None:
        backup = BinaryStar("backup", 1.0, now=0.0)
        backup.on_peer(BStarState.ACTIVE, 5.0)
        assert not backup.on_client_request(5.5)  # peer heard 0.5 s ago
        assert backup.state is BStarState.PASSIVE
        assert backup.state is BStarState.PASSIVE  # silence alone changes nothing
        assert backup.on_client_request(6.1)
        assert backup.state is BStarState.ACTIVE

    def test_backup_never_serves_before_hearing_an_active_primary(self) -> None:
        backup = BinaryStar("backup", 1.0, now=0.0)
        assert not backup.on_client_request(100.0)

    def test_restarted_primary_goes_passive_behind_active_backup(self) -> None:
        primary = BinaryStar("primary", 1.0, now=0.0)
        assert not primary.on_client_request(0.5)  # waits one peer timeout first
        assert primary.on_peer(BStarState.ACTIVE, 0.6) is BStarState.PASSIVE

    def test_lone_primary_serves_after_peer_timeout(self) -> None:
        primary = BinaryStar("primary", 1.0, now=0.0)
        assert primary.on_client_request(1.5)
        assert primary.state is BStarState.ACTIVE

    def test_dual_active_makes_the_backup_step_down(self) -> None:
        backup = BinaryStar("backup", 1.0, now=0.0)
        backup.on_peer(BStarState.ACTIVE, 0.0)
        backup.on_client_request(2.0)
        assert backup.on_peer(BStarState.ACTIVE, 2.1) is BStarState.PASSIVE
        assert backup.problem == "dual actives"
        primary = BinaryStar("primary", 1.0, now=0.0)
        primary.on_peer(BStarState.BACKUP, 0.0)
        assert primary.on_peer(BStarState.ACTIVE, 0.1) is BStarState.ACTIVE

    def test_standalone_is_always_active(self) -> None:
        alone = BinaryStar("standalone", 1.0, now=0.0)
        assert alone.on_client_request(0.0)
        assert alone.on_peer(BStarState.ACTIVE, 0.0) is BStarState.ACTIVE


class TestKvmsg:
    """The Guide's Clone wire (CHP): kvmsg frames, properties, ICANHAZ?/KTHXBAI/HUGZ."""

    UUID16 = uuid.UUID(UUID).bytes

    def _update(self, **over: bytes) -> list[bytes]:
        base = {
            "key": b"/client/42",
            "seq": bytes(8),
            "uuid": self.UUID16,
            "props": b"ttl=5\ncolour=blue\n",
            "body": b"417503",
        }
        base.update(over)
        return list(base.values())

    def test_update_maps_onto_the_event_fields(self) -> None:
        update = kvmsg.parse_update(self._update(), Limits())
        assert (update.topic, update.uuid, update.body) == ("/client/42", UUID, b"417503")
        assert update.ttl_ms == 5000 and update.timestamp is None and update.producer == ""
        assert update.properties == b"ttl=5\ncolour=blue\n"

    def test_producer_and_timestamp_properties_become_the_seed_fields(self) -> None:
        props = b"producer=clonecli\ntimestamp=" + TS.encode() + b"\nx=a=b"  # no final \n
        update = kvmsg.parse_update(self._update(props=props), Limits())
        assert (update.producer, update.timestamp) == ("clonecli", TS)
        assert update.ts_ns == parse_timestamp(TS)
        assert update.properties == b"x=a=b\n"  # the value runs to the end of its line
        assert update.ttl_ms == 0
        sent = kvmsg.update_properties(b"clonecli", TS.encode(), update.properties)
        assert kvmsg.parse_properties(sent, Limits()) == [
            ("producer", "clonecli"),
            ("timestamp", TS),
            ("x", "a=b"),
        ]

    def test_empty_body_is_kept_it_means_delete(self) -> None:
        assert kvmsg.parse_update(self._update(body=b""), Limits()).body == b""

    @pytest.mark.parametrize(
        ("over", "reason"),
        [
            ({"key": b"client/1"}, "bad_topic"),  # keys start with '/' as topics do
            ({"key": b"HUGZ"}, "bad_topic"),
            ({"key": b"/\xff"}, "bad_topic"),
            ({"key": b"/" + b"k" * 1024}, "too_large"),
            ({"seq": b"\x00" * 4}, "bad_sequence"),
            ({"uuid": UUID.encode()}, "bad_uuid"),  # text, not the 16 raw bytes
            ({"uuid": b"\x01" * 15}, "bad_uuid"),
            ({"uuid": uuid.uuid1().bytes}, "bad_uuid"),
            ({"props": b"no equals sign\n"}, "bad_properties"),
            ({"props": b"=value\n"}, "bad_properties"),
            ({"props": b"a=\xff\n"}, "bad_properties"),
            ({"props": b"p=" + b"x" * 5000}, "too_large"),
            ({"props": b"ttl=soon\n"}, "bad_ttl"),
            ({"props": b"ttl=-1\n"}, "bad_ttl"),
            ({"props": b"timestamp=yesterday\n"}, "bad_timestamp"),
            ({"props": b"producer=" + b"p" * 300 + b"\n"}, "bad_producer"),
            ({"body": b"x" * (1024 * 1024 + 1)}, "too_large"),
        ],
    )
    def test_malformed_updates(self, over: dict[str, bytes], reason: str) -> None:
        with pytest.raises(EventBusError) as info:
            kvmsg.parse_update(self._update(**over), Limits())
        assert info.value.reason == reason

    def test_an_empty_uuid_is_taken_for_the_server_to_fill(self) -> None:
        """The Guide's C clonecli5 sends an empty uuid frame (its clonesrv5 publishes such
        updates): parsed with an empty uuid, which the server replaces with one of its own."""
        update = kvmsg.parse_update(self._update(uuid=b""), Limits())
        assert update.uuid == "" and update.topic == "/client/42"

    def test_a_timestamp_the_journal_cannot_hold_is_absent_and_counted(self) -> None:
        times = EventTimes()
        props = b"timestamp=2426-01-01T00:00:00Z\n"
        update = kvmsg.parse_update(self._update(props=props), Limits(), times)
        assert update.ts_ns == 0 and update.timestamp == "2426-01-01T00:00:00Z"
        assert times.take() == 1

    def test_frame_count(self) -> None:
        for frames in (self._update()[:4], [*self._update(), b"extra"]):
            with pytest.raises(EventBusError) as info:
                kvmsg.parse_update(frames, Limits())
            assert info.value.reason == "frame_count"

    def test_icanhaz_and_the_replies(self) -> None:
        assert kvmsg.parse_icanhaz([b"ICANHAZ?", b"/client/"], Limits()) == b"/client/"
        assert kvmsg.parse_icanhaz([b"ICANHAZ?"], Limits()) == b""
        for bad in ([b"SYNCSTART", b""], [b"ICANHAZ?", b"", b""], []):
            with pytest.raises(EventBusError):
                kvmsg.parse_icanhaz(bad, Limits())
        end = kvmsg.parse_kvmsg(kvmsg.kthxbai_frames(9, b"/client/"))
        assert (end.key, end.sequence, end.body) == (b"KTHXBAI", 9, b"/client/")
        beat = kvmsg.parse_kvmsg(kvmsg.hugz_frames(12))
        assert (beat.key, beat.sequence, beat.uuid, beat.properties, beat.body) == (
            b"HUGZ",
            12,
            b"",
            b"",
            b"",
        )


class TestReplicationOfChpFields:
    def test_properties_body_and_expiry_travel_between_servers(self) -> None:
        event = Event("/k", 4, "p", TS, UUID, msgpack.packb(b"raw"), 5, (b"ttl=1\n", b"raw"), 9)
        deletion = Event("/k", 5, "p", TS, UUID, b"", 5, (b"", b""), 0)
        assert parse_replicate(replicate_frames([event, deletion])) == [event, deletion]


# --- properties ----------------------------------------------------------------------------

_json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=fuzz_examples(500, 100_000))
@given(
    topic=st.text(min_size=0, max_size=40).map(lambda t: "/" + t),
    seq=st.integers(0, 2**64 - 1),
    producer=st.text(max_size=30),
    value=_json_like,
    ts_ns=st.integers(0, 253402300799),
    event_uuid=st.uuids(version=4),
)
def test_valid_events_round_trip(
    topic: str, seq: int, producer: str, value: object, ts_ns: int, event_uuid: uuid.UUID
) -> None:
    from datetime import UTC, datetime

    timestamp = datetime.fromtimestamp(ts_ns, UTC).isoformat()
    data = msgpack.packb(value)
    # Past 2262 the date is still valid, but the journal cannot hold its time: absent (0).
    expected_ns = ts_ns * 10**9 if ts_ns * 10**9 <= MAX_NS else 0
    event = Event(topic, seq, producer, timestamp, str(event_uuid), data, expected_ns)
    assert parse_broadcast(broadcast_frames(event)) == event
    assert parse_snapshot_reply(sync_frames(event)) == event


_PREFIXES = [b"SYNCSTART", b"SYNC", b"SYNCEND", b"HUGZ", b"REPLICATE", b"/a/"]


def _frames_from_blob(blob: bytes) -> list[bytes]:
    """One cheap binary draw -> a frame list: split raw, a mutated valid PUB, or a command."""
    if not blob:
        return []
    mode, rest = blob[0] % 3, blob[1:]
    if mode == 0:
        return rest.split(b"\x00")
    if mode == 1 and rest:
        index = rest[0] % 6
        frames = _frames()
        frames[index] = rest[1:] if rest[0] < 128 else frames[index][: rest[0] % 12]
        return frames
    prefix = _PREFIXES[rest[0] % len(_PREFIXES)] if rest else b""
    return [prefix, *rest[1:].split(b"\x00")]


@settings(max_examples=fuzz_examples(20_000, 200_000))
@given(frames=st.binary(max_size=160).map(_frames_from_blob))
def test_random_frames_give_a_command_or_a_documented_error(frames: list[bytes]) -> None:
    for parse in (parse_pub, parse_broadcast, parse_syncstart, parse_snapshot_reply):
        try:
            parse(frames)
        except EventBusError as exc:
            assert exc.reason in {
                "frame_count",
                "bad_command",
                "bad_topic",
                "bad_sequence",
                "bad_producer",
                "bad_timestamp",
                "bad_uuid",
                "bad_msgpack",
                "bad_subtree",
                "too_large",
            }
    try:
        kvmsg.parse_update(frames, Limits())
    except EventBusError as exc:
        assert exc.reason in {
            "frame_count",
            "bad_sequence",
            "bad_topic",
            "too_large",
            "bad_uuid",
            "bad_properties",
            "bad_producer",
            "bad_timestamp",
            "bad_ttl",
        }
