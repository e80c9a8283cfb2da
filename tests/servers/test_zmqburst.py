"""taproom.zmqburst: the compiled burst module and its pure-Python twin, over real ZeroMQ.

The readers of both paths give the same messages as pyzmq frame by frame (every frame count,
frames past the bound dropped, byte and count budgets, messages bigger than the buffer); the
compiled JSON check never calls valid what orjson refuses; and the compiled logjam ingest
(``lj_build``) makes byte-identical batches, rejections and replies to the pure-Python path on
fuzzed bursts.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import subprocess
import sys
import time

import orjson
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom import zmqburst
from taproom.protocols import logjam as lj
from taproom.servers.logjam import ingest as ingest_mod
from taproom.servers.logjam.zmqio import MAX_FRAMES
from taproom.servers.zmtp import ZmtpSocket
from tests.protocols.test_logjam import BODY, _frames_from
from tests.servers.test_logjam import QUIET, sample
from tests.support import fuzz_examples, running_app


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def pair(ctx, kind_in=zmq.PULL, kind_out=zmq.PUSH, name="pair"):
    receiver = ctx.socket(kind_in)
    receiver.bind(f"inproc://{name}")
    sender = ctx.socket(kind_out)
    sender.connect(f"inproc://{name}")
    return sender, receiver


def drain(reader, expected, max_messages=1000, max_bytes=1 << 30):
    """Bursts until ``expected`` messages came: [(count, frames)], and the burst sizes."""
    got, sizes = [], []
    deadline = time.monotonic() + 10
    while len(got) < expected:
        assert time.monotonic() < deadline, f"only {len(got)} of {expected} messages"
        burst = reader.recv(max_messages, max_bytes)
        assert len(burst.counts()) == burst.n
        via_index = [(c, burst.frames(i)) for i, c in enumerate(burst.counts())]
        assert list(burst.messages()) == via_index
        assert burst.size == sum(len(f) for _, frames in via_index for f in frames)
        got += via_index
        if burst.n:
            sizes.append(burst.n)
    return got, sizes


@pytest.mark.usefixtures("zmq_path")
def test_reader_gives_every_frame_count_and_drops_past_the_bound(ctx):
    push, pull = pair(ctx)
    shapes = [1, 4, 2, 6, 7, 4, 9, 3, 16, 17, 5]
    sent = [[b"m%d-f%d" % (k, j) * (j + 1) for j in range(n)] for k, n in enumerate(shapes)]
    for message in sent:
        push.send_multipart(message)
    got, _ = drain(zmqburst.reader(pull, MAX_FRAMES), len(sent))
    assert got == [(len(m), m[:MAX_FRAMES]) for m in sent]


@pytest.mark.usefixtures("zmq_path")
def test_reader_budgets_end_a_burst_and_the_rest_comes_next(ctx):
    push, pull = pair(ctx)
    sent = [[b"a" * 100, b"%03d" % k] for k in range(50)]  # 103 bytes each
    for message in sent:
        push.send_multipart(message)
    reader = zmqburst.reader(pull, 4)
    # count budget: 7 messages a burst
    got, sizes = drain(reader, 21, max_messages=7)
    assert sizes == [7, 7, 7]
    # byte budget: a burst ends with the message that reaches 350 bytes (the fourth here)
    more, sizes = drain(reader, 29, max_bytes=350)
    assert sizes[:7] == [4] * 7
    assert got + more == [(2, m) for m in sent]


@pytest.mark.usefixtures("zmq_path")
def test_drain_reads_bursts_while_ready_within_its_budgets(ctx):
    """zmqburst.drain: one batch from several bursts (here each 600 KB message is a burst of
    its own), stopped by the count and byte budgets across bursts, empty when none is ready."""
    push, pull = pair(ctx)
    big = [[os.urandom(600_000), b"%d" % k] for k in range(4)]
    small = [[b"a" * 100, b"%03d" % k] for k in range(20)]  # 103 bytes each
    for message in big + small:
        push.send_multipart(message)
    reader = zmqburst.reader(pull, 4)
    assert list(zmqburst.drain(reader, 5, 1 << 30, 60)) == [(2, m) for m in big + small[:1]]
    assert list(zmqburst.drain(reader, 100, 350, 60)) == [(2, m) for m in small[1:5]]
    assert list(zmqburst.drain(reader, 100, 1 << 30, 60)) == [(2, m) for m in small[5:]]
    assert list(zmqburst.drain(reader, 100, 1 << 30, 60)) == []


@pytest.mark.usefixtures("zmq_path")
def test_reader_takes_messages_bigger_than_its_buffer_in_order(ctx):
    """A message over the reader's buffer (1 MiB to start) grows it for that burst; one that
    does not fit behind others waits for the next call, never lost or reordered."""
    push, pull = pair(ctx)
    big = os.urandom(3 << 20)
    sent = [[b"small-1"], [b"x", big, b"y"], [b"small-2"], [big[:900_000]], [big[:900_000]]]
    for message in sent:
        push.send_multipart(message)
    got, _ = drain(zmqburst.reader(pull, 4), len(sent))
    assert got == [(len(m), m) for m in sent]


@pytest.mark.usefixtures("zmq_path")
def test_reader_keeps_lager_rows_of_1028_frames(ctx):
    """nasa/lager rows are one frame per item: the forwarder keeps up to 1028 frames a message
    (a reader limited to 16 could not even be made for it)."""
    push, pull = pair(ctx)
    sent = [[b"%d" % j for j in range(n)] for n in (1028, 1029, 5, 1028)]
    for message in sent:
        push.send_multipart(message)
    got, _ = drain(zmqburst.reader(pull, 1028), len(sent), max_messages=8192)
    assert got == [(len(m), m[:1028]) for m in sent]


@pytest.mark.usefixtures("zmq_path")
def test_send_messages_skips_replies_to_peers_gone(ctx):
    dealer, router = pair(ctx, zmq.ROUTER, zmq.DEALER, "router")
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to an unknown peer fails, not drops
    dealer.send(b"hello")
    assert router.poll(5000)
    rid, _ = router.recv_multipart()
    sent = zmqburst.send_messages(
        router, [[rid, b"one", b"1"], [b"nobody", b"two"], [rid, b"three"]]
    )
    assert sent == 2
    assert [dealer.recv_multipart() for _ in range(2)] == [[b"one", b"1"], [b"three"]]
    assert not dealer.poll(100)


def test_compiled_module_is_built_and_bound():
    """`pip install` built the module and it found pyzmq's libzmq (CI proves the build)."""
    assert zmqburst.ext_status() == "compiled"


