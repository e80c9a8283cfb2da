"""The ingest hot path: :class:`IngestParser` validates logjam messages and writes their
records straight into one journal batch per burst (same rules and errors as
:func:`~taproom.protocols.logjam.messages.parse_message`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice

import orjson

from ...eventtime import EventTimes
from ...records import RECORD_HEAD, RECORD_HEAD_AFTER_LEN, BatchBuilder, EncodedBatch
from .codec import (
    _META22,
    _META24,
    META_TAG,
    META_VERSION,
    PING,
    LogjamError,
    LogjamLimit,
    decompress,
    parse_meta,
)
from .messages import MAX_CREATED_MS, PingMessage, is_valid_app_env, is_valid_topic, topic_text

__all__ = ["BURST_FULL", "BurstFull", "IngestParser", "IngestedBody", "Pushed"]

_PROTOCOL = b"logjam"
_JSON = b"json"
_RAW = b"raw"  # a body that is not JSON, kept as it came (logjam-device forwards any body)
_KINDS = frozenset({"logjam/json", "logjam/raw"})  # the journal's labels (EncodedBatch.kinds)
_FIELD_MAX = 65535  # records.py stores stream/topic/producer lengths as u16
_pack_head = RECORD_HEAD.pack


class IngestedBody(bytes):
    """The body of a batch :class:`IngestParser` built: logjam records only.

    The type is the mark: the PUB output, handed the same object by the hub, publishes such a
    batch without checking each record's protocol. Equal to (and stored as) plain bytes.
    """

    __slots__ = ()


class BurstFull:
    """What :meth:`IngestParser.push` returns once the records of the current batch reach the
    byte budget given to :meth:`IngestParser.start_batch` (the message itself is stored)."""

    __slots__ = ()


BURST_FULL = BurstFull()

# What push answers: None (stored), a ping (answered, not stored) or BURST_FULL (stored, and
# the batch has reached its byte budget).
Pushed = PingMessage | BurstFull | None


class IngestParser:
    """The ingest hot path: validates four frames and appends the record to a batch.

    Same rules and errors as :func:`parse_message`, without building :class:`DataMessage`
    objects, and with the grammar checks of app-envs and topics already seen cached (bounded).

    Two ways in, byte-identical results (a test proves it):

    * :meth:`add` appends to a :class:`~taproom.records.BatchBuilder` (tests, odd shapes);
    * :meth:`push` appends to the parser's own batch, writing the record head with
      ``records.RECORD_HEAD`` directly: everything of a record but its head, times and body
      (protocol, content type, stream, topic, producer) is one cached byte string per
      (app-env, topic, device), so a message costs one ``struct.pack`` and three list items.
      :meth:`start_batch` / :meth:`take_batch` frame a burst, and the byte budget given to
      :meth:`start_batch` bounds what one burst inflates to.

    ``not_json`` counts the bodies stored as "raw" because they are not JSON.
    """

    __slots__ = (
        "_app_envs",
        "_built",
        "_fixed",
        "_fixed_raw",
        "_get_budget",
        "_parts",
        "_producers",
        "_push",
        "_set_budget",
        "_topics",
        "grammar",
        "max_body",
        "max_decompressed",
        "not_json",
        "received_ns",
        "times",
    )

    _CACHE = 4096  # distinct app-envs/topics remembered; beyond it they are checked each time

    def __init__(self, *, max_body: int, max_decompressed: int, grammar: str = "device") -> None:
        self.max_body = max_body
        self.max_decompressed = max_decompressed
        self.grammar = grammar
        self.not_json = 0
        # The event-time rule (taproom.eventtime): its tally of created-ms the journal cannot
        # hold (stored 0); the compiled path adds its own count (lj_built.time_out_of_range).
        self.times = EventTimes()
        self._app_envs: dict[bytes, str] = {}
        self._topics: dict[bytes, str] = {}
        self._producers: dict[int, str] = {}
        # (app-env, topic, device) -> (the record's fixed bytes, head length field minus the
        # payload, len(stream), len(topic), len(producer))
        self._fixed: dict[tuple[bytes, bytes, int], tuple[bytes, int, int, int, int]] = {}
        self._fixed_raw: dict[tuple[bytes, bytes, int], tuple[bytes, int, int, int, int]] = {}
        self._parts: list[bytes | memoryview] = []  # three per record: head, fixed part, payload
        self._built = 0  # records added whole by add_records, beyond one per three parts
        self.received_ns = 0
        self._push, self._set_budget, self._get_budget = self._make_push()

    # --- the fast path: the parser's own batch ----------------------------------------------

    def start_batch(self, received_ns: int, max_bytes: int = 1 << 62) -> None:
        """Start a batch whose records all carry ``received_ns`` (as one BatchBuilder does);
        :meth:`push` answers :data:`BURST_FULL` once its payloads reach ``max_bytes``."""
        self._parts.clear()
        self._built = 0
        self.received_ns = received_ns
        self._set_budget(max_bytes)

    def pending(self) -> int:
        """Records pushed since :meth:`start_batch` (three parts each)."""
        return len(self._parts) // 3 + self._built

    def take_batch(self) -> EncodedBatch:
        """The records pushed since :meth:`start_batch`, as one journal batch."""
        parts = self._parts
        batch = EncodedBatch(self.pending(), IngestedBody(b"".join(parts)), _KINDS)
        parts.clear()
        self._built = 0
        return batch

    def add_records(self, records: bytes | memoryview, count: int) -> None:
        """Append ``count`` records written elsewhere exactly as :meth:`push` writes them (the
        compiled burst path, taproom.zmqburst), in order with pushed ones. ``records`` is
        read (copied) only by :meth:`take_batch`."""
        self._parts.extend((records, b"", b""))
        self._built += count - 1

    @property
    def budget(self) -> int:
        """Bytes of bodies the current batch may still take before :meth:`push` answers
        :data:`BURST_FULL` (shared with the compiled burst path, which counts the same)."""
        return self._get_budget()

    @budget.setter
    def budget(self, value: int) -> None:
        self._set_budget(value)

    def push(self, app_env: bytes, topic: bytes, body: bytes, meta_frame: bytes) -> Pushed:
        """Validate one four-frame message and append its record to the current batch; a ping
        is returned, not stored; :data:`BURST_FULL` says the batch has reached its byte budget.
        Raises :class:`LogjamError` like :func:`parse_message`."""
        return self._push(app_env, topic, body, meta_frame)

    def pusher(self) -> Callable[[bytes, bytes, bytes, bytes], Pushed]:
        """:meth:`push` itself, for loops that call it per message."""
        return self._push

    def _make_push(
        self,
    ) -> tuple[
        Callable[[bytes, bytes, bytes, bytes], Pushed], Callable[[int], None], Callable[[], int]
    ]:
        # A closure rather than a method: what it needs per message is in its cells, not
        # behind attribute and global lookups (~0.5 us a message, measured). The bounds are
        # read once: a parser's settings do not change after construction. The byte budget
        # left in this batch is a cell too, set by the second closure.
        extend = self._parts.extend
        fixed_get = self._fixed.get
        fixed_part = self._fixed_part
        fixed_raw_get = self._fixed_raw.get
        parser = self
        budget = 0
        unpack24, unpack22 = _META24.unpack, _META22.unpack
        loads, json_error = orjson.loads, orjson.JSONDecodeError
        pack_head = _pack_head
        max_body, max_decompressed = self.max_body, self.max_decompressed
        max_created = MAX_CREATED_MS
        times = self.times
        tag_ok, version_ok, ping, field_max = META_TAG, META_VERSION, PING, _FIELD_MAX

        def push(app_env: bytes, topic: bytes, body: bytes, meta_frame: bytes) -> Pushed:
            nonlocal budget
            size = len(meta_frame)
            if size == 24:
                tag, method, version, device, created, seq = unpack24(meta_frame)
            elif size == 22:
                tag, method, version, device, created, seq = unpack22(meta_frame)
            else:
                tag = 0
            if tag != tag_ok or version != version_ok or method > 3:
                meta = parse_meta(meta_frame)  # the byte-swapped form, or the precise error
                method, device, created, seq = (
                    meta.compression,
                    meta.device,
                    meta.created_ms,
                    meta.sequence,
                )
            if app_env == ping:  # rare: the full decode is fine here
                return PingMessage(topic.decode("ascii", "replace")[:255], parse_meta(meta_frame))
            fixed = fixed_get((app_env, topic, device))
            if fixed is None:
                if len(app_env) > field_max or len(topic) > field_max:
                    # Over records.py's u16 field bound: the builder's checks and errors, in
                    # its order (after the body's), rather than a second copy of them here.
                    builder = BatchBuilder(parser.received_ns)
                    self._add(builder, app_env, topic, body, method, device, created, seq)
                    extend((builder.build().body, b"", b""))  # one record, three parts
                    return None
                fixed = fixed_part(app_env, topic, device, _JSON)
            if len(body) > max_body:
                raise LogjamLimit(
                    f"body is {len(body)} bytes, at most {max_body}", reason="body_too_large"
                )
            data = decompress(method, body, max_decompressed) if method else body
            n = len(data)
            if n > max_decompressed:
                raise LogjamLimit(
                    "body over the decompressed bound", reason="decompressed_too_large"
                )
            try:
                loads(data)
            except json_error:
                parser.not_json += 1
                key = (app_env, topic, device)
                fixed = fixed_raw_get(key) or fixed_part(app_env, topic, device, _RAW)
                content_type_size = 3
            else:
                content_type_size = 4
            fixed_bytes, after_len, ls, lt, lr = fixed
            if created > max_created:  # times.ms(created), inline on the hot path
                created = 0
                times.out_of_range += 1
            extend(
                (
                    pack_head(
                        after_len + n,
                        parser.received_ns,
                        created * 1_000_000,
                        seq,
                        6,
                        content_type_size,
                        ls,
                        lt,
                        lr,
                        0,
                        0,
                        n,
                    ),
                    fixed_bytes,
                    data,
                )
            )
            budget -= n
            return BURST_FULL if budget <= 0 else None

        def set_budget(max_bytes: int) -> None:
            nonlocal budget
            budget = max_bytes

        def get_budget() -> int:
            return budget

        return push, set_budget, get_budget

    def _fixed_part(
        self, app_env: bytes, topic: bytes, device: int, content_type: bytes
    ) -> tuple[bytes, int, int, int, int]:
        """Validate app-env and topic (cached like :meth:`add`) and make the cache entry."""
        self._stream(app_env)
        self._topic(topic)
        producer = str(device).encode()
        fixed_bytes = _PROTOCOL + content_type + app_env + topic + producer
        fixed = (
            fixed_bytes,
            RECORD_HEAD_AFTER_LEN + len(fixed_bytes),
            len(app_env),
            len(topic),
            len(producer),
        )
        cache = self._fixed if content_type == _JSON else self._fixed_raw
        if len(cache) < self._CACHE:
            cache[(app_env, topic, device)] = fixed
        return fixed

    def validated(self, app_envs_from: int, topics_from: int) -> tuple[list[bytes], list[bytes]]:
        """The app-envs and topics the grammar accepted, in the order first seen, from the
        given counts on (at most ``_CACHE`` of each are remembered; the compiled burst path
        learns them from here)."""
        app_envs, topics = self._app_envs, self._topics
        return (
            list(islice(app_envs, app_envs_from, None)) if len(app_envs) > app_envs_from else [],
            list(islice(topics, topics_from, None)) if len(topics) > topics_from else [],
        )

    # --- the BatchBuilder path ----------------------------------------------------------------

    def add(self, builder: BatchBuilder, frames: Sequence[bytes]) -> PingMessage | None:
        """Append one data message to ``builder``; a ping is returned, not stored."""
        if len(frames) != 4:
            raise LogjamError(f"{len(frames)} frames, expected 4", reason="bad_frame_count")
        app_env, topic, body, meta_frame = frames
        size = len(meta_frame)
        if size == 24:
            tag, method, version, device, created, seq = _META24.unpack(meta_frame)
        elif size == 22:
            tag, method, version, device, created, seq = _META22.unpack(meta_frame)
        else:
            tag = 0
        if tag != META_TAG or version != META_VERSION or method > 3:
            meta = parse_meta(meta_frame)  # the byte-swapped form, or the precise error
            method, device, created, seq = (
                meta.compression,
                meta.device,
                meta.created_ms,
                meta.sequence,
            )
        if app_env == PING:  # rare: the full decode is fine here
            return PingMessage(topic.decode("ascii", "replace")[:255], parse_meta(meta_frame))
        self._add(builder, app_env, topic, body, method, device, created, seq)
        return None

    def _stream(self, app_env: bytes) -> str:
        stream = self._app_envs.get(app_env)
        if stream is None:
            if not is_valid_app_env(app_env, grammar=self.grammar):
                raise LogjamError("app-env does not match the grammar", reason="bad_app_env")
            stream = app_env.decode("ascii")
            if len(self._app_envs) < self._CACHE:
                self._app_envs[app_env] = stream
        return stream

    def _topic(self, topic: bytes) -> str:
        topic_str = self._topics.get(topic)
        if topic_str is None:
            if not is_valid_topic(topic, grammar=self.grammar):
                raise LogjamError("topic does not match the grammar", reason="bad_topic")
            topic_str = topic_text(topic)
            if len(self._topics) < self._CACHE:
                self._topics[topic] = topic_str
        return topic_str

    def _add(
        self,
        builder: BatchBuilder,
        app_env: bytes,
        topic: bytes,
        body: bytes,
        method: int,
        device: int,
        created: int,
        seq: int,
    ) -> None:
        stream = self._stream(app_env)
        topic_str = self._topic(topic)
        if len(body) > self.max_body:
            raise LogjamLimit(
                f"body is {len(body)} bytes, at most {self.max_body}", reason="body_too_large"
            )
        data = decompress(method, body, self.max_decompressed) if method else body
        if not method and len(data) > self.max_decompressed:
            raise LogjamLimit("body over the decompressed bound", reason="decompressed_too_large")
        try:
            orjson.loads(data)
        except orjson.JSONDecodeError:
            self.not_json += 1
            content_type = "raw"
        else:
            content_type = "json"
        producer = self._producers.get(device)
        if producer is None:
            producer = str(device)
            if len(self._producers) < self._CACHE:
                self._producers[device] = producer
        builder.add(
            "logjam",
            data,
            stream=stream,
            topic=topic_str,
            producer=producer,
            seq=seq,
            ts_ns=self.times.ms(created),
            content_type=content_type,
        )
