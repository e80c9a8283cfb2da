"""Event time: one rule for the producer's time of every protocol (docs/architecture.md).

A record's ``ts_ns`` is the time the producer gave the event, in nanoseconds since the Unix
epoch, a signed 64-bit integer (1677-09-21T00:12:43.145224192Z .. 2262-04-11T23:47:16.854775807Z).
``0`` means **absent**: the producer gave none, or one the journal cannot hold. The rule:

* A time outside that range (a Lumberjack ``@timestamp`` in year 9999 or 0001, a logjam
  ``created_ms`` of 2^62, an Event BUS timestamp in 2426) is stored as absent and counted as an
  odd event, ``taproom_ingest_odd_events_total{protocol, reason="time_out_of_range"}``. The
  event itself is kept: it is refused only where the protocol's seed says so.
* A time of 0 (1970-01-01T00:00:00Z), which producers send for "unknown" (logjam-device's
  created-ms 0), is absent, not counted.
* Readers show an absent time as null (``taproom tail``, Spark's ``ts``), and the Spark
  rollups place such events by their receive time.

Every protocol converts through one :class:`EventTimes` (one per parser, connection or read
loop; no clock, no I/O, so the sans-I/O cores use it too); the server turns its
``out_of_range`` tally into the metric (:meth:`taproom.metrics.Metrics.odd`). The compiled
logjam path (``zmqburst/burst.c``, ``lj_build``) applies the same bounds and reports its count.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = [
    "ABSENT",
    "MAX_MS",
    "MAX_NS",
    "MIN_MS",
    "MIN_NS",
    "TIME_OUT_OF_RANGE",
    "EventTimes",
]

ABSENT = 0
MIN_NS = -(1 << 63)
MAX_NS = (1 << 63) - 1
# Whole milliseconds (and seconds) whose nanoseconds fit: the bounds the integer paths check.
MIN_MS = -(-MIN_NS // 1_000_000)
MAX_MS = MAX_NS // 1_000_000
TIME_OUT_OF_RANGE = "time_out_of_range"  # the odd-event reason

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_SECOND = timedelta(seconds=1)
# Dates seen recently (text up to the second -> epoch seconds): producers send many events per
# second, so most times parse with one dict look-up and an int() of the fraction.
_SECONDS_CACHE_ENTRIES = 4096
_DIGITS = frozenset("0123456789")
_MILLIS = {f"{ms:03d}": ms * 1_000_000 for ms in range(1000)}  # "123" -> its nanoseconds


class EventTimes:
    """Producer times to ``ts_ns`` by the rule above; counts what it had to leave out.

    ``out_of_range`` grows by one for each time outside the journal's range; the owner reads
    and resets it with :meth:`take`.
    """

    __slots__ = ("_seconds", "out_of_range")

    def __init__(self) -> None:
        self.out_of_range = 0
        self._seconds: dict[str, int] = {}

    def take(self) -> int:
        """The out-of-range count since the last call."""
        count = self.out_of_range
        self.out_of_range = 0
        return count

    def ns(self, ns: int) -> int:
        """A time in nanoseconds."""
        if MIN_NS <= ns <= MAX_NS:
            return ns
        self.out_of_range += 1
        return ABSENT

    def ms(self, ms: int) -> int:
        """A time in whole milliseconds (logjam ``created_ms``, LogTK ``_time``)."""
        if MIN_MS <= ms <= MAX_MS:
            return ms * 1_000_000
        self.out_of_range += 1
        return ABSENT

    def float_ms(self, ms: float) -> int:
        """A time in milliseconds as a float (a JSON number); NaN and infinities are absent."""
        if ms != ms:  # NaN
            return ABSENT
        if MIN_MS <= ms <= MAX_MS:
            return int(ms * 1_000_000)
        self.out_of_range += 1
        return ABSENT

    def datetime(self, when: datetime) -> int:
        """An aware ``datetime`` (naive: UTC)."""
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return self.ns(((when - _EPOCH) // _MICROSECOND) * 1000)

    def iso(self, text: str) -> int | None:
        """An ISO 8601 date-time (a zone, ``Z``, or none: UTC). ``None`` when ``text`` is not
        one (a bare date included): the caller refuses it where its seed says so, else stores
        the event without a time. Nanosecond fractions are kept."""
        # Hot path (Lumberjack's @timestamp, once per event): Beats' and JavaScript's form,
        # YYYY-MM-DDTHH:MM:SS.mmmZ, whose second is usually one seen just before.
        if len(text) == 24 and text[23] == "Z" and text[19] == ".":
            base = self._seconds.get(text[:19])
            if base is not None:
                millis = _MILLIS.get(text[20:23])
                if millis is not None:
                    return base + millis
        return self._iso(text)

    def _iso(self, text: str) -> int | None:
        n = len(text)
        # YYYY-MM-DDTHH:MM:SS[.fraction](Z|+00:00): the second from the cache (or once from
        # fromisoformat), the fraction as an integer.
        if 20 <= n <= 35 and text[10] in "Tt " and text[19] in ".Zz+" and text[4] == "-":
            if text[-1] in "Zz":
                end = n - 1
            elif text.endswith("+00:00"):
                end = n - 6
            else:
                end = -1
            if end >= 19:
                fraction = text[20:end] if text[19] == "." else ""
                if (end == 19 or (text[19] == "." and 1 <= len(fraction) <= 9)) and (
                    not fraction or _DIGITS.issuperset(fraction)
                ):
                    head = text[:19]
                    frac_ns = int(fraction.ljust(9, "0")) if fraction else 0
                    base = self._seconds.get(head)
                    if base is not None:  # a second wholly within the range
                        return base + frac_ns
                    base = self._second_ns(head)
                    if base is not None:
                        return self.ns(base + frac_ns)
        if not 16 <= n <= 64 or text[10:11] not in ("T", "t", " "):
            return None
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            return None
        ns = self.datetime(when)
        fraction_at = text.find(".", 19)
        if fraction_at == 19 and ns:  # fromisoformat keeps microseconds: add the rest back
            digits = text[20:]
            k = 0
            while k < len(digits) and digits[k] in _DIGITS:
                k += 1
            if 7 <= k <= 9:
                ns += int(digits[6:k].ljust(3, "0"))
        return ns

    def _second_ns(self, head: str) -> int | None:
        """Nanoseconds of ``YYYY-MM-DDTHH:MM:SS`` (UTC), or None when it is not a date-time.
        A second wholly within the journal's range is remembered (the hot path then needs no
        range check)."""
        try:
            when = datetime.fromisoformat(head)
        except ValueError:
            return None
        base = ((when.replace(tzinfo=UTC) - _EPOCH) // _SECOND) * 1_000_000_000
        if MIN_NS <= base <= MAX_NS - 999_999_999:
            if len(self._seconds) >= _SECONDS_CACHE_ENTRIES:
                self._seconds.clear()
            self._seconds[head] = base
        return base