def test_taproom_no_ext_selects_the_python_path():
    env = dict(os.environ, TAPROOM_NO_EXT="1")
    out = subprocess.run(
        [sys.executable, "-c", "from taproom import zmqburst as z; print(z.ext_status())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "python (TAPROOM_NO_EXT is set)"


# --- the compiled JSON check ------------------------------------------------------------------


def _lib():
    ffi, lib = zmqburst._FFI, zmqburst._LIB
    assert lib is not None, zmqburst.ext_status()
    return ffi, lib


def _orjson_accepts(text: bytes) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


CERTAIN = [
    BODY,
    b"{}",
    b"[]",
    b" [1, -2, 3.5, 1e10, -0.0e-5, true, false, null] ",
    b'{"a":{"b":[{"c":"\\u00e9\\n\\"\\\\\\/"}]}}',
    '"caf\u00e9 \u2603 \U0001f600"'.encode(),
    b"0",
    b'"x"',
]
REFUSED_OR_UNSURE = [
    b"",
    b" ",
    b"{",
    b"[1,]",
    b"{,}",
    b'{"a"}',
    b"01",
    b"1.",
    b".5",
    b"-",
    b"NaN",
    b"Infinity",
    b"[1] x",
    b'"\xff"',
    b'"\xc0\x80"',  # overlong
    b'"\xed\xa0\x80"',  # an encoded surrogate
    b'"\\ud800"',  # a lone surrogate escape: orjson decides
    b'"\\ud83d\\ude00"',  # a pair: orjson decides too
    b'"a\x01"',
    b"\xef\xbb\xbf{}",  # BOM
    b"[" * 200 + b"]" * 200,  # deeper than the C check goes
    b"12345678901234567890",  # past 15 digits
    b"1e400",
    b"tru",
    b'{"a":1,}',
]


def test_json_check_agrees_on_known_texts():
    _, lib = _lib()
    for text in CERTAIN:
        assert _orjson_accepts(text), text
        assert lib.tb_json_valid(text, len(text)) == 1, text
    for text in REFUSED_OR_UNSURE:
        assert lib.tb_json_valid(text, len(text)) == 0, text


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=fuzz_examples(3000, 200_000), database=None)
@given(_json_values, st.binary(max_size=4), st.integers(0, 64), st.integers(0, 3))
def test_fuzz_json_check_never_calls_valid_what_orjson_refuses(value, noise, at, how):
    """Valid JSON, mutated at one place (a byte replaced, inserted or cut): where the C check
    says valid, orjson accepts; and unmutated texts whose numbers are short integers it calls
    valid (so the fast path is really taken)."""
    _, lib = _lib()
    text = orjson.dumps(value)
    if how == 1:
        text = text[:at] + noise + text[at + len(noise) :]
    elif how == 2:
        text = text[:at] + noise + text[at:]
    elif how == 3:
        text = text[:at]
    verdict = lib.tb_json_valid(text, len(text))
    if verdict:
        assert _orjson_accepts(text), text
    elif how == 0:
        # only the uncertain cases are left to orjson: floats' long digits, long integers
        assert not _short_numbers_only(value), text


def _short_numbers_only(value) -> bool:
    if isinstance(value, float):
        return False
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) < 10**15
    if isinstance(value, list):
        return all(_short_numbers_only(v) for v in value)
    if isinstance(value, dict):
        return all(_short_numbers_only(v) for v in value.values())
    return True


# --- the compiled logjam ingest against the pure-Python one -------------------------------------


# Messages in the usual shape, which the compiled path takes in C when the grammar takes their
# app-env and topic: JSON bodies and not, both meta sizes, created-ms past the i64 bound, big
# devices; app-envs and topics on either side of logjam-device's well_formed_stream_name and
# well_formed_topic (bytes 32..127 and a "-"; a prefix).
_usual_messages = st.builds(
    lambda app_env, topic, body, size, device, created, seq: [
        app_env,
        topic,
        body,
        lj.encode_meta(0, device if size == 24 else device & 0xFFFF, created, seq, size=size),
    ],
    st.sampled_from([b"app-prod", b"web2-prod", b"my app-", b"-\x7f", b"\xc3\xa4-x", b"a\x1f-b"]),
    st.sampled_from([b"logs", b"logs.a.b", b"logs/\xff x", b"mobile", b"Logs.x", b"frontend.pag"]),
    st.sampled_from(
        [BODY, b"{}", b"[1, 2.5e3]", b"nul", b'"\xff"', b"", b'"\\ud800"', b"x" * 1500]
    ),
    st.sampled_from([24, 22]),
    st.sampled_from([0, 7, 65535, 2**32 - 1]),
    st.sampled_from([0, 1_700_000_000_000, lj.MAX_CREATED_MS, lj.MAX_CREATED_MS + 1, 2**64 - 1]),
    st.integers(0, 2**64 - 1),
)


def _replies(sock, count, timeout_ms=10_000):
    """The ``count`` replies the ROUTER sent (waiting for each, a hang guard): a read that
    stopped at the first quiet 50 ms could leave one run's late replies to the next run on a
    loaded machine."""
    got = []
    for _ in range(count):
        assert sock.poll(timeout_ms), f"{len(got)} of {count} replies"
        got.append(sock.recv_multipart())
    return got


@pytest.mark.parametrize("grammar", lj.GRAMMARS)
async def test_fuzz_compiled_ingest_equals_python_ingest(tmp_path, grammar):
    """Bursts of fuzzed logjam messages (the protocol fuzz test's frames: bad metas,
    compression, pings, bad app-envs and topics, non-JSON and oversized bodies, odd frame
    counts), on the PULL and, with and without the empty frame, on the ROUTER (taproom's own
    ZeroMQ transport, fed by libzmq PUSH and DEALER peers), under small byte budgets, with each
    grammar ("device" is checked in C itself, "seed" by what Python accepted): the compiled take
    and the pure-Python take give the same batches (bytes and counts, at the same budget stops),
    the same rejections by reason, pings and replies."""
    _lib()
    config = dict(QUIET, max_message_bytes=1024, max_decompressed_bytes=1024, grammar=grammar)
    async with running_app(tmp_path, enable=["logjam"], logjam=config) as app:
        ingest = app.services["logjam"].ingest
        loop = asyncio.get_running_loop()
        own = {}
        for kind in ("PULL", "ROUTER"):
            own[kind] = ZmtpSocket(
                kind,
                hub=app.hub,
                protocol="logjam",
                name=f"logjam_{kind.lower()}",
                max_message_bytes=1 << 20,
            )
            await own[kind].bind("127.0.0.1", 0)
        pull, router = own["PULL"], own["ROUTER"]
        # Replies the ROUTER sends by itself (PING, 400) besides the 202s the takes return: the
        # real send, counted, so that each run reads exactly the replies it made.
        direct = [0]
        real_send = router.send

        def counted_send(frames):  # type: ignore[no-untyped-def]
            sent = real_send(frames)
            direct[0] += bool(sent)
            return sent

        router.send = counted_send  # type: ignore[method-assign]
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect("tcp://" + pull.address)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect("tcp://" + router.address)

        def metric_counts():
            reasons = {
                s.labels["reason"]: s.value
                for m in app.hub.metrics.registry.collect()
                for s in m.samples
                if s.name == "taproom_ingest_rejected_items_total"
                and s.labels.get("protocol") == "logjam"
            }
            return reasons, sample(app, "taproom_logjam_pings_total")

        async def run(take_kind, burst, router_side, budget):
            parser = ingest._parser()
            sock = router if router_side else pull
            message = ingest._router_message if router_side else ingest._pull_message
            one = lambda c, f, a: message(sock, parser.pusher(), c, f, a)  # noqa: E731
            if take_kind == "py":
                take = ingest_mod._python_take(one)
            else:
                take = ingest_mod._compiled_take(parser, sock, router_side, one)
            before = metric_counts()
            batches, start, sent = [], 0, 0
            direct[0] = 0
            while start < burst.n:
                parser.start_batch(1_700_000_000_000_000_000, budget)
                acks = []
                start = take(burst, start, acks)
                batch = parser.take_batch()
                batches.append((batch.count, bytes(batch.body), parser.not_json, start))
                replies = []
                for ack in acks:
                    if isinstance(ack, tuple):  # in order with the runs, as _send_acks sends
                        replies.append((ack[0], ingest._accepted_reply(ack[1])))
                    else:
                        ack.add_to(replies, ingest._accepted_reply)
                router.send_encoded_many(replies)
                sent += len(replies)
            after = metric_counts()
            counts = {k: v - before[0].get(k, 0) for k, v in after[0].items()}
            sent += direct[0]
            replies = await asyncio.to_thread(_replies, dealer, sent) if router_side else []
            return batches, {k: v for k, v in counts.items() if v}, after[1] - before[1], replies

        async def compare(n, router_side, budget):
            sock = router if router_side else pull
            reader = sock.reader(MAX_FRAMES)
            got = 0
            while got < n:
                await asyncio.wait_for(sock.wait_readable(), 10)
                burst = reader.recv(4096, 1 << 30)
                got += burst.n
                if burst.n:
                    # the buffers are the reader's: both takes run before the next recv
                    python = await run("py", burst, router_side, budget)
                    compiled = await run("ext", burst, router_side, budget)
                    assert compiled == python

        @settings(max_examples=fuzz_examples(150, 20_000), database=None)
        @given(
            st.lists(st.binary(max_size=120) | _usual_messages, min_size=1, max_size=30),
            st.lists(st.booleans(), min_size=30, max_size=30),
            st.integers(1, 2000),
            st.booleans(),
        )
        def check(blobs, delimiters, budget, router_side):
            messages = [b if isinstance(b, list) else _frames_from(b) for b in blobs]
            messages = [m if m else [b""] for m in messages]
            for k, frames in enumerate(messages):
                if router_side:
                    dealer.send_multipart([b""] * delimiters[k] + frames)
                else:
                    push.send_multipart(frames)
            asyncio.run_coroutine_threadsafe(
                compare(len(messages), router_side, budget), loop
            ).result(60)

        try:
            await asyncio.to_thread(check)
        finally:
            ctx.destroy(linger=0)
            pull.close()
            router.close()


@pytest.mark.parametrize("grammar", lj.GRAMMARS)
async def test_compiled_ingest_takes_the_usual_message_in_c(tmp_path, grammar):
    """The usual messages never reach Python: with grammar "device" not even the first (C
    checks app-env and topic as logjam-device does), with "seed" after the first of an app-env
    and topic (checked in Python, then learned). The batches are byte for byte the pure-Python
    path's."""
    _lib()
    async with running_app(tmp_path, enable=["logjam"], logjam=dict(QUIET, grammar=grammar)) as app:
        ctx = zmq.Context()
        try:
            seen = usual_messages_in_c(app.services["logjam"].ingest, ctx)
        finally:
            ctx.destroy(linger=0)
    assert seen == ([] if grammar == "device" else [BODY])


def usual_messages_in_c(ingest, ctx):
    push, pull = pair(ctx, name="usual")
    seen = []
    parser = ingest._parser()

    def one(count, frames, acks):
        seen.append(frames[2])
        return ingest._pull_message(pull, parser.pusher(), count, frames, acks)

    take = ingest_mod._compiled_take(parser, pull, False, one)
    for i in range(200):
        push.send_multipart([b"shop-production", b"logs.a", BODY, lj.encode_meta(0, 7, 5, i)])
    reader = zmqburst._ExtReader(pull, MAX_FRAMES)
    python_parser = ingest._parser()
    python_take = ingest_mod._python_take(
        lambda c, f, a: ingest._pull_message(pull, python_parser.pusher(), c, f, a)
    )
    got = []
    while len(got) < 200:
        assert pull.poll(5000)
        burst = reader.recv(4096, 1 << 30)
        parser.start_batch(1, 1 << 40)
        assert take(burst, 0, []) == burst.n
        batch = parser.take_batch()
        python_parser.start_batch(1, 1 << 40)
        python_take(burst, 0, [])
        assert batch == python_parser.take_batch()  # byte for byte
        got += lj_records(batch)
    assert [r.seq for r in got] == list(range(200))
    assert {(r.stream, r.topic, r.producer, r.content_type) for r in got} == {
        ("shop-production", "logs.a", "7", "json")
    }
    return seen


def lj_records(batch):
    from taproom.records import decode_batch

    return decode_batch(batch.body, 0)


@given(st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=9), max_size=40))
@settings(max_examples=fuzz_examples(200, 20_000), deadline=None, database=None)
def test_compiled_zmtp_wire_is_the_python_encoding(messages):
    """zt_wire (taproom's publishers, compiled) writes exactly what Burst.encode writes: every
    frame's header (short below 256 bytes, long from 256), MORE on all but the last."""
    from taproom.protocols.zmtp.pubsub import Burst

    before = zmqburst.active()
    zmqburst.select("ext")
    try:
        wire, ends = zmqburst.zmtp_wire(messages)
    finally:
        zmqburst.select(before)
    reference = Burst.encode(messages)
    assert bytes(wire) == reference.wire
    assert list(ends) == list(reference.ends)


def _routed_pair(ctx, name):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 4)
    router.bind(f"inproc://{name}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"peer")
    dealer.setsockopt(zmq.RCVHWM, 4)
    dealer.connect(f"inproc://{name}")
    dealer.send(b"hello")  # the ROUTER knows the peer once its first message is in
    assert router.poll(10_000)
    assert router.recv_multipart() == [b"peer", b"hello"]
    return router, dealer


@pytest.mark.parametrize("head", [b"SYNC", None])
def test_send_routed_sends_a_run_whole_and_resumes_where_the_peer_was_full(ctx, head):
    """eb_snap_send (a snapshot's C send): every message is the identity, the head and its
    frames, byte for byte and in order; a peer at its high-water mark stops the run with
    EAGAIN at a message boundary and the next call goes on from there, nothing lost or sent
    twice (a slipped offset or a half-sent message would show in the frames)."""
    router, dealer = _routed_pair(ctx, f"routed-{head}")
    rng = random.Random(7)
    sizes = [0, 1, 7, 33, 34, 255, 256, 4000, 70_000]
    messages = [
        (*(rng.randbytes(rng.choice(sizes)) for _ in range(3)), i.to_bytes(4, "big"))
        for i in range(300)
    ]
    received, stalls = [], 0
    deadline = time.monotonic() + 30
    for run in zmqburst.uniform_run(messages, 4, 64):  # runs of 64: the last one is short
        while True:
            error = zmqburst.send_routed(router, b"peer", head, run)
            if not error:
                break
            assert error == errno.EAGAIN, os.strerror(error)
            stalls += 1
            while dealer.poll(0):  # the client reads a little, the server goes on
                received.append(dealer.recv_multipart())
            assert time.monotonic() < deadline
        assert run.next == run.n
    while len(received) < len(messages):
        assert dealer.poll(10_000), f"only {len(received)} of {len(messages)} messages"
        received.append(dealer.recv_multipart())
    prefix = [head] if head is not None else []
    assert received == [[*prefix, *m] for m in messages]
    assert stalls > 0  # the resume path ran


def test_send_routed_reports_a_peer_gone_and_refuses_ragged_messages(ctx):
    """A ragged item stops the run before any of its frames goes: the messages before it
    arrive whole, and nothing of it or after it."""
    router, dealer = _routed_pair(ctx, "routed-gone")
    messages = [(b"a", b"b"), (b"c", b"d")]
    run = next(zmqburst.uniform_run(messages, 2, 16))
    assert zmqburst.send_routed(router, b"nobody", None, run) == errno.EHOSTUNREACH
    assert run.next == 0
    for ragged, whole in (
        ([(b"a", b"b"), (b"c",), (b"d", b"e", b"f")], 1),  # as many frames in all
        ([(b"a", b"b"), (b"c", "d")], 1),  # not bytes
        ([(b"a", b"b"), [b"c", b"d"]], 1),  # not a tuple
        (((b"a", b"b"),), 0),  # not a list
    ):
        run = next(zmqburst.uniform_run(ragged, 2, 16))  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            zmqburst.send_routed(router, b"peer", None, run)
        assert run.next == whole
        # then a marker: the next thing the peer gets (a half message would come first)
        marker = next(zmqburst.uniform_run([(b"end", b"mark")], 2, 16))
        assert zmqburst.send_routed(router, b"peer", None, marker) == 0
        expected = [[b"a", b"b"]] * whole + [[b"end", b"mark"]]
        for message in expected:
            assert dealer.poll(10_000)
            assert dealer.recv_multipart() == message
